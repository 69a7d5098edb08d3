"""Everything for one checkpoint in one model load: locality + offload, RULER-style tasks, perplexity.

    python -m eval.suite --ckpt <ckpt> --tasks DIR --data <prefix | jsonl> --length N [--split 95,5,0]
        [--docs 4] [--ppl-docs 8] [--samples N] --out DIR

Writes ``locality.*``, ``ruler.*``, ``items.jsonl``, ``ppl.*`` and ``result.json`` (the numbers of
one ablation row) under ``--out``; ``result.json`` is written last, so its presence means done.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from runtime.outputs import write_atomic, write_json

RESULT = "result.json"


@dataclass
class SuiteConfig:
    """``length``: tokens of the locality and perplexity documents; RULER uses every length of the
    task set up to the model's context (``ruler_limit`` samples per task and length; None: all)."""

    length: int
    docs: int = 4
    ppl_docs: int = 8
    split: Optional[str] = None
    ruler_limit: Optional[int] = None
    bandwidth_gb_s: float = 55.0
    capacity: Optional[int] = None


def evaluate(ckpt: str, tasks_dir: str, data: str, out: str, cfg: SuiteConfig, tokenizer: Optional[str] = None,
             dtype: str = "auto", log=print) -> dict:
    from eval import locality, ppl, ruler
    from eval.documents import load_documents
    from eval.load import check_length, load_model, load_tokenizer, resolve_source
    from eval.tasks import load_task_set

    t0 = time.perf_counter()
    out_dir = Path(out)
    src = resolve_source(ckpt, tokenizer)
    check_length(src, cfg.length)
    tok = load_tokenizer(src)
    ts = load_task_set(tasks_dir)
    ts.check_tokenizer(tok.path)
    lengths = [n for n in ts.lengths if n <= src.model.max_position_embeddings]
    need = max(cfg.docs, cfg.ppl_docs)
    docs = load_documents(data, tok, cfg.length, need, src.model.vocab_size, cfg.split, join=True, log=log)
    model = load_model(src, dtype=dtype)
    log(f"[{src.label}] locality on {min(cfg.docs, len(docs))} document(s) of {cfg.length} tokens")
    loc = locality.analyze(model, docs[:cfg.docs], locality.LocalityConfig(
        cfg.length, min(cfg.docs, len(docs)), capacity=cfg.capacity, bandwidth_gb_s=cfg.bandwidth_gb_s), log)
    locality.write_report(loc, out_dir)
    log(f"[{src.label}] RULER-style tasks at {lengths}")
    items = ruler.score_direct(model, tok, ts, lengths, ts.tasks, cfg.ruler_limit, log)
    rs = ruler.write_outputs(items, out_dir, src, "direct")
    log(f"[{src.label}] perplexity by position on {min(cfg.ppl_docs, len(docs))} document(s)")
    pp = ppl.perplexity_by_bucket(model, docs[:cfg.ppl_docs], cfg.length, log=lambda *_: None)
    write_json(out_dir / "ppl.json", pp)
    write_atomic(out_dir / "ppl.md", ppl.markdown(pp, f"Perplexity by position: {src.label}"))
    result = {"model": loc["model"], "config": asdict(cfg), "locality": loc["summary"], "dense": loc["dense"],
              "ruler": {k: rs[k] for k in ("average", "average_stderr", "by_task", "by_length", "by_task_detail",
                                           "by_length_detail", "needles", "graded")} | {"items": len(items)},
              "ppl": pp, "seconds": time.perf_counter() - t0}
    write_json(out_dir / RESULT, result)
    ruler_avg = "none of the task lengths fits its context" if rs["average"] is None else f"{rs['average']:.1f}"
    log(f"[{src.label}] {locality.summary_line(loc)}; RULER {ruler_avg}; "
        f"ppl {pp['overall']['ppl']:.2f} ({result['seconds']:.0f} s)")
    return result


def main(argv=None) -> int:
    from eval import CKPT_HELP
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help=CKPT_HELP)
    ap.add_argument("--tasks", required=True, help="task set dir (python -m eval.tasks)")
    ap.add_argument("--data", required=True, help="held-out documents: indexed prefix or JSONL")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--split", default=None)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--ppl-docs", type=int, default=8)
    ap.add_argument("--samples", type=int, default=None, help="RULER samples per (task, length) (default: all)")
    ap.add_argument("--bandwidth-gbs", type=float, default=55.0)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg = SuiteConfig(a.length, a.docs, a.ppl_docs, a.split, a.samples, a.bandwidth_gbs)
    return run_cli("eval.suite", evaluate, a.ckpt, a.tasks, a.data, a.out, cfg, a.tokenizer, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
