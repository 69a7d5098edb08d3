"""Launching test subprocesses (train/main.py, torchrun workers) safely.

Each process runs in its own process group with output in a log file (never a pipe), and the
whole group is killed on timeout and afterwards, so helpers that outlive a crashed parent (the
dist-checkpoint writer, torchrun workers) can neither hang a test nor linger.
"""

import contextlib
import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_env(**extra) -> dict:
    """The environment of a test subprocess: repo importable, offline, one thread per rank."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


def run_logged(cmd: list, log: Path, timeout_s: int = 300, cwd: Path = REPO, env: dict | None = None) -> int:
    """Run ``cmd`` with stdout+stderr in ``log``; returns the exit code (-9 on timeout)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or child_env(), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return -9
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
