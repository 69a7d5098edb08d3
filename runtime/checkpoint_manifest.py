"""Integrity manifests of checkpoint directories: every file's size and xxh3-128 hash.

``manifest.json`` is written into a checkpoint directory after all its files are complete
(temp name, fsync, rename), so a checkpoint with a manifest is a finished one; verifying it
re-reads every file and compares. xxh3-128 (the ``xxhash`` package) hashes at memory speed,
far faster than the storage that holds a checkpoint; it protects against truncation, deleted
shards and flipped bytes, not against someone who rewrites the manifest too.

    {"format": 1, "hash": "xxh3_128", "files": {"<relative path>": {"size": int, "xxh3_128": hex}}}

Work can be split: :func:`hash_files` takes any subset (e.g. one share per rank) and
:func:`check_entries` compares any subset of entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
HASH = "xxh3_128"
FORMAT = 1
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


def list_files(ckpt: str | os.PathLike) -> list[str]:
    """Relative paths of every regular file under ``ckpt`` except the manifest, sorted."""
    root = Path(ckpt)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(".tmp"))


def hash_files(ckpt: str | os.PathLike, names: list[str]) -> dict:
    """``{name: {"size", "xxh3_128"}}`` for the given relative paths."""
    root = Path(ckpt)
    return {n: {"size": (root / n).stat().st_size, HASH: hash_file(root / n)} for n in names}


def write_manifest(ckpt: str | os.PathLike, entries: dict) -> Path:
    """Write ``manifest.json`` atomically (temp name, fsync, rename, fsync of the directory)."""
    root = Path(ckpt)
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "hash": HASH, "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    fsync_dir(root)
    return root / MANIFEST


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(ckpt: str | os.PathLike) -> dict:
    """The ``files`` entries of a checkpoint's manifest; ``ValueError`` (one line) when absent or unreadable."""
    path = Path(ckpt) / MANIFEST
    if not path.exists():
        raise ValueError(f"{MANIFEST} is missing")
    try:
        raw = json.loads(path.read_text())
        files = raw["files"]
        if raw.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"hash {raw.get('hash')!r}")
        if not all(isinstance(v, dict) for v in files.values()):
            raise ValueError("an entry is not an object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__ if isinstance(e, OSError) else e})") from None
    return files


def check_entries(ckpt: str | os.PathLike, entries: dict, deep: bool = True) -> list[str]:
    """Problems of the listed files (missing, size, hash with ``deep``); empty when they all match."""
    root = Path(ckpt)
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


def verify(ckpt: str | os.PathLike, deep: bool = True) -> str | None:
    """Why ``ckpt`` is not intact (one line), or None when every file matches its manifest entry."""
    try:
        entries = read_manifest(ckpt)
    except ValueError as e:
        return str(e)
    return first_problem(check_entries(ckpt, entries, deep))


def first_problem(problems: list[str]) -> str | None:
    """One line for a list of problems (the first, and how many more), or None."""
    if not problems:
        return None
    return problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
