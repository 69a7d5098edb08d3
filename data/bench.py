"""``python -m data.bench [--out DIR] [--steps N]``: data-pipeline throughput on this machine.

Measures (1) preprocessing throughput (JSONL -> .bin/.idx, tokens/s incl. reading and writing) on
the demo corpus and (2) loader wall time per batch (ms) for 16K and 4K pretraining batches in
document and EOD mode and for packed 16K SFT batches. Writes ``DIR/data_bench.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from data.third_party_noise import quiet_third_party


def _time_loader(loader, steps: int) -> dict:
    next(loader)  # warm-up (index mmap, first page faults)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        next(loader)
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"ms_mean": round(statistics.fmean(ts), 3), "ms_p50": round(ts[len(ts) // 2], 3),
            "ms_p95": round(ts[int(len(ts) * 0.95) - 1], 3), "steps": steps}


def run(out_dir: str, steps: int = 100) -> dict:
    import megatron.core
    import tokenizers
    import torch

    from data.config import DataConfig, SFTConfig
    from data.demo_corpus import build_demo
    from data.loader import build_pretrain_loaders, build_sft_loader
    from data.preprocess import preprocess

    man = build_demo(log=lambda m: print(m, file=sys.stderr))
    res = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__,
           "megatron_core": megatron.core.__version__, "tokenizers": tokenizers.__version__,
           "corpus": man["stats"], "results": []}
    try:
        with open("/proc/cpuinfo") as f:
            res["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        s = preprocess(man["corpus"], man["tokenizer"], os.path.join(tmp, "bench"), progress=False)
        res["results"].append({"name": "preprocess jsonl->bin/idx", "documents": s["documents"], "tokens": s["tokens"],
                               "seconds": s["seconds"], "tokens_per_s": s["tokens_per_s"]})
        cache = os.path.join(tmp, "idx")
        for S, B, mode in [(16384, 1, "document"), (16384, 1, "eod"), (4096, 4, "document")]:
            cfg = DataConfig(paths=[man["indexed_prefix"]], tokenizer=man["tokenizer"], seq_length=S,
                             micro_batch_size=B, packing=mode, split="100,0,0", cache_dir=cache)
            t = time.perf_counter()
            tl, _ = build_pretrain_loaders(cfg)
            build_s = time.perf_counter() - t
            r = _time_loader(tl, steps)
            res["results"].append({"name": f"pretrain {mode} S={S} B={B}", "build_s": round(build_s, 3), **r,
                                   "tokens_per_s": round(S * B / (r["ms_mean"] / 1e3))})
        # short documents (mean ~300 tokens, web-like): ~55 documents per 16K sample
        import numpy as np

        from data.indexed import write_indexed
        from data.tokenizer import Tokenizer

        tok = Tokenizer(man["tokenizer"])
        rng = np.random.default_rng(0)
        lens = rng.geometric(1 / 300, size=8000) + 1
        docs = (np.append(rng.integers(0, tok.vocab_size, size=n - 1), tok.eod) for n in lens)
        short = os.path.join(tmp, "short")
        write_indexed(short, docs, tok.vocab_size)
        cfg = DataConfig(paths=[short], tokenizer=man["tokenizer"], seq_length=16384, micro_batch_size=1,
                         split="100,0,0", cache_dir=cache)
        t = time.perf_counter()
        tl, _ = build_pretrain_loaders(cfg, tokenizer=tok)
        build_s = time.perf_counter() - t
        r = _time_loader(tl, min(steps, len(tl) - 1))
        res["results"].append({"name": "pretrain document S=16384 short docs", "build_s": round(build_s, 3), **r,
                               "tokens_per_s": round(16384 / (r["ms_mean"] / 1e3))})
        cfg = SFTConfig(path=man["sft"], tokenizer=man["tokenizer"], seq_length=16384, micro_batch_size=1)
        t = time.perf_counter()
        sl = build_sft_loader(cfg, log=lambda m: None)
        build_s = time.perf_counter() - t
        r = _time_loader(sl, min(steps, max(1, len(sl) - 1)))
        res["results"].append({"name": "sft packed S=16384 B=1", "build_s": round(build_s, 3), **r,
                               "tokens_per_s": round(16384 / (r["ms_mean"] / 1e3))})
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "data_bench.json"), "w") as f:
        json.dump(res, f, indent=2)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    quiet_third_party()
    res = run(args.out, args.steps)
    print(f"CPU: {res['cpu']} ({res['cores']} cores) | python {res['python']} | torch {res['torch']} | "
          f"megatron-core {res['megatron_core']} | tokenizers {res['tokenizers']}")
    print(f"{'benchmark':38s} {'build s':>8s} {'ms/batch':>9s} {'p95 ms':>8s} {'tokens/s':>12s}")
    for r in res["results"]:
        print(f"{r['name']:38s} {r.get('build_s', r.get('seconds', 0)):8.2f} {r.get('ms_mean', float('nan')):9.2f} "
              f"{r.get('ms_p95', float('nan')):8.2f} {r['tokens_per_s']:12,.0f}")
    print(f"wrote {os.path.join(args.out, 'data_bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
