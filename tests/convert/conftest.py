"""Fixtures of the conversion tests.

megatron-core runs only in subprocesses (2 gloo ranks for the TP=2 / PP=2 checkpoints, plain
subprocesses for the CLIs that build a Megatron model), never in the pytest process. The session
fixture ``megatron_ckpts`` launches ``_worker.py`` once; ``exports`` converts every checkpoint with
``to_hf`` (in process: it needs no megatron) once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.subproc import run_ranks
from tests.subproc import run_logged, child_env
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "_worker.py"
WORKER_TIMEOUT_S = 300
RESULTS = {}  # measured logit differences, written to <tmp>/parity.json and printed at the end


def subprocess_env(**extra) -> dict:
    return child_env(**extra)


def run(cmd: list, log: Path, timeout_s: int = 300, cwd: Path = REPO, env: dict | None = None) -> int:
    return run_logged(cmd, log, timeout_s, cwd, env)


def tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(ln for ln in lines[-4 * n:] if "warn" not in ln.lower())[-6000:]


class MegatronCheckpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.status = json.loads((root / "status.json").read_text())

    def ckpt(self, name: str) -> Path:
        st = self.status.get(name)
        if st != "ok":
            pytest.fail(f"worker case {name} failed:\n{st}")
        return self.root / name

    def result(self, name: str) -> dict:
        """Merged rank files: logits (from the rank that has them), tokens, selections of all heads."""
        out = {"logits": None, "selections": {}}
        for f in sorted((self.ckpt(name)).glob("rank*.pt")):
            r = torch.load(f)
            if r["logits"] is not None:
                out["logits"] = r["logits"]
            out["tokens"] = r["tokens"]
            out["selections"].update(r["selections"])
        assert out["logits"] is not None, f"no rank wrote logits for {name}"
        return out


@pytest.fixture(scope="session")
def megatron_ckpts(tmp_path_factory) -> MegatronCheckpoints:
    root = tmp_path_factory.mktemp("megatron_ckpts")
    rc = run_ranks([sys.executable, str(WORKER), "--out", str(root)], 2, root / "worker.log", WORKER_TIMEOUT_S)
    if rc != 0 or not (root / "status.json").exists():
        pytest.fail(f"conversion worker exited with {rc}; log tail:\n{tail(root / 'worker.log')}")
    return MegatronCheckpoints(root)


@pytest.fixture(scope="session")
def exports(megatron_ckpts, tmp_path_factory) -> dict:
    """case name -> HF export dir (to_hf of the case's run-dir-like folder with its ``latest`` pointer)."""
    from checkpoints_convert.to_hf import export
    from tests.convert._cases import CASES

    root = tmp_path_factory.mktemp("hf_exports")
    out = {}
    for name in CASES:
        if megatron_ckpts.status.get(name) == "ok":
            out[name] = export(str(megatron_ckpts.ckpt(name)), str(root / name), log=lambda *_: None)
    return out


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32).eval()


def pytest_sessionfinish(session, exitstatus):
    if RESULTS:
        lines = ["", "measured HF vs Megatron logit differences (fp32):"]
        for k in sorted(RESULTS):
            r = RESULTS[k]
            lines.append(f"  {k:<34} rel {r['rel']:.2e}  max|d| {r['max_abs']:.2e}  T={r['T']}")
        text = "\n".join(lines)
        print(text)
        path = os.environ.get("NOSA_CONVERT_REPORT")
        if path:
            Path(path).write_text(json.dumps(RESULTS, indent=2))
