"""One training per run directory: an exclusive ``flock`` on ``<run.dir>/.lock`` held by rank 0.

The lock is released by the kernel when the process exits (even on kill -9), so a stale lock
file never blocks a later run; the file's text (pid, host, start time) names the holder in the
refusal. ``flock`` works across nodes on NFSv4 and Lustre mounts with ``flock`` enabled. A lock path that
is not a regular file (a symbolic link, a directory) is refused: the lock is never written through a link.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from runtime.outputs import NotARegularFile, open_in_place

LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another process trains into the same run directory, or its lock file cannot be made (one-line message)."""


class RunDirLock:
    """Acquire with :meth:`acquire` (raises :class:`RunDirLocked`); :meth:`release` or process exit frees it."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_in_place(self.path, os.O_RDWR | os.O_CREAT)
        except NotARegularFile as e:  # a link is never followed: its target is not ours to truncate
            raise RunDirLocked(f"run.dir {self.path.parent}: {e}, not this trainer's lock file; remove it, or "
                               f"choose another run.dir") from None
        except OSError as e:
            raise RunDirLocked(f"run.dir {self.path.parent}: cannot create the lock file {self.path} ({e.strerror}); "
                               f"fix that, or choose another run.dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise RunDirLocked(f"run.dir {self.path.parent} is in use by another training ({holder}); wait "
                               f"for it to finish, stop it, or choose another run.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
