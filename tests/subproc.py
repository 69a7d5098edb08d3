"""Launching test subprocesses (train/main.py, torchrun workers, ranks of a distributed script) safely.

Each process runs in its own process group with output in a log file (never a pipe), and the
whole group is killed on timeout and afterwards, so helpers that outlive a crashed parent (the
dist-checkpoint writer, torchrun workers) can neither hang a test nor linger.
"""

import contextlib
import os
import signal
import socket
import subprocess
import time
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
            kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s whole process group (started with ``start_new_session=True``) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd: list, nproc: int, log: Path, timeout_s: int = 300, env: dict | None = None) -> int:
    """Run ``cmd`` as ``nproc`` ranks of a ``torch.distributed`` script without torchrun's agent process (one
    more Python process with torch imported that only launches and watches them): each rank gets ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free ``MASTER_PORT`` (what
    env:// reads); output goes to ``log``; the first rank to fail or the timeout ends them all. Returns 0
    when every rank exits 0, else the first failure's code (-9 on timeout)."""
    base = dict(env or child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    procs = []
    rc = 0
    with open(log, "w") as fh:
        try:
            for r in range(nproc):
                procs.append(subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    rc = failed[0] if failed else 0
                    break
                if time.monotonic() > deadline:
                    rc = -9
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                kill_group(p)
    return rc
