"""megatron-core indexed datasets: writing ``.bin/.idx`` and building GPT dataset splits.

Each document is stored as one sequence ``[t_0 .. t_{n-1}, EOD]`` (int32 or uint16 tokens).
``build_gpt_splits`` returns megatron-core GPTDataset / BlendedDataset objects (train, valid, test)
with deterministic shuffling and cached index arrays.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import numpy as np


def token_dtype(vocab_size: int):
    """Smallest dtype megatron-core uses for ``vocab_size`` tokens (uint16 if it fits, else int32)."""
    return np.uint16 if vocab_size <= 65536 else np.int32


class IndexedWriter:
    """Append documents (1-D int arrays) to ``<prefix>.bin`` and write ``<prefix>.idx`` on close."""

    def __init__(self, prefix: str, vocab_size: int):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        d = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(d, exist_ok=True)
        self.prefix = prefix
        self.dtype = token_dtype(vocab_size)
        self._builder = IndexedDatasetBuilder(prefix + ".bin", dtype=self.dtype)
        self.documents = 0
        self.tokens = 0
        self.id_range: tuple[int, int] | None = None  # (smallest, largest) token id written

    def add(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self._builder.add_document(arr, [arr.size])
        self.documents += 1
        self.tokens += int(arr.size)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            self.id_range = (lo, hi) if self.id_range is None else (min(lo, self.id_range[0]),
                                                                      max(hi, self.id_range[1]))

    def close(self) -> None:
        self._builder.finalize(self.prefix + ".idx")

    def discard(self) -> None:
        """Close the ``.bin`` file handle without writing an index (files are left to the caller)."""
        f = getattr(self._builder, "data_file", None)
        if f is not None and not f.closed:
            f.close()


def write_indexed(prefix: str, docs: Iterable, vocab_size: int) -> tuple[int, int]:
    """Write all ``docs`` (already including EOD); returns ``(documents, tokens)``."""
    w = IndexedWriter(prefix, vocab_size)
    for d in docs:
        w.add(d)
    w.close()
    return w.documents, w.tokens


_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}  # megatron-core's DType codes
_REBUILD = "rebuild it with `python -m data.preprocess`"


def read_index(prefix: str) -> tuple[np.ndarray, type]:
    """``(document lengths, token dtype)`` from ``<prefix>.idx``, after checking that both files exist, that the
    index is a whole megatron index and that ``<prefix>.bin`` holds the tokens it describes; anything else is a
    one-line ``FileNotFoundError`` / ``ValueError`` naming the file (megatron-core's reader would raise deep inside,
    or not at all for a short ``.bin``)."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for f in (bin_path, idx):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f} does not exist (give the prefix of an indexed dataset, without .bin/.idx)")
    with open(idx, "rb") as f:
        head = f.read(34)  # magic (9 bytes), version (8), dtype code (1), sequence count (8), document count (8)
        code = head[17] if len(head) == 34 else None
        if code not in _INDEX_DTYPES or not head.startswith(_INDEX_HEADER):
            raise ValueError(f"{idx} is not a megatron index (truncated or another format); {_REBUILD}")
        n = int.from_bytes(head[18:26], "little")
        lengths = np.fromfile(f, dtype=np.int32, count=n)
    if len(lengths) < n:
        raise ValueError(f"{idx} is truncated (it lists {n} documents but holds the lengths of {len(lengths)}); "
                         f"{_REBUILD}")
    dtype = _INDEX_DTYPES[code]
    tokens = int(lengths.sum(dtype=np.int64))
    need, have = tokens * np.dtype(dtype).itemsize, os.path.getsize(bin_path)
    if have < need:
        raise ValueError(f"{bin_path} holds {have} bytes but {idx} describes {n} documents of {tokens} tokens "
                         f"({need} bytes): the dataset is damaged or incomplete; {_REBUILD}")
    return lengths, dtype


