"""Size and xxh3-128 hash of files, and how files differ from the entries recorded for them.

The records of the checkpoint manifests (``runtime.checkpoint_manifest``) and of the SFT token cache
(``data.sft_cache``): ``{"<relative path>": {"size": int, "xxh3_128": hex}}``. xxh3-128 (the ``xxhash``
package) hashes at memory speed; it detects truncation, deleted files and flipped bytes, not someone who
rewrites the record too. Work can be split: :func:`hash_files` takes any subset of names (e.g. one share
per rank) and :func:`check_entries` compares any subset of entries.
"""

from __future__ import annotations

import os
from pathlib import Path

HASH = "xxh3_128"
_CHUNK = 8 << 20


def hash_file(path: str | os.PathLike) -> str:
    """xxh3-128 of a file's bytes (hex), read in 8 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hash_files(root: str | os.PathLike, names: list[str]) -> dict:
    """``{name: {"size", "xxh3_128"}}`` for the given paths relative to ``root``."""
    root = Path(root)
    return {n: {"size": (root / n).stat().st_size, HASH: hash_file(root / n)} for n in names}


def check_entries(root: str | os.PathLike, entries: dict, deep: bool = True) -> list[str]:
    """Problems of the listed files (missing, size, hash with ``deep``); empty when they all match."""
    root = Path(root)
    problems = []
    for name, want in sorted(entries.items()):
        p = root / name
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != want.get("size"):
            problems.append(f"{name} has {p.stat().st_size} bytes, the manifest says {want.get('size')}")
        elif deep and hash_file(p) != want.get(HASH):
            problems.append(f"{name} does not match its checksum")
    return problems


def first_problem(problems: list[str]) -> str | None:
    """One line for a list of problems (the first, and how many more), or None."""
    if not problems:
        return None
    return problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
