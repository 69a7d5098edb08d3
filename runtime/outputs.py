"""Outputs appear whole or not at all: a file or a directory is written under a temporary name beside its
place and renamed into it only when complete (a rename within one file system is atomic), so a crash or an
error leaves what was there before and never a partial file. Nothing is written through a symbolic link: a
rename replaces a link at the output's place, and a file opened in place (:func:`open_in_place`) refuses one.

``write_atomic`` / ``write_json`` for contents in memory, ``atomic_path`` for a writer that streams to a path
(rows of a JSONL file, a profiler's trace, a plot), ``atomic_dir`` for a directory of files. None of them
decides whether an existing output may be replaced: the caller checks that first. A directory that fills the
disk is one :class:`DiskFullError` line (the partial output removed, what was there before kept).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from data import disk_space


class DiskFullError(OSError):
    """The disk (or a quota) filled up while an output was written; the message says what to free (one line)."""


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (``.<name>.tmp-<pid><suffix>``: a writer that takes the format from the
    suffix keeps it) for the caller to write; renamed to ``path`` when the block ends, removed on an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    if tmp.is_symlink():  # our own temporary name (this pid): a link there is never written through
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def not_a_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists but is not a regular file (``a symbolic link to ...``, ``a directory``,
    ``a FIFO``, ...); None when it is absent or a regular file. Links are not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)}"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(st.st_mode)), "a device file")


class NotARegularFile(OSError):
    """A file written in place is something else (a symbolic link, a directory, ...); the message says what."""


def open_in_place(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file written in place (a lock, an appended log) that never follows a symbolic link
    and opens only a regular file; anything else raises :class:`NotARegularFile` (``<path> is <what>``)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError:
        what = not_a_file(path)
        if what is None:
            raise
        raise NotARegularFile(f"{path} is {what}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(f"{path} is {not_a_file(path) or 'not a regular file'}")
    return fd


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | os.PathLike, obj, indent: int = 2) -> Path:
    """``obj`` as JSON (non-finite floats as ``null``), written atomically."""
    return write_atomic(path, json.dumps(_finite(obj), indent=indent) + "\n")


@contextmanager
def atomic_dir(out: str | os.PathLike, need_bytes: int | None = None) -> Iterator[Path]:
    """A sibling temporary directory for the caller to fill; renamed to ``out`` when the block ends (an existing
    ``out`` is replaced then: the caller has checked that it may be), removed on an error. The result gets the
    usual permissions (0777 / 0666 minus the umask), not the temporary directory's 0700. A full disk is one
    :class:`DiskFullError` line (``need_bytes``: about what the whole output takes, to say what to free)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _normal_permissions(tmp)
    except BaseException as e:
        # a writer's failure (not the caller's own one-line refusal, nor an interruption) on a disk that filled up
        full = not isinstance(e, (ValueError, DiskFullError, KeyboardInterrupt, SystemExit))
        full = full and disk_space.is_disk_full(e, out.parent)
        free, written = disk_space.free_bytes(out.parent), disk_space.tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            need = f"about {disk_space.human(need_bytes)}" if need_bytes else f"more than {disk_space.human(written)}"
            raise DiskFullError(f"disk full writing {out} ({disk_space.human(free)} free, "
                                f"{disk_space.human(written)} written): the partial output was removed and {out} is "
                                f"as it was; free {need} there and run again") from None
        raise
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # both renames or none
    try:
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
        else:
            old = None
            os.replace(tmp, out)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if old is not None and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        old.unlink()


def _normal_permissions(root: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for d, _, files in os.walk(root):
        os.chmod(d, 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~umask)
