"""A full disk, told apart from other write failures, for the tools that write large outputs.

A write that runs out of space fills the file system first, so right after the failure the free
space is (close to) zero. Libraries do not always keep the ``ENOSPC`` errno: megatron-core's
checkpoint writer and torch's serializer re-raise it as a ``RuntimeError`` with other text, so
:func:`is_disk_full` accepts either sign: ``ENOSPC`` / ``EDQUOT`` in the exception chain, or less
than :data:`NEARLY_FULL` bytes left where the output was being written.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

NEARLY_FULL = 64 << 20  # bytes: less than this left after a failed write = the disk filled up
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``path`` (its nearest existing
    parent); None when it cannot be told."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``exc`` (raised while writing under ``path``) means that the disk or a quota is full."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL


def tree_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under ``path`` (a file: its size; missing: 0)."""
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    except OSError:
        return 0


def human(n: int | None) -> str:
    """``n`` bytes as ``'1.5 GiB'`` (``'?'`` for None)."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
