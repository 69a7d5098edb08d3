"""End-to-end training throughput and multi-GPU parity of the trainer (train/main.py) on GPUs.

Runs, each as its own train/main.py process on the demo data, and prints / writes a table:

* ``nosa_1gpu``:  1B-shaped NOSA CPT (recipe nosa_1b_cpt: 28 layers, 16 / 2 heads, 16K tokens,
  LongRoPE, selective recompute, Triton kernels), one GPU;
* ``dense_1gpu``: the same model with dense attention (PyTorch SDPA, flash / cuDNN, EOD packing:
  causal attention across the documents of a sample, as Megatron-LM pretraining does by default);
* ``dense_doc_1gpu``: dense attention on NOSA's document packing (THD: no attention across
  documents; one variable-length FlashAttention-2 call per layer), the like-for-like masking of
  the NOSA run;
* ``nosa_tp2``:   the NOSA run at tensor parallel 2 on two GPUs (skipped with fewer GPUs), whose
  loss curve is compared with ``nosa_1gpu`` step by step (same data, same CPU-initialised weights);
* a ``_nr`` suffix (``nosa_1gpu_nr``, ``dense_1gpu_nr``): the same run without activation recompute.

Per run, over the steps after ``--warmup``: tokens/s as total tokens / total wall time (what users pay) and as
the median step, the p90 / median step-time ratio (steadiness), MFU (dense bf16 peak of the GPU), peak memory,
the GPUs' SM clock, power and slowdown reasons within the measured steps (``bench.gpu_clocks``: whether both
runs ran at the same clocks), per-step losses and gradient norms (whether a loss spike followed a growing
gradient), per-step times with each step's attention work (the trainer's ``attention_work``: sum of squared
document lengths / S^2) and the line fitted through them (how much of the step-to-step variation the documents
explain, and p90 / median once it is taken out); with ``--profile-step N``
also the GPU time per step by part
(attention forward / backward, NOSA selection and index, eviction head, the rest) and the 15
largest kernels of the rest from ``profile.*`` of the trainer. Both runs of a pair take the same
``train.fusions`` (on by default; ``--extra train.fusions=false`` for the unfused layers). The two
profiled steps are left out of the measured steps (``tokens_per_s_with_profiled_steps`` keeps them). Usage::

    python -m bench.train_throughput --out DIR [--steps 20] [--warmup 3] [--recipe nosa_1b_cpt] [--layers 28]
        [--seq 16384[,32768]] [--global-batch 2] [--data PREFIX --tokenizer DIR] [--runs nosa_1gpu,dense_1gpu,nosa_tp2]
        [--loss-impl fused,chunked] [--quick] [--profile-step N] [--extra key=value ...] [--source CHECKOUT]

Comparing losses (``train.loss_impl``): ``--loss-impl fused,chunked`` runs every run once per loss, and ``--seq``
takes several lengths (``--seq 16384,32768``): every run once per length. Such a run is named
``<run>_<seq/1024>k_<loss>`` (``<run>_<seq>_<loss>`` below 1K; each part only when several lengths or a
``--loss-impl`` are given), and a table
compares each loss with the first one of its run and length: tokens/s, peak memory, the largest loss difference
over the steps both reached, and out-of-memory failures (also in ``loss_impl_comparison`` of the JSON). The 1B
shape with 14 layers at 16K and 32K, 4 sequences per step, NOSA and dense, megatron-core's fused whole-logit loss
against the chunked one, without activation recompute (8 runs of about a minute each on one GPU)::

    python -m bench.train_throughput --out OUT --layers 14 --seq 16384,32768 --global-batch 4 --steps 4 \
        --warmup 2 --runs nosa_1gpu_nr,dense_1gpu_nr --loss-impl fused,chunked \
        --extra model.max_position_embeddings=32768

``--quick``: the same comparison on a CPU, about a minute per run (``tiny_cpt``, 2 layers, 128 and 256 tokens,
3 steps, ``nosa_1gpu``, ``--loss-impl standard,chunked``); options given explicitly win.

Runs log every step (``train.log_interval=1``); with ``--extra train.log_interval=N`` each row's interval
means count for the N steps it covers (e.g. to time ``train.step_reads=at_log``, whose host reads wait for the
GPU only at logged steps). ``--source`` runs another checkout's ``train/main.py`` under this harness
(``bench.probes.ab_throughput`` uses it to time two versions of the code alike). Relative paths are taken from
the current directory; the default data is this repository's ``.cache/demo_data``.

The demo corpus is mostly short files (46% of its tokens are in documents shorter than 16K), so
document masking already removes most attention work there. For the document lengths of a
long-context CPT mix, merge its documents first and pass the copy with ``--data``:
``python -m data.merge_documents --src .cache/demo_data/corpus_text_document --out
.cache/demo_data/corpus_long16k --min-tokens 16384``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_clocks import GpuSampler, summarize
from data.demo_corpus import DEFAULT_OUT

ROOT = Path(__file__).resolve().parent.parent


# --quick: the CPU-sized comparison (options given explicitly win)
QUICK = {"recipe": "tiny_cpt", "layers": 2, "seq": "128,256", "steps": 3, "warmup": 1, "global_batch": 2,
         "runs": "nosa_1gpu", "loss_impl": "standard,chunked", "timeout": 300}
DEFAULTS = {"recipe": "nosa_1b_cpt", "layers": 28, "seq": "16384", "steps": 20, "warmup": 3, "global_batch": 2,
            "runs": "nosa_1gpu,dense_1gpu,nosa_tp2", "loss_impl": None, "timeout": 420}


def run_config(name: str, a: argparse.Namespace, label: str | None = None) -> tuple[list[str], int]:
    """Overrides and process count of run ``name`` (``nosa_1gpu``, ``dense_1gpu``, ... with an optional ``_nr``)
    at ``a.seq`` tokens with loss ``a.loss_impl`` (None: the trainer's default), in ``OUT/<label>``."""
    common = [f"recipe={a.recipe}", f"data.paths=[{a.data}]", f"data.tokenizer={a.tokenizer}",
              f"train.max_steps={a.steps}", f"train.global_batch_size={a.global_batch}", "train.micro_batch_size=1",
              f"train.seq_length={a.seq}", "train.eval_interval=0", "train.eval_iters=0", "train.log_interval=1",
              "optim.warmup_steps=2", "checkpoint.save=false", "checkpoint.resume=none", "logging.plot=false",
              "run.cpu_init=true", f"model.num_layers={a.layers}", f"run.dir={a.out}/{label or name}"]
    if getattr(a, "loss_impl", None):
        common.append(f"train.loss_impl={a.loss_impl}")
    if a.profile_step:
        common += [f"profile.start_step={a.profile_step}", "profile.num_steps=2"]
    if name.endswith("_nr"):
        common.append("train.recompute=none")
        name = name[:-3]
    common += a.extra
    if name == "nosa_1gpu":
        return common, 1
    if name == "dense_1gpu":
        return [*common, "attention=dense", "data.packing=eod", "train.locality_interval=0"], 1
    if name == "dense_doc_1gpu":
        return [*common, "attention=dense", "train.locality_interval=0"], 1
    if name == "nosa_tp2":
        return [*common, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], 2
    raise ValueError(f"unknown run {name!r}")


def variants(a: argparse.Namespace) -> list[tuple[str, str, int, str | None]]:
    """``(label, run, seq, loss_impl)`` of every run to launch: each of ``a.runs`` at each of ``a.seq`` (comma
    lists) with each of ``a.loss_impl`` (None: the trainer's default); labels as the module docstring says."""
    seqs = [int(x) for x in str(a.seq).split(",")]
    impls = a.loss_impl.split(",") if a.loss_impl else [None]
    out = []
    for name in a.runs.split(","):
        for seq in seqs:
            for impl in impls:
                length = f"_{seq // 1024}k" if seq % 1024 == 0 else f"_{seq}"
                label = name + (length if len(seqs) > 1 else "") + (f"_{impl}" if impl else "")
                out.append((label, name, seq, impl))
    return out


def launch(name: str, a: argparse.Namespace, label: str | None = None) -> dict:
    """Train run ``name`` (its settings: ``a``) as ``label`` (default ``name``) and measure it."""
    label = label or name
    args, nproc = run_config(name, a, label)
    source = Path(a.source)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "WANDB_MODE": "disabled"}
    if nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        cmd = [sys.executable, str(source / "train" / "main.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(source / "train" / "main.py"), *args]
    t0 = time.time()
    log = Path(a.out) / f"{label}.log"
    metrics = Path(a.out) / label / "metrics.jsonl"
    with log.open("w") as f, GpuSampler() as gpu:
        proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=f, stderr=subprocess.STDOUT)
        arrived = step_arrivals(proc, metrics, a.timeout)
        rc = proc.returncode
    out = {"run": label, "returncode": rc, "wall_s": round(time.time() - t0, 1), "gpus": nproc, "base_run": name,
           "seq": a.seq, "loss_impl": getattr(a, "loss_impl", None)}
    out["gpu_clocks"] = None
    if rc != 0 or not metrics.exists():
        text = log.read_text(errors="replace")
        out["error_tail"] = text[-2500:]
        out["out_of_memory"] = "OutOfMemoryError" in text or "CUDA out of memory" in text
        return out
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = with_steps_covered([r for r in rows if r.get("loss") is not None])
    profiled = {a.profile_step, a.profile_step + 1} if a.profile_step else set()
    after_warmup = [r for r in rows if r["step"] - r["steps_covered"] >= a.warmup]
    # the profiler's own cost is not measured
    steady = [r for r in after_warmup if not profiled & set(range(r["step"] - r["steps_covered"] + 1, r["step"] + 1))]
    # each measured row's time span: from the previous row to its own (the trace export is in the last
    # profiled step's span, left out)
    spans = [(arrived[s - n], arrived[s]) for s, n in ((r["step"], r["steps_covered"]) for r in steady)
             if {s - n, s} <= arrived.keys()]
    out["gpu_clocks"] = summarize(gpu.samples, spans)
    # the raw record, seconds from the launch: when each step's row arrived, and every clock sample
    out["step_arrival_s"] = {step: round(t - t0, 3) for step, t in arrived.items()}
    out["gpu_samples"] = [[round(t - t0, 3), r["gpu"], r["sm_mhz"], r["power_w"], r["reasons"]] for t, r in gpu.samples]
    times = sorted(r["step_time_s"] for r in steady)
    tokens, seconds = tokens_and_seconds(steady, a.global_batch * a.seq)
    with_profiled = tokens_and_seconds(after_warmup, a.global_batch * a.seq)
    fit = _fit([r.get("attention_work") for r in steady], [r["step_time_s"] for r in steady])
    profile = Path(a.out) / label / "profile" / "summary.json"
    out.update({
        "steps": len(rows), "losses": [round(r["loss"], 5) for r in rows],
        "grad_norms": [None if r.get("grad_norm") is None else round(r["grad_norm"], 4) for r in rows],
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / nproc,
        "tokens_per_s_median_step": statistics.median(r["tokens_per_s"] for r in steady),
        "step_s": statistics.median(times),
        "p90_over_median": _p90_over_median(times),
        "slowest_step_s": times[-1],
        "measured_steps": [r["step"] for r in steady],
        "tokens_per_s_with_profiled_steps": with_profiled[0] / with_profiled[1],
        "step_times_s": {r["step"]: round(r["step_time_s"], 4) for r in after_warmup},
        "attention_work": {r["step"]: round(r["attention_work"], 4) for r in after_warmup if "attention_work" in r},
        "step_time_vs_attention_work": fit,
        "p90_over_median_at_mean_work": _p90_at_mean_work(steady, fit),
        **(_profile_fields(profile) if a.profile_step else {}),
        "mfu": statistics.median(r["mfu"] for r in steady) if steady and steady[0].get("mfu") is not None else None,
        "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in rows),
        "nosa_gamma_mean": next((r["nosa_gamma_mean"] for r in reversed(rows) if "nosa_gamma_mean" in r), None),
    })
    return out


def compare_loss_impls(results: list[dict]) -> list[dict]:
    """Per run of several losses (``--loss-impl``), at each length, each loss against the first one given:
    tokens/s and their ratio, peak memory and what it saves, the largest loss difference over the steps both
    reached; ``status``: ok, ``out of memory`` or ``failed rc=N``."""
    groups: dict = {}
    for r in results:
        if r.get("loss_impl") and "base_run" in r:
            groups.setdefault((r["base_run"], r["seq"]), []).append(r)
    rows = []
    for (run, seq), rs in groups.items():
        if len(rs) < 2:
            continue
        base = rs[0]
        for r in rs:
            ok = "tokens_per_s" in r
            row = {"run": run, "seq": seq, "loss_impl": r["loss_impl"], "vs": base["loss_impl"],
                   "status": "ok" if ok else ("out of memory" if r.get("out_of_memory")
                                              else f"failed rc={r.get('returncode')}"),
                   "tokens_per_s": r.get("tokens_per_s"), "peak_mem_gib": r.get("peak_mem_gib"),
                   "tokens_per_s_ratio": None, "peak_mem_saved_gib": None, "max_abs_loss_diff": None,
                   "steps_compared": 0}
            if ok and "tokens_per_s" in base:
                row["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
                row["peak_mem_saved_gib"] = base["peak_mem_gib"] - r["peak_mem_gib"]
                n = min(len(r["losses"]), len(base["losses"]))
                row["steps_compared"] = n
                row["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"][:n], base["losses"][:n]))
            rows.append(row)
    return rows


