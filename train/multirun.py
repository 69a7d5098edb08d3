"""What a multirun (``train/main.py -m ...``) says around its jobs: a header per job, which jobs a
re-run can skip because they already finished, and the summary table at the end.

A job has finished when ``checkpoint.resume=auto`` would resume it from a checkpoint at
``train.max_steps``: re-running the sweep skips it (no model build, no validation pass, no new
W&B session; a job whose ``train.max_steps`` was raised resumes, and keeps its W&B run through
``<run dir>/wandb_id``). The summary reads each job's ``metrics.jsonl``.
"""

from __future__ import annotations

import math

from runtime.checkpoint_files import CheckpointError, find_checkpoint
from runtime.run_metrics import read_metrics, run_figures

TRAINED, FINISHED, FAILED, NOT_RUN = "trained", "finished earlier: skipped", "failed", "not run"


def header(i: int, n: int, job: list[str], run_dir: str) -> str:
    """``[multirun] job 2/3: <overrides> -> run.dir=<dir>``."""
    return f"[multirun] job {i + 1}/{n}: {' '.join(job)} -> run.dir={run_dir}"


def finished_step(cfg) -> int | None:
    """The step of the checkpoint a re-run would resume ``cfg``'s run dir from, when it is at
    ``train.max_steps`` (nothing left to train); None otherwise (a damaged checkpoint is the trainer's
    to report)."""
    if cfg.checkpoint.resume != "auto":
        return None
    try:
        ckpt = find_checkpoint(cfg.run_dir)
    except CheckpointError:
        return None
    if ckpt is None:
        return None
    try:
        step = int(ckpt.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None
    return step if step >= cfg.train.max_steps else None


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def summary(jobs: list[tuple[str, str, str]]) -> str:
    """The table at the end of a multirun: one row per job ``(swept key=value,..., run dir, status)``."""
    head = ["job", "status", "steps", "final loss", "val loss", "tokens/s", "run dir"]
    rows = []
    for name, run_dir, status in jobs:
        try:
            f = run_figures(read_metrics(run_dir)) if status != NOT_RUN else {}
        except ValueError:  # the job reported its unusable metrics.jsonl itself
            f = {}
        rows.append([name or "-", status, _fmt(f.get("steps"), "d"), _fmt(f.get("loss"), ".4f"),
                     _fmt(f.get("val_loss"), ".4f"), _fmt(f.get("tokens_per_s"), ",.0f"), run_dir])
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([f"[multirun] summary of {len(rows)} job(s):", line(head),
                      line(["-" * w for w in widths]), *map(line, rows)])
