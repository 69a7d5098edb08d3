"""Tokenize an SFT set once: a cache keyed by a content hash, built by one process, read by all.

Key: xxh3-128 of the bytes of every input (files, or every file of an HF dataset dir), of the
tokenizer's files (vocabulary, merges, chat template) and of the settings that change the tokens
(chat template kind, ``seq_length``, over-long policy, bad-example policy, messages field). A cache
entry ``<cache_dir>/sft-<key>/`` holds ``tokens.npy`` (int32, all conversations concatenated),
``masks.npy`` (uint8, same length), ``offsets.npy`` (int64 [n+1]), ``sources.npy`` (int32 [n]) and
``meta.json`` (counts, and the size and xxh3-128 hash of each array file). It is written under a
temporary name and renamed when complete, so a reader sees a whole entry or none. Every read checks
the hashes first (the summary line says how long that took), then the range of the token ids: a damaged
entry (flipped bytes, a truncated array, an unreadable ``meta.json``, ids the tokenizer does not have) is
never trained on; it is rebuilt, with one line. A disk that fills up while an entry is written leaves no
entry and the run tokenizes without the cache, with one line.

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
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from data import disk_space, file_hashes
from data.sft import SFTData, check_losses, tokenize_inputs
from data.sources import BadInputError, ReadStats

CACHE_VERSION = 2  # 2: meta.json holds each array's size and xxh3-128 hash
ARRAYS = ("tokens.npy", "masks.npy", "offsets.npy", "sources.npy")
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


def write_entry(data: SFTData, entry: Path, replace: bool = False) -> bool:
    """Write ``data`` as the cache entry ``entry`` (temp dir + rename). An existing entry is kept (another
    writer's: returns False) unless ``replace`` (a damaged one: moved aside, then deleted)."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    old = entry.with_name(f".{entry.name}.damaged-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover (same pid) only
    tmp.mkdir(parents=True)
    try:
        lens = np.fromiter((len(x) for x in data.ids), dtype=np.int64, count=len(data.ids))
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        np.save(tmp / "tokens.npy", np.concatenate(data.ids).astype(np.int32) if data.ids else np.zeros(0, np.int32))
        np.save(tmp / "masks.npy", np.concatenate(data.masks).astype(np.uint8) if data.masks else np.zeros(0, np.uint8))
        np.save(tmp / "sources.npy", np.asarray(data.sources, dtype=np.int32))
        meta = {"version": CACHE_VERSION, "stats": dict(data.stats), "read": data.read.as_dict(),
                "files": file_hashes.hash_files(tmp, list(ARRAYS))}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if replace and entry.exists():
            os.rename(entry, old)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # not a concurrent writer's complete entry
                raise
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _meta_problem(meta) -> str | None:
    """What ``meta.json`` lacks (None when every field the reader needs is there, with its type)."""
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    if meta.get("version") != CACHE_VERSION:
        return f"written by cache version {meta.get('version')!r}, this is version {CACHE_VERSION}"
    read = meta.get("read")
    need = {"stats": (meta.get("stats"), dict), "files": (meta.get("files"), dict), "read": (read, dict)}
    if isinstance(read, dict):
        need.update({f"read.{k}": (read.get(k), t) for k, t in
                     (("rows", int), ("kept", int), ("rejected", dict), ("first_at", dict))})
    bad = [k for k, (v, t) in need.items() if not isinstance(v, t)]
    if bad:
        return f"meta.json lacks {', '.join(bad)}"
    if sorted(meta["files"]) != sorted(ARRAYS):
        return f"meta.json lists {sorted(meta['files'])}, not {sorted(ARRAYS)}"
    return None


def check_entry(entry: Path, vocab_size: int | None = None) -> tuple[SFTData | None, str | None]:
    """``(data, None)`` for an entry whose files match their hashes and whose token ids lie below ``vocab_size``
    (memory-mapped views), ``(None, problem)`` for a damaged one (one line), ``(None, None)`` where there is
    none. Reads (hashes) every byte once."""
    if not entry.exists():
        return None, None
    t0 = time.perf_counter()
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except FileNotFoundError:
        return None, "meta.json is missing"
    except (OSError, ValueError) as e:
        return None, f"meta.json is unreadable ({type(e).__name__})"
    problem = _meta_problem(meta) or file_hashes.first_problem(file_hashes.check_entries(entry, meta["files"]))
    if problem:
        return None, problem
    try:
        off = np.load(entry / "offsets.npy")
        mmap = "r" if len(off) and off[-1] > 0 else None  # an empty array cannot be memory-mapped
        tokens = np.load(entry / "tokens.npy", mmap_mode=mmap)
        masks = np.load(entry / "masks.npy", mmap_mode=mmap)
        sources = np.load(entry / "sources.npy").tolist()
    except (OSError, ValueError) as e:
        return None, f"an array is unreadable ({e})"
    n = len(off) - 1
    if not (n >= 0 and off[0] == 0 and np.all(np.diff(off) >= 0) and off[-1] == len(tokens) == len(masks)
            and len(sources) == n):
        return None, "its arrays disagree in length"
    if vocab_size is not None and len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        return None, f"tokens.npy holds token id {bad}, outside the tokenizer's {vocab_size} ids"
    read = ReadStats(rows=meta["read"]["rows"], kept=meta["read"]["kept"])
    read.rejected.update(meta["read"]["rejected"])
    read.first_at.update(meta["read"]["first_at"])
    size, seconds = sum(v["size"] for v in meta["files"].values()), time.perf_counter() - t0
    return SFTData(ids=[tokens[off[i]:off[i + 1]] for i in range(n)],
                   masks=[masks[off[i]:off[i + 1]] for i in range(n)],
                   sources=sources, stats=Counter(meta["stats"]), read=read,
                   origin=f"from cache {entry}, {size / 2**20:.1f} MiB verified in {seconds:.2f}s"), None


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


_CANNOT_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _build_or_read(cfg, tok, entry: Path, progress: bool, warn) -> SFTData:
    """Read ``entry``, or tokenize (with progress) and write it, under a file lock next to it. A damaged entry
    is never used: it is rebuilt (one warning line); a cache dir we may not write is read or bypassed."""
    with ExitStack() as stack:
        try:
            stack.enter_context(_file_lock(entry.with_name(entry.name + ".lock")))
            unwritable = None
        except OSError as e:
            if e.errno not in _CANNOT_WRITE:
                raise
            unwritable = e.strerror
        data, problem = check_entry(entry, tok.vocab_size)
        if data is not None:
            return data
        if problem:
            warn(f"warning: SFT cache entry {entry} is damaged ({problem}): "
                 f"{'tokenizing without the cache' if unwritable else 'tokenizing again to replace it'}")
        data = tokenize_inputs(cfg, tok, progress=progress)
        if unwritable is None:
            try:
                written = write_entry(data, entry, replace=problem is not None)
                data.origin = (f"tokenized, {'rebuilt' if problem else 'cached'} in {entry}" if written
                               else f"tokenized; another job cached the same entry in {entry} meanwhile")
                return data
            except OSError as e:
                full = disk_space.is_disk_full(e, entry.parent)  # numpy's writer drops the errno
                if e.errno not in _CANNOT_WRITE and not full:
                    raise
                unwritable = f"disk full, {disk_space.human(disk_space.free_bytes(entry.parent))} free" if full \
                    else e.strerror
        warn(f"warning: cannot write the SFT cache in {entry.parent} ({unwritable}); tokenized without a cache "
             f"(set sft.cache_dir to a writable directory shared by all nodes)")
        data.origin = "tokenized, not cached"
        return data


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
        data, problem = check_entry(entry, tok.vocab_size)
        if data is None:
            why = f"finds the SFT cache entry {entry} damaged ({problem})" if problem else (
                f"finds no SFT cache entry {entry} (sft.cache_dir not shared between nodes, or not writable)")
            print(f"warning: rank {dist.get_rank()} {why}; tokenizing on this rank", flush=True)
            data = tokenize_inputs(cfg, tok)
        data = check_losses(data, cfg, lambda m: None)  # rank 0 has reported
    return data
