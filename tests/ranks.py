"""N ranks of a ``torch.distributed`` script on this machine without torchrun's agent process.

torchrun's agent (one more Python process with torch imported) only launches and watches the ranks;
here the test process does that: each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free ``MASTER_PORT`` (what ``init_process_group``'s env://
reads), output goes to one log file, and the first rank to fail or the timeout ends all of them
(each rank's whole process group is killed, as ``tests.subproc.run_logged`` does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.subproc import REPO, child_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd: list, nproc: int, log: Path, timeout_s: int = 300, env: dict | None = None) -> int:
    """Run ``cmd`` as ``nproc`` ranks; 0 when every rank exits 0, else the first failure's code (-9 on
    timeout)."""
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
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return rc
