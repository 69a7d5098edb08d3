"""Reading a run's ``metrics.jsonl`` (one JSON object per logged row, written by ``train.metrics``):
what the multirun summary and ``eval.compare`` report of a training run."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` ([] without one; a line cut by a crash is skipped). A
    ``metrics.jsonl`` that is a directory, or a non-empty one without a single JSON row (another file under
    that name), is a one-line ``ValueError`` naming it."""
    path = Path(run_dir) / METRICS
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a metrics file written by train/main.py")
    if not path.is_file():
        return []
    data = path.read_bytes()
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # UnicodeDecodeError included
            continue
        if isinstance(row, dict):
            rows.append(row)
    if data.strip() and not rows:
        raise ValueError(f"{path} holds no JSON rows ({len(data)} bytes): not a metrics file written by "
                         f"train/main.py")
    return rows


def run_figures(rows: list[dict]) -> dict:
    """``steps`` (last logged), final ``loss``, last ``val_loss``, mean ``tokens_per_s`` of the logged
    intervals (the first, which holds the warm-up, left out when there are more), largest
    ``peak_mem_gib`` and last ``nosa_gamma_mean``; None where nothing was logged."""
    def last(key):
        return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)

    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") is not None]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    peaks = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib") is not None]
    return {"steps": last("step"), "loss": last("loss"), "val_loss": last("val_loss"),
            "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
            "peak_mem_gib": max(peaks) if peaks else None, "nosa_gamma_mean": last("nosa_gamma_mean")}