def _print_loss_comparison(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nLosses compared (each against the first --loss-impl of its run and length):\n"
          "| run | seq | loss | status | tokens/s | vs first | peak GiB | saved GiB | max loss diff (steps) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        print(f"| {r['run']} | {r['seq']} | {r['loss_impl']} | {r['status']} | {num(r['tokens_per_s'], '.0f')} | "
              f"{num(r['tokens_per_s_ratio'], '.3f')} | {num(r['peak_mem_gib'], '.2f')} | "
              f"{num(r['peak_mem_saved_gib'], '.2f')} | {num(r['max_abs_loss_diff'], '.2e')} ({r['steps_compared']}) |")


def step_arrivals(proc: subprocess.Popen, metrics: Path, timeout: float, poll_s: float = 0.1) -> dict[int, float]:
    """Wait for ``proc`` (killed after ``timeout`` s), noting when each step's row first appears in its
    ``metrics.jsonl`` (host ``time.time()``; the trainer writes and fsyncs one row per logged step):
    the window of the measured steps, for the GPU clock samples taken meanwhile."""
    arrived, deadline, seen, partial = {}, time.time() + timeout, 0, b""
    while True:
        done = proc.poll() is not None
        if metrics.exists():
            with metrics.open("rb") as f:  # only what was appended since the last look
                f.seek(seen)
                chunk = f.read()
            seen += len(chunk)
            *lines, partial = (partial + chunk).split(b"\n")  # the last piece may be a row being written
            for line in lines:
                try:
                    step = json.loads(line).get("step")
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(step, int):
                    arrived.setdefault(step, time.time())
        if done:
            return arrived
        if time.time() > deadline:
            proc.kill()
            proc.wait()
            return arrived
        time.sleep(poll_s)


