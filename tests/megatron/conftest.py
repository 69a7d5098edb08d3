"""Fixtures of the megatron-core tests.

megatron-core runs only in rank subprocesses (``tests/ranks.py``; gloo, CPU shim applied there), never
in the pytest process, so the shim cannot leak into other test packages. One session fixture launches
the reference run (1 process) and the parallel run (2 processes) of ``_worker.py`` once; the tests
read what the ranks wrote.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import pytest

from tests.subproc import run_ranks
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "_worker.py"
REF_TIMEOUT_S = 300
PAR_TIMEOUT_S = 420


def run_worker(nproc: int, args: list, log: Path, timeout_s: int) -> int:
    """Run ``nproc`` ranks of ``_worker.py`` (as torchrun would, without its agent process) with a hard
    timeout (every rank's process group is killed)."""
    return run_ranks([sys.executable, str(WORKER), *args], nproc, log, timeout_s)


class MegatronRuns:
    """Results of the reference and parallel launches."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def log_tail(self, role: str, n: int = 40) -> str:
        path = self.out / f"{role}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        keep = [ln for ln in lines if "Warning" not in ln and "warn" not in ln]
        return "\n".join(keep[-n:])

    def summary(self, role: str) -> dict:
        path = self.out / f"summary_{role}.json"
        if not path.exists():
            pytest.fail(f"the {role} launch wrote no summary; log tail:\n{self.log_tail(role)}")
        return json.loads(path.read_text())

    def status(self, role: str, key: str):
        s = self.summary(role)
        if key not in s:
            pytest.fail(f"{key} missing from the {role} summary; log tail:\n{self.log_tail(role)}")
        if isinstance(s[key], str) and s[key] != "ok":
            pytest.fail(f"{key} failed in the {role} launch:\n{s[key]}")
        return s[key]

    def result(self, case: str, layout: str) -> dict:
        """Merged rank files of one run (each rank wrote the tensors it owns)."""
        from tests.megatron._cases import LAYOUTS

        self.status("ref" if layout == "ref" else f"par{LAYOUTS[layout].world}", f"{case}/{layout}")
        merged = {"loss": None, "grad_norm": None, "grads": {}, "params": {}, "selections": {}, "init": None}
        files = sorted(glob.glob(str(self.out / case / layout / "rank*.pt")))
        assert files, f"no rank files for {case}/{layout}"
        for f in files:
            r = torch.load(f)
            if r["loss"] is not None:
                merged["loss"] = r["loss"]
            merged["grad_norm"] = r["grad_norm"]
            for k in ("grads", "params", "selections"):
                merged[k].update(r[k])
            if r.get("init"):
                merged["init"] = r["init"]
            merged.setdefault("selection_calls", r.get("selection_calls", {}))  # rank 0's counts
            merged["micro_batches"] = r.get("micro_batches")
        return merged


@pytest.fixture(scope="session")
def megatron_ref(tmp_path_factory) -> MegatronRuns:
    """The 1-process reference launch (TP=PP=DP=1) and its single-process checks."""
    out = tmp_path_factory.mktemp("megatron_runs")
    rc = run_worker(1, ["--role", "ref", "--out", str(out)], out / "ref.log", REF_TIMEOUT_S)
    runs = MegatronRuns(out)
    if rc != 0:
        pytest.fail(f"reference launch exited with {rc}; log tail:\n{runs.log_tail('ref')}")
    return runs


@pytest.fixture(scope="session")
def megatron_runs(megatron_ref: MegatronRuns) -> MegatronRuns:
    """The 2-process launch of every case in its layouts, started from the reference weights."""
    return _launch_par(megatron_ref, 2)


@pytest.fixture(scope="session")
def megatron_runs4(megatron_ref: MegatronRuns) -> MegatronRuns:
    """The 4-process launch (TP=4 with replicated KV heads, TP=2 x PP=2); 4 ranks on few cores."""
    return _launch_par(megatron_ref, 4)


def _launch_par(ref: MegatronRuns, world: int) -> MegatronRuns:
    out = ref.out
    role = f"par{world}"
    rc = run_worker(world, ["--role", "par", "--world", str(world), "--out", str(out)], out / f"{role}.log",
                      PAR_TIMEOUT_S)
    if rc != 0:
        pytest.fail(f"{world}-process launch exited with {rc}; log tail:\n{ref.log_tail(role)}")
    return ref
