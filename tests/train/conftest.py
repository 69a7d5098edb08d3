"""Fixtures for trainer tests: the SMALL demo data and a runner for train/main.py subprocesses."""

import json
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

from tests.subproc import run_logged, child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from data.demo_corpus import SMALL, build_demo

    return build_demo(str(tmp_path_factory.mktemp("demo")), SMALL, log=lambda m: None)


@pytest.fixture(scope="session")
def data_args(demo_data):
    """Overrides pointing every stage at the SMALL demo data."""
    return [f"data.paths=[{demo_data['indexed_prefix']}]", f"data.tokenizer={demo_data['tokenizer']}",
            f"sft.path={demo_data['sft']}", f"sft.tokenizer={demo_data['tokenizer']}"]


def run_main(args, nproc: int = 1, env: dict | None = None, timeout: int = 400, check: bool = True):
    """Run train/main.py (python for 1 process, torchrun for more) in its own process group.

    Output (stdout and stderr together) goes to a log file; the whole group is killed afterwards
    (``tests/subproc.py``), so helpers that outlive a crashed trainer cannot hang the test.
    """
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train" / "main.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--standalone", str(ROOT / "train" / "main.py"), *args]
    full_env = child_env(**(env or {}))
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "out.log"
        rc = run_logged(cmd, log, timeout, ROOT, full_env)
        text = log.read_text(errors="replace")
    p = subprocess.CompletedProcess(cmd, rc, text, text)  # stdout and stderr interleaved in one log
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if r.get("loss") is not None}
