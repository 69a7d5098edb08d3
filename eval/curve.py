"""RULER-style scores along a training run: every saved checkpoint of a run dir, scored directly.

    python -m eval.curve --run DIR --tasks DIR --lengths 4096 [--limit 12] --out FILE.json [--label NAME]

For each complete ``iter_*`` checkpoint (oldest first) the strict score, its standard error, the
needle tasks' score and the graded signals (share of answer tokens matched, log-likelihood per
answer token), with the training tokens seen so far (step x global batch x sequence length, from
the run's ``config.yaml``). One model build per checkpoint; the points are written after each one,
so an interrupted curve keeps what it measured. :func:`plot` draws several curves against tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from runtime.outputs import write_json


def tokens_per_step(run_dir: Path) -> int:
    import yaml

    raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    train = raw.get("train") or {}
    return int(train["global_batch_size"]) * int(train["seq_length"])


def evaluate_run(run: str, tasks_dir: str, lengths: list[int], out: str, limit: Optional[int] = None,
                 label: Optional[str] = None, log=print) -> dict:
    """Score every checkpoint of ``run``; writes and returns ``{"label", "run", "lengths", "points"}``."""
    from eval.errors import EvalError
    from eval.load import load_model, load_tokenizer, resolve_source
    from eval.ruler import score_direct, summarize
    from eval.tasks import load_task_set
    from runtime.checkpoint_files import complete_checkpoints

    run_dir = Path(run)
    ckpts = sorted(complete_checkpoints(run_dir / "checkpoints"), key=lambda c: c.name)  # iter_XXXXXXX: oldest first
    if not ckpts:
        raise EvalError(f"--run {run}: no complete checkpoint under {run_dir / 'checkpoints'}")
    per_step = tokens_per_step(run_dir)
    ts = load_task_set(tasks_dir)
    result = {"label": label or run_dir.name, "run": str(run_dir), "lengths": lengths, "limit": limit, "points": []}
    t0 = time.perf_counter()
    for ck in ckpts:
        src = resolve_source(str(ck))
        tok = load_tokenizer(src)
        ts.check_tokenizer(tok.path)
        chosen = ts.pick_lengths(lengths, src.model.max_position_embeddings)
        s = summarize(score_direct(load_model(src), tok, ts, chosen, ts.tasks, limit, log=lambda *_: None))
        step = int(src.step or 0)
        point = {"step": step, "tokens": step * per_step, "average": s["average"], "stderr": s["average_stderr"],
                 "needles": s["needles"]["score"], **s["graded"], "by_length": s["by_length"]}
        result["points"].append(point)
        write_json(Path(out), result)
        log(f"curve {result['label']}: step {step} ({point['tokens'] / 1e6:.1f}M tokens): RULER {s['average']:.1f} "
            f"± {s['average_stderr']:.1f}, needles {point['needles']:.1f}, answer tokens matched "
            f"{point['token_match']:.3f} ({time.perf_counter() - t0:.0f} s)")
    return result


def plot(fig, curves: list[dict], offsets: Optional[dict] = None) -> None:
    """RULER average (solid) and the share of answer tokens matched x 100 (dashed) against training
    tokens; ``offsets[label]`` shifts a curve (e.g. CPT after the pretraining tokens)."""
    ax = fig.add_subplot(1, 1, 1)
    for i, c in enumerate(curves):
        pts = c["points"]
        if not pts:
            continue
        x0 = (offsets or {}).get(c["label"], 0)
        xs = [(x0 + p["tokens"]) / 1e6 for p in pts]
        lengths = "/".join(f"{n // 1024}K" for n in c["lengths"])
        ax.plot(xs, [p["average"] for p in pts], "o-", color=f"C{i}", label=f"{c['label']} (RULER at {lengths})")
        ax.plot(xs, [100 * (p["token_match"] or 0) for p in pts], "--", color=f"C{i}", alpha=0.6)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("RULER average (solid) / answer tokens matched % (dashed)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv=None) -> int:
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a training run dir (its checkpoints/ are scored)")
    ap.add_argument("--tasks", required=True, help="task set dir (python -m eval.tasks)")
    ap.add_argument("--lengths", required=True, help="comma-separated task lengths")
    ap.add_argument("--limit", type=int, default=None, help="first N samples per (task, length)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", required=True, help="JSON file")
    a = ap.parse_args(argv)
    return run_cli("eval.curve", evaluate_run, a.run, a.tasks, [int(x) for x in a.lengths.split(",")], a.out,
                   a.limit, a.label)


if __name__ == "__main__":
    sys.exit(main())

