"""Where a training step waits for the GPU: host syncs per optimizer step, by Python call site.

Runs ``train/main.py`` in this process (one GPU, world size 1) with the given overrides and counts,
from optimizer step ``--from-step`` on, every time the host waits for the device, as CUDA's sync
debug mode reports it (``torch.cuda.set_sync_debug_mode``): scalar reads (``.item()``, ``bool(t)``),
blocking device-to-host copies, ops whose output size depends on the data (``nonzero``, boolean
indexing) and ``synchronize()`` calls, nested ones inside other ops included. Non-blocking copies
into pinned memory are not syncs. Each is attributed to its innermost Python frames in this
repository or in megatron-core (``--frames`` of them). A sync drains the GPU's queue: the GPU then
idles while the host launches the next kernels, so a per-layer sync costs a launch gap per layer.
Not reported: a copy to the GPU from pageable host memory beyond a few KiB, which waits for the GPU's
queue too (CUDA's sync debug mode flags reads, not uploads); the profile summary's ``idle_by_phase``
shows those as ``cudaMemcpyAsync`` host waits of the phase that issued them.

The counts are the same on any GPU (they follow the code path, not the timing); a CPU run takes other
code paths (no Triton kernels, no fused layers) and is refused. Usage::

    python -m bench.probes.host_syncs --out DIR [--from-step 3] [--frames 3] -- recipe=nosa_1b_cpt \
        train.max_steps=5 model.num_layers=4 ...

Writes ``DIR/host_syncs.json`` (``per_step``: sites and counts per optimizer step) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

from runtime.outputs import write_json

ROOT = Path(__file__).resolve().parents[2]


def call_site(stack: list, frames: int) -> str:
    """The innermost ``frames`` frames of ``stack`` (``traceback.extract_stack()``) that lie in this
    repository (not this script) or in megatron-core, innermost first."""
    keep = []
    for f in stack:
        path = f.filename
        if "megatron/core/" in path:
            keep.append(f"megatron/core/{path.split('megatron/core/')[-1]}:{f.lineno} {f.name}")
        elif (path.startswith(str(ROOT)) and "/site-packages/" not in path
              and os.path.basename(path) not in ("host_syncs.py", "megatron_cpu.py")):
            keep.append(f"{os.path.relpath(path, ROOT)}:{f.lineno} {f.name}")
    return " <- ".join(reversed(keep[-frames:])) or "(outside this repository and megatron-core)"


class SyncCounter:
    """Counts the host syncs that CUDA's sync debug mode reports (``torch.cuda.set_sync_debug_mode``:
    every blocking stream / device synchronisation and blocking copy, nested ones included), by call
    site, while ``active``."""

    def __init__(self, frames: int):
        self.frames = frames
        self.active = False
        self.counts: collections.Counter = collections.Counter()
        self._show = warnings.showwarning

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):  # counted while active, silent before (warm-up steps)
            if self.active:
                self.counts[call_site(traceback.extract_stack()[:-1], self.frames)] += 1
            return
        self._show(message, category, filename, lineno, file, line)

    def __enter__(self):
        warnings.filterwarnings("always", message=".*synchronizing.*")
        warnings.showwarning = self._on_warning
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--from-step", type=int, default=3, help="first optimizer step counted (1-based)")
    ap.add_argument("--frames", type=int, default=3, help="call-site frames kept per entry")
    ap.add_argument("overrides", nargs="*", help="train/main.py key=value overrides (after --)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: host syncs are counted on a GPU run (a CPU run takes other code paths)", file=sys.stderr)
        return 2
    if a.from_step < 1:
        print(f"error: --from-step must be >= 1, got {a.from_step}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29517"), "WANDB_MODE": "disabled"}.items():
        os.environ.setdefault(k, v)

    from train import main as train_main
    from train.trainer import Trainer

    counter = SyncCounter(a.frames)
    steps = {"done": 0, "counted": 0}
    original_step = Trainer.train_step

    def counted_step(self):
        steps["done"] += 1
        counter.active = steps["done"] >= a.from_step
        try:
            return original_step(self)
        finally:
            steps["counted"] += int(counter.active)
            counter.active = False

    Trainer.train_step = counted_step
    with counter:
        rc = train_main.main(list(a.overrides))
    if rc:
        print(f"error: train/main.py exited with {rc}", file=sys.stderr)
        return rc
    n = max(steps["counted"], 1)
    rows = [{"site": site, "per_step": round(c / n, 2)} for site, c in counter.counts.most_common()]
    result = {"overrides": a.overrides, "counted_steps": steps["counted"], "from_step": a.from_step,
              "syncs_per_step": round(sum(counter.counts.values()) / n, 2), "per_step": rows,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    write_json(out / "host_syncs.json", result, indent=1)
    print(f"{result['syncs_per_step']} host syncs per optimizer step over {steps['counted']} steps")
    for r in rows[:30]:
        print(f"{r['per_step']:8.2f}  {r['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
