"""The query rows of a call that attends with a subset of a row's tokens (``QueryChunks``: a context-parallel
rank's chunks) against the whole row's keys: what the kernels read to find a query token's row.

Keys, blocks, documents and every position stay those of the whole row (``layout.py``); queries are the
chunks' tokens, compacted (``q [B, Tq, Hq, D]``, selection ``[B, Hkv, Tq, nb]``). ``rows`` maps each
token of a row to its query row (``-1``: not a query of this call); ``live`` marks the KV blocks whose
tokens hold query rows (the per-block selection programs of the others return at once). For the
attention, :func:`query_tiles` lists the query tiles (``qt`` tokens of a KV block, ``sparse_index``) that
hold query rows, so lists and programs scale with the chunks, not the row. Built on the host from the
chunks and the block table, once per micro-batch shape (cached).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from nosa_layers.query_chunks import QueryChunks

from .layout import BlockLayout


@dataclass(frozen=True)
class QueryLayout:
    chunks: QueryChunks
    num_rows: int       # Tq
    rows: Tensor        # int32 [T]: query row of each token of a row, -1 if none
    live: Tensor        # int32 [n_blocks]: 1 where the KV block holds a query row
    host_rows: np.ndarray = field(repr=False, compare=False)
    tiles: dict = field(default_factory=dict, repr=False, compare=False)  # qt -> (tiles, ranges)


def _upload(a: np.ndarray, device: torch.device) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    if device.type == "cuda":  # pinned source: the copy is queued, the host goes on
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _holds_rows(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether the token ranges ``[starts, ends)`` hold a query row (0/1 per range; empty ranges: 0)."""
    count = np.concatenate([[0], np.cumsum(rows >= 0)])
    return (count[np.maximum(ends, starts)] - count[starts] > 0).astype(np.int64)


_CACHE: dict = {}  # (id(layout), chunks) -> (layout, QueryLayout); the layout kept alive: its id stays its own


def query_layout(layout: BlockLayout, chunks: QueryChunks | None) -> QueryLayout | None:
    """The query layout of ``chunks`` in ``layout``'s row (``None`` for the whole row)."""
    if chunks is None:
        return None
    key = (id(layout), chunks)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    T = layout.seq_len
    rows = np.full(T, -1, dtype=np.int64)
    n = 0
    for a, b in chunks.spans:
        rows[a:b] = np.arange(n, n + b - a)
        n += b - a
    blocks = np.asarray(layout.host, dtype=np.int64).reshape(-1, 4)
    ks, de = blocks[:, 1], blocks[:, 3]
    live = _holds_rows(rows, ks, np.minimum(ks + layout.block, de))
    device = layout.blocks.device
    ql = QueryLayout(chunks, n, _upload(rows, device), _upload(live, device), rows)
    if len(_CACHE) >= 16:
        _CACHE.clear()
    _CACHE[key] = (layout, ql)
    return ql


def query_tiles(ql: QueryLayout, layout: BlockLayout, qt: int) -> tuple[Tensor, Tensor, int]:
    """``(tiles, ranges, n)``: the global index ``c * S + part`` of each query tile holding a query row,
    ascending (int32 ``[n]``), and per KV block ``c`` the range ``[lo, hi)`` of those tiles (indices into
    ``tiles``) that lie in its document from its own block on (int32 ``[n_blocks, 2]``: the tiles that
    may select it)."""
    if qt in ql.tiles:
        return ql.tiles[qt]
    S = layout.block // qt
    blocks = np.asarray(layout.host, dtype=np.int64).reshape(-1, 4)
    _b, ks, ds, de = blocks.T
    starts = (ks[:, None] + np.arange(S)[None, :] * qt).reshape(-1)
    ends = np.minimum(starts + qt, np.repeat(de, S))
    tiles = np.nonzero(_holds_rows(ql.host_rows, starts, ends))[0]
    c = np.arange(len(blocks))
    j = (ks - ds) // layout.block
    nb_doc = -(-(de - ds) // layout.block)
    ranges = np.stack([np.searchsorted(tiles, c * S), np.searchsorted(tiles, (c - j + nb_doc) * S)], axis=1)
    device = layout.blocks.device
    out = (_upload(tiles, device), _upload(ranges.reshape(-1), device), len(tiles))
    ql.tiles[qt] = out
    return out


@functools.lru_cache(maxsize=8)
def no_rows(device: str) -> Tensor:
    """A one-entry int32 stand-in for the query-row arguments of a whole-row launch (never read)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@triton.jit
def _query_rows(QRow, t, tvalid, SUBSET: tl.constexpr):
    """In a kernel: ``(valid, row)`` of tokens ``t`` (a row's token indices): their query rows (``QRow``;
    -1: not a query) where ``SUBSET``, else the tokens themselves (the whole row's call)."""
    if SUBSET:
        row = tl.load(QRow + t, mask=tvalid, other=-1)
        return tvalid & (row >= 0), row
    return tvalid, t
