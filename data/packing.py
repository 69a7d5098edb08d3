"""Packing documents into fixed-length rows with document boundaries, and batch collation.

Row convention (per sample, length S): ``tokens[t]`` predicts ``labels[t]``; ``loss_mask[t]`` says
whether that prediction is trained. Labels never cross a document: the last position of each
packed document has ``loss_mask = 0``. ``cu_seqlens`` (int32, starts at 0, ends at S) marks the
documents; trailing padding, if any, is one extra segment with ``loss_mask = 0``.

Batch convention (B rows): ``cu_seqlens`` is ``[B, K] int32`` padded on the right by repeating S
(zero-length segments, harmless for varlen kernels); ``cu_seqlens_len [B] int32`` gives the number
of valid entries per row; ``max_seqlen`` is a python int over the batch. Use
:func:`row_cu_seqlens` for row b or :func:`flat_cu_seqlens` for the THD layout of the whole batch.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

import numpy as np
import torch


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit bin packing in input order: each item goes to the open bin with the least room
    that still fits it (the lowest bin id among equals), else a new bin. Returns lists of item
    indices (order kept within a bin). Items longer than ``capacity`` are the caller's job
    (truncate/drop before). O(n log n): bins are kept by their remaining room (``room -> heap of
    bin ids``), with the sorted distinct rooms searched by bisection."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct remaining rooms of open bins
    at: dict[int, list[int]] = {}  # room -> min-heap of the bin ids with that room

    def open_bin(room: int, b: int) -> None:
        if room <= 0:
            return
        heap = at.get(room)
        if heap is None:
            at[room] = [b]
            bisect.insort(rooms, room)
        else:
            heapq.heappush(heap, b)

    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}: truncate or drop it first")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            heap = at[room]
            b = heapq.heappop(heap)
            if not heap:
                del at[room]
                del rooms[k]
            bins[b].append(i)
            open_bin(room - n, b)
        else:
            bins.append([i])
            open_bin(capacity - n, len(bins) - 1)
    return bins


def assemble_row(docs: Sequence[np.ndarray], masks: Sequence[np.ndarray] | None, seq_len: int, pad_id: int) -> dict:
    """Concatenate documents (1-D int arrays, total <= ``seq_len``) into one sample dict.

    ``masks[i][t] = 1`` marks tokens of doc i that are targets (e.g. assistant tokens); None = all.
    Returns numpy arrays: tokens/labels/position_ids int64 [S], loss_mask float32 [S], cu_seqlens int32 [K].
    """
    tokens = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_len, dtype=np.float32)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    cu = [0]
    o = 0
    for i, d in enumerate(docs):
        n = len(d)
        if n == 0:
            continue
        if o + n > seq_len:
            raise ValueError(f"documents total more than seq_len={seq_len} tokens")
        tokens[o:o + n] = d
        labels[o:o + n - 1] = d[1:]
        if masks is None:
            loss_mask[o:o + n - 1] = 1.0
        else:
            loss_mask[o:o + n - 1] = masks[i][1:]
        position_ids[o:o + n] = np.arange(n)
        o += n
        cu.append(o)
    if o < seq_len:
        position_ids[o:] = np.arange(seq_len - o)
        cu.append(seq_len)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "cu_seqlens": np.asarray(cu, dtype=np.int32)}


def collate(rows: Sequence[dict]) -> dict:
    """Stack sample dicts (numpy or torch) into a batch; pads ``cu_seqlens`` as described above."""
    out = {}
    for k in ("tokens", "labels", "position_ids"):
        out[k] = torch.stack([torch.as_tensor(r[k], dtype=torch.int64) for r in rows])
    out["loss_mask"] = torch.stack([torch.as_tensor(r["loss_mask"], dtype=torch.float32) for r in rows])
    if "dataset_id" in rows[0]:
        out["dataset_id"] = torch.tensor([int(r["dataset_id"]) for r in rows], dtype=torch.int64)
    if "cu_seqlens" in rows[0]:
        cus = [torch.as_tensor(r["cu_seqlens"], dtype=torch.int32) for r in rows]
        k = max(c.numel() for c in cus)
        cu = torch.empty(len(cus), k, dtype=torch.int32)
        for b, c in enumerate(cus):
            cu[b, : c.numel()] = c
            cu[b, c.numel():] = c[-1]
        out["cu_seqlens"] = cu
        out["cu_seqlens_len"] = torch.tensor([c.numel() for c in cus], dtype=torch.int32)
        out["max_seqlen"] = int(max(int((c[1:] - c[:-1]).max()) for c in cus))
    return out


def row_cu_seqlens(batch: dict, b: int) -> torch.Tensor:
    """The unpadded ``cu_seqlens`` of row ``b`` (int32 [n_docs + 1])."""
    return batch["cu_seqlens"][b, : int(batch["cu_seqlens_len"][b])]


def flat_cu_seqlens(batch: dict) -> torch.Tensor:
    """``cu_seqlens`` over the flattened ``[B*S]`` token stream (THD layout), int32."""
    S = batch["tokens"].shape[1]
    parts = [torch.zeros(1, dtype=torch.int32)]
    for b in range(batch["tokens"].shape[0]):
        parts.append(row_cu_seqlens(batch, b)[1:] + b * S)
    return torch.cat(parts)