def with_steps_covered(rows: list[dict]) -> list[dict]:
    """``rows`` (logged rows in step order) with ``steps_covered``: the steps each row's interval means cover
    (``train.log_interval`` of them; 1 when every step is logged)."""
    out, previous = [], 0
    for r in rows:
        out.append({**r, "steps_covered": r["step"] - previous})
        previous = r["step"]
    return out


def tokens_and_seconds(rows: list[dict], tokens_per_step: int) -> tuple[int, float]:
    """Tokens and wall seconds of the steps ``rows`` cover (each row: its interval's mean step time)."""
    steps = sum(r["steps_covered"] for r in rows)
    return tokens_per_step * steps, math.fsum(r["steps_covered"] * r["step_time_s"] for r in rows)


def _fit(work: list, times: list) -> dict | None:
    """Least-squares ``time = base_s + slope_s * work`` over the measured steps and the correlation:
    how much of the step-to-step variation the documents of each step explain (None where the
    work does not vary, e.g. EOD packing)."""
    if len(work) < 3 or any(w is None for w in work) or max(work) - min(work) < 1e-9:
        return None
    slope, base = statistics.linear_regression(work, times)
    r = statistics.correlation(work, times) if max(times) > min(times) else None
    return {"base_s": round(base, 4), "slope_s": round(slope, 4), "r": None if r is None else round(r, 3)}