def read_indexed(prefix: str):
    """Open ``<prefix>.bin/.idx`` (mmap); ``ds[i]`` is document i as a numpy array. Damaged, incomplete or
    empty files are a one-line error naming them (:func:`read_index`)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if len(read_index(prefix)[0]) == 0:
        raise ValueError(f"{prefix}.bin/.idx holds no documents; {_REBUILD}")
    return IndexedDataset(prefix, multimodal=False, mmap=True)


def id_range_record(bin_path: str, id_range: tuple[int, int] | None) -> dict:
    """What a writer records in ``<prefix>.summary.json`` so that :func:`token_id_range` need not read the
    tokens again: the range, and the size and modification time of the ``.bin`` it describes."""
    st = os.stat(bin_path)
    return {"token_id_range": None if id_range is None else list(id_range), "bin_bytes": st.st_size,
            "bin_mtime_ns": st.st_mtime_ns}


def _recorded_id_range(prefix: str):
    """The range ``<prefix>.summary.json`` records for the ``.bin`` as it is now (same size and mtime), or
    ``False`` when there is no such record."""
    import json

    try:
        with open(prefix + ".summary.json") as f:
            rec = json.load(f)
        st = os.stat(prefix + ".bin")
    except (OSError, ValueError):
        return False
    if not isinstance(rec, dict) or "token_id_range" not in rec or \
            (rec.get("bin_bytes"), rec.get("bin_mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return False
    got = rec["token_id_range"]
    return None if got is None else (int(got[0]), int(got[1]))


def token_id_range(prefix: str, chunk: int = 1 << 26) -> tuple[int, int] | None:
    """``(smallest, largest)`` token id of ``<prefix>.bin`` (None when it holds none): the record of the writer
    (``data.preprocess``) when it describes the file as it is, else read in chunks (once per start; a dataset
    written by another tool, or changed since)."""
    recorded = _recorded_id_range(prefix)
    if recorded is not False:
        read_index(prefix)  # the files are still whole
        return recorded
    lengths, dtype = read_index(prefix)
    total = int(lengths.sum(dtype=np.int64))
    if total == 0:
        return None
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(total,))
    lo, hi = None, None
    for i in range(0, total, chunk):
        part = tokens[i:i + chunk]
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    del tokens
    return lo, hi


def check_token_ids(prefix: str, vocab_size: int, what: str) -> None:
    """Refuse (one line) a dataset holding a token id outside ``[0, vocab_size)``: the model's embedding would
    fail on it steps into the run."""
    got = token_id_range(prefix)
    if got is not None and (got[0] < 0 or got[1] >= vocab_size):
        bad = got[0] if got[0] < 0 else got[1]
        raise ValueError(f"{what} {prefix!r} holds token id {bad} but the model's vocabulary is {vocab_size}: it was "
                         f"tokenized with another tokenizer or {prefix}.bin is damaged; {_REBUILD} and the model's "
                         f"tokenizer")


def count_tokens(prefix: str) -> int:
    """Total tokens stored in ``<prefix>.bin`` (keeps the mmap alive while summing)."""
    ds = read_indexed(prefix)
    total = int(ds.sequence_lengths.sum())
    del ds
    return total


SPLIT_NAMES = ("train", "valid", "test")


def _split_matrix(split: str) -> list:
    """megatron-core's ``[start, end)`` fractions of each part of ``split``; None for a part of weight 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def split_ranges(split: str, num_docs: int) -> dict[str, range]:
    """Document index ranges of the train / valid / test parts, as megatron-core computes them."""
    return {name: range(0) if b is None else range(int(round(b[0] * num_docs)), int(round(b[1] * num_docs)))
            for name, b in zip(SPLIT_NAMES, _split_matrix(split))}


def check_parts_fill_a_sample(cfg, sizes: list, weighted: bool) -> None:
    """Refuse (one line, with the counts) a path whose part of ``data.split`` holds fewer tokens than one sample
    (``seq_length + 1``) when samples are asked of it (``sizes``): megatron-core repeats a part's epochs until
    they hold the samples asked for, forever for an empty one. Several paths without weights are read one
    epoch each (nothing repeated), so a short path there only adds no samples."""
    if len(cfg.paths) > 1 and not weighted:
        return
    need = cfg.seq_length + 1
    weights = cfg.weights if weighted else [1.0]
    for path, weight in zip(cfg.paths, weights):
        if weight <= 0:
            continue
        lengths = read_index(path)[0].astype(np.int64)
        built = [b is not None for b in _split_matrix(cfg.split)]
        for (part, r), size, is_built in zip(split_ranges(cfg.split, len(lengths)).items(), sizes, built):
            if not is_built or size is None:
                continue
            tokens = int(lengths[r.start:r.stop].sum())
            if tokens < need:
                fix = "add data or lower data.seq_length" + (
                    "" if part == "train" else f", or give the {part} part no weight in data.split (e.g. '100,0,0')")
                raise ValueError(f"data.paths entry {path!r}: its {part} part (data.split={cfg.split!r}) holds "
                                 f"{tokens} tokens in {len(r)} document(s), fewer than one sample of "
                                 f"data.seq_length + 1 = {need} tokens: {fix}")


def build_gpt_splits(cfg, tokenizer, train_samples: Optional[int] = None, valid_samples: Optional[int] = None):
    """Build ``[train, valid, test]`` megatron-core datasets for a validated ``DataConfig``.

    ``tokenizer``: a ``data.tokenizer.Tokenizer``. Samples hold ``seq_length`` tokens (+1 for labels).
    Sizes None = one epoch of each split (blends with weights need sizes; a default is derived).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from data.tokenizer import MegatronTokenizerAdapter

    train_samples = train_samples if train_samples is not None else cfg.train_samples
    valid_samples = valid_samples if valid_samples is not None else cfg.valid_samples
    weighted = cfg.weights is not None and len(cfg.paths) > 1  # one path: a weight means nothing
    blend = (list(cfg.paths), list(cfg.weights) if weighted else None)
    if weighted and train_samples is None:
        # weighted blends need an explicit size: default to one pass over the total tokens
        total = sum(count_tokens(p) for p in cfg.paths)
        train_samples = max(1, total // cfg.seq_length)
    if weighted and valid_samples is None:
        valid_samples = max(1, (train_samples or 1) // 50)
    document_mode = cfg.packing == "document"
    gcfg = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        split=cfg.split,
        path_to_cache=cfg.cache_dir,
        tokenizer=MegatronTokenizerAdapter(tokenizer),
        reset_position_ids=False,  # document mode recomputes positions from cu_seqlens (cheaper)
        reset_attention_mask=False,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False,
        inter_document_masking=document_mode,
        num_dataset_builder_threads=cfg.num_builder_threads,
    )
    sizes = [train_samples, valid_samples, valid_samples if weighted else None]
    check_parts_fill_a_sample(cfg, sizes, weighted)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gcfg).build()
