"""Offloading-decoder simulator (NOSI-style): what a decode step must copy host -> device.

Model. The KV cache of every (layer, KV head) lives in host memory in blocks of ``block_size``
tokens; the GPU keeps a cache of ``capacity`` blocks per (layer, KV head). At decode step ``t`` the
layer needs the blocks ``S_t`` its selection picked. The block holding token ``t`` is written on
the device (never fetched). Every block of ``S_t`` not resident is fetched (one H2D copy of its K
and V), then resident blocks outside ``S_t`` are evicted until ``capacity`` remain:

* ``score``: lowest query-agnostic block score first (the model's own eviction score, pooled as
  the selection pools it). Only blocks older than the sliding window can be evicted and their
  windows are complete, so their pooled score is final: ranking by the score of the whole
  sequence is causal;
* ``lru``: least recently needed first;
* ``previous``: keep exactly ``S_t`` (the cache model of ``nosa_layers.measure_locality``;
  ``capacity`` unused).

Ties are evicted lower block index first. Bytes: one block of one KV head is
``block_size x head_dim x 2 (K, V) x bytes_per_element`` (bf16: 2). A dense model with the same
cache keeps ``capacity`` blocks per head pinned and streams the rest of its prefix every step.
All functions are pure (numpy in, numbers out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

POLICIES = ("score", "lru", "previous")


@dataclass(frozen=True)
class KVGeometry:
    """KV layout that sets the bytes of one fetched block."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    bytes_per_element: int = 2  # bf16

    @property
    def block_bytes(self) -> int:
        """Host -> device bytes of one block of one KV head (K and V)."""
        return self.block_size * self.head_dim * 2 * self.bytes_per_element


@dataclass
class CacheTrace:
    """Per-row, per-step counts ``[P, T]`` int64: ``needed = |S_t|``, ``hits`` (resident when needed)
    and ``fetched`` (blocks copied host -> device)."""

    needed: np.ndarray
    hits: np.ndarray
    fetched: np.ndarray


def simulate_cache(selected: np.ndarray, block_size: int, capacity: int, policy: str,
                   block_scores: Optional[np.ndarray] = None) -> CacheTrace:
    """Walk ``selected`` (bool ``[P, T, nb]``: P independent (layer, head) rows, ``S_t`` per step)
    through a cache of ``capacity`` blocks per row. ``block_scores`` ``[P, nb]`` for ``score``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {POLICIES}")
    P, T, nb = selected.shape
    widest = int(selected.sum(-1).max()) if selected.size else 0
    if policy != "previous" and capacity < widest:
        raise ValueError(f"cache capacity {capacity} blocks is below one step's selection ({widest} blocks); "
                         f"use a capacity >= the selection budget (topk)")
    if policy == "score" and (block_scores is None or block_scores.shape != (P, nb)):
        raise ValueError(f"policy 'score' needs block_scores of shape {(P, nb)}")
    cache = np.zeros((P, nb), dtype=bool)
    last_used = np.full((P, nb), -1, dtype=np.int64)
    rows = np.arange(P)
    needed = np.zeros((P, T), dtype=np.int64)
    hits = np.zeros((P, T), dtype=np.int64)
    for t in range(T):
        own = t // block_size
        cache[:, own] = True  # written on the device
        need = selected[:, t]
        needed[:, t] = need.sum(1)
        hits[:, t] = (need & cache).sum(1)
        if policy == "previous":
            cache = need.copy()
            cache[:, own] = True
            continue
        cache |= need
        last_used[need] = t
        last_used[rows, own] = t
        over = cache.sum(1) - capacity
        if (over > 0).any():
            cand = cache & ~need
            cand[:, own] = False
            prio = (block_scores if policy == "score" else last_used).astype(np.float64)
            prio = np.where(cand, prio, np.inf)
            rank = np.argsort(np.argsort(prio, axis=1, kind="stable"), axis=1, kind="stable")
            cache &= ~(cand & (rank < over[:, None]))
    return CacheTrace(needed=needed, hits=hits, fetched=needed - hits)


def pooled_block_scores(score: np.ndarray, block_size: int, kernel_size: int, kernel_stride: int) -> np.ndarray:
    """Query-agnostic block scores ``[H, nb]`` of token scores ``score [T, H]``, ranked as the
    NOSA selection ranks them: the mean over every full window of ``kernel_size`` tokens every
    ``kernel_stride``, then per block the max over the windows overlapping its tokens (``-inf``
    for a block no full window overlaps)."""
    T, H = score.shape
    nb = math.ceil(T / block_size)
    out = np.full((H, nb), -np.inf)
    if T < kernel_size:
        return out
    starts = np.arange(0, T - kernel_size + 1, kernel_stride)
    csum = np.concatenate([np.zeros((1, H)), np.cumsum(score.astype(np.float64), axis=0)])
    win = (csum[starts + kernel_size] - csum[starts]) / kernel_size  # [nw, H]
    for m in range(nb):
        lo, hi = m * block_size, (m + 1) * block_size
        over = (starts < hi) & (starts + kernel_size > lo)
        if over.any():
            out[:, m] = win[over].max(axis=0)
    return out


def dense_fetched_per_head(T: int, block_size: int, capacity: int) -> np.ndarray:
    """Blocks a dense layer streams per KV head at steps ``0..T-1``: its whole prefix less the
    ``capacity`` blocks pinned on the GPU, ``max(0, ceil((t+1)/block_size) - capacity)``."""
    blocks = np.arange(T) // block_size + 1
    return np.maximum(0, blocks - capacity)


def throughput_tokens_per_s(bytes_per_token: float, bandwidth_gb_s: float) -> Optional[float]:
    """Decode tokens/s that the host -> device bandwidth (GB/s, 1e9 bytes) allows; None when a
    step copies nothing (then the bus is not the limit)."""
    if bytes_per_token <= 0:
        return None
    return bandwidth_gb_s * 1e9 / bytes_per_token


def offload_summary(sparse_fetched: np.ndarray, dense_fetched: np.ndarray, geo: KVGeometry,
                    bandwidth_gb_s: float) -> dict:
    """Bytes per generated token and bandwidth-bound throughput of the model vs a dense model.

    ``sparse_fetched``: blocks the model fetches at each measured step, summed over every layer and
    KV head (dense layers of a mixed model included); ``dense_fetched``: the same for a dense model
    of the same shape. Both ``[steps]``.
    """
    nosa = float(sparse_fetched.mean()) * geo.block_bytes if sparse_fetched.size else 0.0
    dense = float(dense_fetched.mean()) * geo.block_bytes if dense_fetched.size else 0.0
    tput, tput_dense = throughput_tokens_per_s(nosa, bandwidth_gb_s), throughput_tokens_per_s(dense, bandwidth_gb_s)
    return {
        "bytes_per_token": nosa, "dense_bytes_per_token": dense,
        "decode_tokens_per_s": tput, "dense_decode_tokens_per_s": tput_dense,
        # nothing to copy for either: the same cost; nothing for the model only: not bus-bound (None)
        "throughput_ratio_vs_dense": (dense / nosa) if nosa > 0 else (1.0 if dense == 0 else None),
        "bandwidth_gb_s": bandwidth_gb_s, "block_bytes": geo.block_bytes,
    }