def _p90_at_mean_work(steady: list[dict], fit: dict | None) -> float | None:
    """p90 / median of the step times with each step's attention work moved to the mean work along
    the fitted line: the steadiness of the system once the documents' share of the variation is out."""
    if fit is None:
        return None
    mean_work = statistics.fmean(r["attention_work"] for r in steady)
    return _p90_over_median(r["step_time_s"] - fit["slope_s"] * (r["attention_work"] - mean_work) for r in steady)


def _p90_over_median(times) -> float:
    """p90 / median of step times (the p90 taken as the sorted value at index 0.9 n)."""
    times = sorted(times)
    return times[min(len(times) - 1, int(0.9 * len(times)))] / statistics.median(times)


def _profile_fields(summary: Path) -> dict:
    """GPU ms per part, GPU idle analysis and allocator counters of the profiled steps."""
    if not summary.exists():
        return {"gpu_ms_per_step": None}
    s = json.loads(summary.read_text())
    return {"gpu_ms_per_step": s["gpu_ms_per_step"], "everything_else_top": s.get("everything_else_top"),
            "gpu_idle": s.get("gpu_idle"), "host": s.get("host"), "allocator": s.get("allocator")}


def corpus_identity(prefix: str) -> dict:
    """What identifies the training data of a run, so that runs on differently built corpora are not
    compared by mistake (``data.demo_corpus`` gathers the building machine's own files): the indexed
    dataset's document count, tokens and mean document length (from ``PREFIX.summary.json``) and a
    fingerprint of its document sizes (sha256 of ``PREFIX.idx``, first 16 hex digits)."""
    import hashlib

    out: dict = {"prefix": os.path.basename(prefix)}
    idx, summary = Path(prefix + ".idx"), Path(prefix + ".summary.json")
    if idx.is_file():
        out["idx_sha256"] = hashlib.sha256(idx.read_bytes()).hexdigest()[:16]
    if summary.is_file():
        info = json.loads(summary.read_text())
        if "documents" in info and "tokens" in info:
            out.update(documents=info["documents"], tokens=info["tokens"],
                       mean_document_tokens=round(info["tokens"] / max(info["documents"], 1)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    quick = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"the CPU-sized loss comparison: {quick}")
    p.add_argument("--steps", type=int, help=f"default {DEFAULTS['steps']}")
    p.add_argument("--warmup", type=int, help=f"default {DEFAULTS['warmup']}")
    p.add_argument("--recipe", help=f"default {DEFAULTS['recipe']}; e.g. nosa_8b_cpt with --extra parallel=single")
    p.add_argument("--layers", type=int, help=f"default {DEFAULTS['layers']}")
    p.add_argument("--seq", help=f"tokens per sequence, or several: 16384,32768 (default {DEFAULTS['seq']})")
    p.add_argument("--global-batch", type=int,
                   help=f"sequences per optimizer step (micro-batches of one; per GPU: this / data-parallel size; "
                        f"default {DEFAULTS['global_batch']})")
    p.add_argument("--profile-step", type=int, default=0, help="profile this step and the next (0: off)")
    p.add_argument("--data", default=os.path.join(DEFAULT_OUT, "corpus_text_document"))
    p.add_argument("--tokenizer", default=os.path.join(DEFAULT_OUT, "tokenizer"))
    p.add_argument("--source", default=str(ROOT), help="checkout whose train/main.py runs (default: this one)")
    p.add_argument("--runs", help=f"default {DEFAULTS['runs']}")
    p.add_argument("--loss-impl", help="train.loss_impl of each run, or several to compare: fused,chunked "
                                       "(default: the trainer's)")
    p.add_argument("--timeout", type=int, help=f"seconds per run (default {DEFAULTS['timeout']})")
    p.add_argument("--extra", nargs="*", action="extend", default=[],
                   help="more overrides for every run, e.g. train.recompute=none (repeatable: the lists add up)")
    a = p.parse_args()
    for key, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    # the runs start in --source: every path they are given is absolute
    a.out, a.data, a.tokenizer, a.source = (os.path.abspath(x) for x in (a.out, a.data, a.tokenizer, a.source))
    if not (Path(a.source) / "train" / "main.py").is_file():
        print(f"error: --source {a.source} has no train/main.py", file=sys.stderr)
        sys.exit(2)
    try:
        todo = variants(a)
    except ValueError:
        print(f"error: --seq {a.seq} must be tokens per sequence, or several separated by commas", file=sys.stderr)
        sys.exit(2)
    taken = [n for n, *_ in todo if (Path(a.out) / n).exists() or (Path(a.out) / f"{n}.log").exists()]
    if taken:  # a run's metrics, profile and checkpoints would mix with the earlier run's
        print(f"error: --out {a.out} already holds run(s) {', '.join(taken)}; choose a new --out", file=sys.stderr)
        sys.exit(2)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count()
    env = {"gpu": torch.cuda.get_device_name(0) if gpus else "none", "gpus": gpus, "torch": torch.__version__,
           "data": corpus_identity(a.data), "source": a.source}
    print(f"data: {env['data']}", flush=True)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    results = []
    for label, name, seq, impl in todo:
        if name == "nosa_tp2" and gpus < 2:
            results.append({"run": label, "skipped": f"needs 2 GPUs, found {gpus}"})
            continue
        r = launch(name, argparse.Namespace(**{**vars(a), "seq": seq, "loss_impl": impl}), label)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("losses", "grad_norms", "gpu_samples")}), flush=True)
    by = {r["run"]: r for r in results}
    if "losses" in by.get("nosa_1gpu", {}) and "losses" in by.get("nosa_tp2", {}):
        a1, a2 = by["nosa_1gpu"]["losses"], by["nosa_tp2"]["losses"]
        n = min(len(a1), len(a2))
        env["tp2_vs_1gpu_max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a1[:n], a2[:n]))
        env["tp2_vs_1gpu_steps_compared"] = n
    for suffix in ("", "_nr"):
        n = by.get(f"nosa_1gpu{suffix}", {})
        for base, ratio in (("dense_1gpu", "nosa_over_dense"), ("dense_doc_1gpu", "nosa_over_dense_doc")):
            d = by.get(f"{base}{suffix}", {})
            if "tokens_per_s" in n and "tokens_per_s" in d:
                env[f"{ratio}{suffix}"] = n["tokens_per_s"] / d["tokens_per_s"]
    comparison = compare_loss_impls(results)
    (Path(a.out) / "train_throughput.json").write_text(json.dumps(
        {"env": env, "results": results, "loss_impl_comparison": comparison}, indent=2))
    print("\n| run | GPUs | tokens/s (total/time) | median-step tokens/s | p90/median | slowest s | MFU | "
          "peak GiB | gamma | losses (first, last) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"| {r['run']} | - | {r.get('skipped') or 'failed rc=' + str(r.get('returncode'))} | | | | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gamma = "-" if r["nosa_gamma_mean"] is None else f"{r['nosa_gamma_mean']:.3f}"
        print(f"| {r['run']} | {r['gpus']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_median_step']:.0f} | "
              f"{r['p90_over_median']:.2f} | {r['slowest_step_s']:.2f} | {mfu} | {r['peak_mem_gib']:.1f} | {gamma} | "
              f"{r['losses'][0]:.4f}, {r['losses'][-1]:.4f} |")
    for r in results:
        fit = r.get("step_time_vs_attention_work")
        if fit:
            print(f"{r['run']}: step time = {fit['base_s']:.3f} s + {fit['slope_s']:.3f} s x attention work "
                  f"(sum of squared document lengths / S^2; r = {fit['r']}; work "
                  f"{min(r['attention_work'].values()):.3f}-{max(r['attention_work'].values()):.3f}); "
                  f"p90 / median at the mean work {r['p90_over_median_at_mean_work']:.3f}")
    for r in results:
        c = r.get("gpu_clocks")
        if c:
            print(f"{r['run']}: GPU over the measured steps ({c['samples']} samples): SM {c['sm_mhz_median']:.0f} MHz "
                  f"median ({c['sm_mhz_p10']:.0f} p10), {c['power_w_median']} W median, {c['temp_c_max']:.0f} C max, "
                  f"slowdown reasons active in {100 * c['slowdown_share']:.0f}% of samples "
                  f"({c['slowdown_reasons_seen']})")
    parts = [r for r in results if r.get("gpu_ms_per_step")]
    if parts:
        keys = list(parts[0]["gpu_ms_per_step"])
        print("\nGPU ms per step (profiled steps):\n| run | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for r in parts:
            print(f"| {r['run']} | " + " | ".join(f"{r['gpu_ms_per_step'].get(k, 0):.1f}" for k in keys) + " |")
    for r in parts:
        idle = r.get("gpu_idle") or {}
        print(f"\n{r['run']}: GPU idle {idle.get('gpu_idle_ms_per_step')} ms/step of {idle.get('window_ms_per_step')}; "
              f"allocator {r.get('allocator')}; host syncs {idle.get('host_sync_ms_per_step')}")
        for phase, v in (idle.get("idle_by_phase") or {}).items():
            waits = ", ".join(f"{c} {ms:.2f}" for c, ms in (v.get("host_waits_ms_per_step") or {}).items())
            print(f"  idle {v['idle_ms_per_step']:8.2f} ms/step of {v['span_ms_per_step']:8.2f} in {phase}"
                  + (f"; host waited in {waits} ms/step" if waits else ""))
        for g in idle.get("idle_by_host_op", [])[:6]:
            print(f"  idle {g['ms_per_step']:8.2f} ms/step in {g['gaps_per_step']:6.1f} gaps at {g['host_op']}; "
                  f"longest at {' < '.join(g.get('longest_gap_stack', [])[:8])}")
        for g in idle.get("longest_gaps", [])[:4]:
            print(f"  gap {g['ms']:.2f} ms at {' < '.join(g['host_stack'])} runtime {g['runtime_ms']}")
        host = r.get("host") or {}
        if host:
            print(f"  host: ops span {host['span_ms_per_step']} ms/step, "
                  f"{host['outside_ops_ms_per_step']} outside any op")
        for h in host.get("threads", []):
            print(f"  host thread {h['thread']}: {h['launches_per_step']} launches/step, "
                  f"{h['in_ops_ms_per_step']} ms/step "
                  "in ops; top self: "
                  + ", ".join(f"{o['op']} {o['self_ms_per_step']} ({o['calls_per_step']})" for o in h["top_ops"][:6]))
    print(json.dumps(env, indent=1))
    _print_loss_comparison(comparison)
    for r in results:
        if "error_tail" in r:
            print(f"--- {r['run']} failed:\n{r['error_tail']}")


if __name__ == "__main__":
    main()
