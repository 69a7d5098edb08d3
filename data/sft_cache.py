"""Tokenize an SFT set once: a cache keyed by a content hash, built by one process, read by all.

Key: xxh3-128 of the bytes of every input (files, or every file of an HF dataset dir), of the
tokenizer's files (vocabulary, merges, chat template) and of the settings that change the tokens
(chat template kind, ``seq_length``, over-long policy, bad-example policy, messages field). A cache
entry ``<cache_dir>/sft-<key>/`` holds ``tokens.npy`` (int32, all conversations concatenated),
``masks.npy`` (uint8, same length), ``offsets.npy`` (int64 [n+1]), ``sources.npy`` (int32 [n]) and
``meta.json`` (counts). It is written under a temporary name and renamed when complete, so a
reader sees a whole entry or none.

Who builds: with a process group, rank 0 (the only rank that reads the inputs to hash them; under
a file lock, so concurrent jobs do not build the same entry twice) while the other ranks wait in a
broadcast that carries the entry's path or rank 0's one-line error; without a process group,
whichever process takes the file lock first. A rank that cannot see the entry
(cache dir not shared between nodes) or a cache dir that is not writable falls back to tokenizing
in memory, with one warning line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data.sft import SFTData, check_losses, tokenize_inputs
from data.sources import BadInputError, ReadStats

CACHE_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KEY_SETTINGS = ("chat_template", "seq_length", "overlong", "on_bad_example", "messages_field")


def _hash_path(h, path: str) -> None:
    """Feed the bytes of ``path`` (a file, or every file below a dir in sorted order) into ``h``."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else "").encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        h.update(b"\0")


def cache_key(cfg, tokenizer_dir: str) -> str:
    """Content hash (32 hex chars) of the inputs, the tokenizer files and the tokenizing settings."""
    import xxhash

    h = xxhash.xxh3_128()
    settings = {k: getattr(cfg, k) for k in KEY_SETTINGS}
    h.update(json.dumps({"version": CACHE_VERSION, "inputs": len(cfg.inputs()), **settings}, sort_keys=True).encode())
    for path in cfg.inputs():
        _hash_path(h, path)
    for name in TOKENIZER_FILES:
        f = os.path.join(tokenizer_dir, name)
        h.update(name.encode())
        if os.path.isfile(f):
            _hash_path(h, f)
    return h.hexdigest()


def cache_root(cfg) -> Path:
    """``sft.cache_dir``, or ``.sft_cache`` next to the first input."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    return Path(os.path.abspath(cfg.inputs()[0])).parent / ".sft_cache"


def write_entry(data: SFTData, entry: Path) -> None:
    """Write ``data`` as the cache entry ``entry`` (temp dir + rename; an existing entry is kept)."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover (same pid) only
    tmp.mkdir(parents=True)
    try:
        lens = np.fromiter((len(x) for x in data.ids), dtype=np.int64, count=len(data.ids))
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        np.save(tmp / "tokens.npy", np.concatenate(data.ids).astype(np.int32) if data.ids else np.zeros(0, np.int32))
        np.save(tmp / "masks.npy", np.concatenate(data.masks).astype(np.uint8) if data.masks else np.zeros(0, np.uint8))
        np.save(tmp / "sources.npy", np.asarray(data.sources, dtype=np.int32))
        meta = {"version": CACHE_VERSION, "stats": dict(data.stats), "read": data.read.as_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # not a concurrent writer's complete entry
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_entry(entry: Path) -> SFTData | None:
    """The cached conversations (memory-mapped views), or None if ``entry`` is not a complete entry."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("version") != CACHE_VERSION:
            return None
        off = np.load(entry / "offsets.npy")
        mmap = "r" if off[-1] > 0 else None  # an empty array cannot be memory-mapped
        tokens = np.load(entry / "tokens.npy", mmap_mode=mmap)
        masks = np.load(entry / "masks.npy", mmap_mode=mmap)
        sources = np.load(entry / "sources.npy").tolist()
    except (OSError, ValueError):
        return None
    read = ReadStats(rows=meta["read"]["rows"], kept=meta["read"]["kept"])
    read.rejected.update(meta["read"]["rejected"])
    read.first_at.update(meta["read"]["first_at"])
    n = len(off) - 1
    return SFTData(ids=[tokens[off[i]:off[i + 1]] for i in range(n)],
                   masks=[masks[off[i]:off[i + 1]] for i in range(n)],
                   sources=sources, stats=Counter(meta["stats"]), read=read, origin=f"from cache {entry}")


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build_or_read(cfg, tok, entry: Path, progress: bool, warn) -> SFTData:
    """Read ``entry``, or tokenize (with progress) and write it, under a file lock next to it."""
    try:
        with _file_lock(entry.with_name(entry.name + ".lock")):
            data = read_entry(entry)
            if data is None:
                data = tokenize_inputs(cfg, tok, progress=progress)
                write_entry(data, entry)
                data.origin = f"tokenized, cached in {entry}"
            return data
    except OSError as e:  # a cache dir we may not write: tokenize without a cache
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        warn(f"warning: cannot write the SFT cache in {entry.parent} ({e.strerror}); tokenizing without a cache "
             f"(set sft.cache_dir to a writable directory shared by all nodes)")
        return tokenize_inputs(cfg, tok, progress=progress)


def load_sft_cached(cfg, tok, log=None) -> SFTData:
    """The tokenized conversations of ``cfg`` (an ``SFTConfig``), from the cache or tokenized once.

    Every rank of the default process group (if one exists) must call it. Raises
    ``BadInputError`` (on every rank) when the data is unusable.
    """
    import torch.distributed as dist

    log = log or (lambda m: None)
    tok.check_model_vocab(cfg.model_vocab_size)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        entry = cache_root(cfg) / f"sft-{cache_key(cfg, tok.path)}"
        return check_losses(_build_or_read(cfg, tok, entry, progress=True, warn=log), cfg, log)
    status = [None, None]  # [error line or None, cache entry]: only rank 0 reads (hashes) the inputs
    data = None
    if dist.get_rank() == 0:
        try:
            entry = cache_root(cfg) / f"sft-{cache_key(cfg, tok.path)}"
            status[1] = str(entry)
            data = check_losses(_build_or_read(cfg, tok, entry, progress=True, warn=log), cfg, log)
        except (ValueError, OSError) as e:  # BadInputError is a ValueError
            status[0] = str(e)
    dist.broadcast_object_list(status, src=0)  # the other ranks wait here while rank 0 tokenizes
    if status[0] is not None:
        raise BadInputError(status[0])
    if data is None:
        entry = Path(status[1])
        data = read_entry(entry)
        if data is None:
            print(f"warning: rank {dist.get_rank()} finds no SFT cache entry {entry} (sft.cache_dir not shared "
                  f"between nodes, or not writable); tokenizing on this rank", flush=True)
            data = tokenize_inputs(cfg, tok)
        data = check_losses(data, cfg, lambda m: None)  # rank 0 has reported
    return data
