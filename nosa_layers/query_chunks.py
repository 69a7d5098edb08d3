"""Query subsets of a row: the chunks of query tokens one context-parallel rank attends with.

A call with ``QueryChunks`` attends with the query rows of a few contiguous spans of a key row of
``T`` tokens (keys, values and scores are the whole row; the queries are the spans' tokens, in span
order). Everything position-dependent (causality, blocks, windows, document boundaries) uses the
GLOBAL token index in the row, so the result of each query row equals the full-row call's.

Context parallelism (megatron-core's load balancing, ``get_batch_on_this_cp_rank``): a row of ``T``
tokens is cut into ``2 * cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``
(head and tail: every rank gets the same causal work on one long document).
:func:`zigzag_chunks` gives that rank's ``QueryChunks``; packed documents cross chunk borders freely.
Pure PyTorch, no distributed code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class QueryChunks:
    """Spans ``[(start, end), ...]`` of global token indices (ascending, disjoint, non-empty); the query
    rows of a call are their tokens in this order (local row ``i`` <-> global token ``rows()[i]``)."""

    spans: tuple

    def __post_init__(self) -> None:
        spans = tuple((int(a), int(b)) for a, b in self.spans)
        object.__setattr__(self, "spans", spans)
        prev = 0
        for a, b in spans:
            if not (prev <= a < b):
                raise ValueError(f"query chunks must be ascending, disjoint and non-empty, got {list(spans)}")
            prev = b

    @property
    def num_rows(self) -> int:
        """Query rows of the call (``Tq``)."""
        return sum(b - a for a, b in self.spans)

    @property
    def end(self) -> int:
        """One past the last global token a query row holds."""
        return self.spans[-1][1] if self.spans else 0

    def check(self, num_queries: int, seq_len: int) -> None:
        """One-line ``ValueError`` unless ``num_queries`` rows fit these chunks of a ``seq_len``-token row."""
        if self.end > seq_len:
            raise ValueError(f"query chunks {list(self.spans)} reach past the key row of {seq_len} tokens")
        if num_queries != self.num_rows:
            raise ValueError(f"q has {num_queries} rows but the query chunks {list(self.spans)} hold {self.num_rows}")

    def rows(self, device=None) -> Tensor:
        """Global token index of every query row, int64 ``[Tq]``."""
        return _rows(self.spans, str(torch.device(device or "cpu")))

    def pieces(self, doc_spans: list[tuple[int, int]]) -> list[tuple[int, int, int, int, int]]:
        """The chunks cut at document borders, in query-row order: ``(doc_start, doc_end, start, end, row)``
        with ``[start, end)`` global tokens of one document and ``row`` the query row of ``start``."""
        out, row = [], 0
        for a, b in self.spans:
            for s, e in doc_spans:
                lo, hi = max(a, s), min(b, e)
                if lo < hi:
                    out.append((s, e, lo, hi, row + lo - a))
            row += b - a
        return out


@functools.lru_cache(maxsize=64)
def _rows(spans: tuple, device: str) -> Tensor:
    parts = [torch.arange(a, b, dtype=torch.int64) for a, b in spans]
    rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return rows.to(device)


def full_chunks(seq_len: int) -> QueryChunks:
    """Every token of the row as one chunk (the full-sequence call)."""
    return QueryChunks(((0, seq_len),) if seq_len else ())


def zigzag_chunks(seq_len: int, cp_size: int, cp_rank: int) -> QueryChunks:
    """The query chunks of context-parallel rank ``cp_rank`` of ``cp_size`` in a row of ``seq_len`` tokens
    (chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of ``2 cp_size``; adjacent ones merged)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of {cp_size} is not a rank")
    if seq_len % (2 * cp_size):
        raise ValueError(f"a row of {seq_len} tokens cannot be cut into 2*context_parallel={2 * cp_size} equal "
                         f"chunks; use a sequence length divisible by {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    head, tail = (cp_rank * c, (cp_rank + 1) * c), ((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    if head[1] == tail[0]:
        return QueryChunks(((head[0], tail[1]),))
    return QueryChunks((head, tail))


def zigzag_split(x: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This rank's tokens of ``x`` along ``dim`` (megatron-core's ``get_batch_on_this_cp_rank``)."""
    if cp_size == 1:
        return x
    rows = zigzag_chunks(x.shape[dim], cp_size, cp_rank).rows(x.device)
    return x.index_select(dim, rows)


def zigzag_permutation(seq_len: int, cp_size: int, device=None) -> Tensor:
    """Global token index of every row of the rank-major concatenation of all ranks' tokens, int64
    ``[seq_len]``: ``full[perm] == cat([rank 0's tokens, rank 1's, ...])``."""
    return torch.cat([zigzag_chunks(seq_len, cp_size, r).rows(device) for r in range(cp_size)])
