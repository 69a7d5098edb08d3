"""``train/main.py`` on a disk that fills up while the checkpoint of step ``$NOSA_TEST_DISK_FULL_AT`` is written.

The first file megatron-core writes into that save's ``iter_N.tmp`` gets 4 KiB, then ``ENOSPC``; from then on the
file system reports no free space, as a full one does. Everything else is the real trainer.
"""

import errno
import functools
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402

SAVE_DIR = f"iter_{int(os.environ['NOSA_TEST_DISK_FULL_AT']):07d}.tmp"
full = []
write_item, disk_usage = filesystem_async._write_item, shutil.disk_usage


@functools.wraps(write_item)  # megatron-core reads its signature
def _write_item(transforms, stream, *args, **kwargs):
    if SAVE_DIR in getattr(stream, "name", ""):
        stream.write(b"\0" * 4096)
        full.append(stream.name)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write_item(transforms, stream, *args, **kwargs)


def _disk_usage(path):
    usage = disk_usage(path)
    return usage._replace(free=0) if full else usage


filesystem_async._write_item = _write_item
shutil.disk_usage = _disk_usage

if __name__ == "__main__":
    from train.main import main

    sys.exit(main())
