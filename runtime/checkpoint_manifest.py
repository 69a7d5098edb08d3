"""Integrity manifests of checkpoint directories: every file's size and xxh3-128 hash.

``manifest.json`` is written into a checkpoint directory after all its files are complete
(temp name, fsync, rename), so a checkpoint with a manifest is a finished one; verifying it
re-reads every file and compares. xxh3-128 (the ``xxhash`` package) hashes at memory speed,
far faster than the storage that holds a checkpoint; it protects against truncation, deleted
shards and flipped bytes; a file the manifest does not list fails the check too (a manifest that lost an
entry would otherwise switch that file's check off). It guards against accidental damage, not against
someone who can rewrite the directory: they can rewrite the manifest too.

    {"format": 1, "hash": "xxh3_128", "files": {"<relative path>": {"size": int, "xxh3_128": hex}}}

Work can be split: :func:`hash_files` takes any subset (e.g. one share per rank) and
:func:`check_entries` compares any subset of entries (both from ``data.file_hashes``, which the SFT
token cache uses too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from data.file_hashes import HASH, check_entries, first_problem, hash_file, hash_files  # noqa: F401 (re-exported)

MANIFEST = "manifest.json"
FORMAT = 1


def list_files(ckpt: str | os.PathLike) -> list[str]:
    """Relative paths of every regular file under ``ckpt`` except the manifest, sorted."""
    root = Path(ckpt)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(".tmp"))


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


def unlisted(ckpt: str | os.PathLike, entries: dict) -> list[str]:
    """Problems for the files of ``ckpt`` that its manifest ``entries`` do not list: a file without an entry
    would go unchecked, so a checkpoint verifies only when its manifest lists every file it holds."""
    return [f"{name} is not listed in its {MANIFEST} (a checkpoint verifies only when every file is)"
            for name in list_files(ckpt) if name not in entries]


def verify(ckpt: str | os.PathLike, deep: bool = True) -> str | None:
    """Why ``ckpt`` is not intact (one line), or None when its manifest lists every file and every file
    matches its entry."""
    try:
        entries = read_manifest(ckpt)
    except ValueError as e:
        return str(e)
    return first_problem(unlisted(ckpt, entries) + check_entries(ckpt, entries, deep))

