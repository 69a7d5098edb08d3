"""A disk that fills up while the checkpoint of one step is written, for a trainer run in the test's process.

The first file megatron-core writes into that save's ``iter_N.tmp`` gets 4 KiB, then ``ENOSPC``; from then on the
file system reports no free space, as a full one does. Everything else is the real trainer.
"""

import errno
import functools
import os
import shutil


def disk_fills_at(monkeypatch, step: int) -> None:
    """Patch megatron-core's checkpoint writer and ``shutil.disk_usage`` (undone with ``monkeypatch``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    save_dir = f"iter_{step:07d}.tmp"
    full = []
    write_item, disk_usage = filesystem_async._write_item, shutil.disk_usage

    @functools.wraps(write_item)  # megatron-core reads its signature
    def _write_item(transforms, stream, *args, **kwargs):
        if save_dir in getattr(stream, "name", ""):
            stream.write(b"\0" * 4096)
            full.append(stream.name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, *args, **kwargs)

    def _disk_usage(path):
        usage = disk_usage(path)
        return usage._replace(free=0) if full else usage

    monkeypatch.setattr(filesystem_async, "_write_item", _write_item)
    monkeypatch.setattr(shutil, "disk_usage", _disk_usage)
