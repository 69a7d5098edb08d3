"""Where the query and KV heads of one attention layer live under tensor parallelism.

megatron-core splits KV heads over TP ranks when ``tp <= Hkv`` and replicates them when
``tp > Hkv`` (each rank then holds one KV head and a slice of its query group). NOSA needs two
things across ranks: the eviction head reads the values of ALL KV heads, and the query-aware
selection sums over ALL query heads of a group. The helpers here gather exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from torch import Tensor


@dataclass(frozen=True)
class HeadLayout:
    """Head placement of one TP rank (``tp`` must divide ``Hq`` and divide or be a multiple of ``Hkv``)."""

    tp_size: int
    tp_rank: int
    num_q_heads: int
    num_kv_heads: int

    @property
    def replication(self) -> int:
        """How many TP ranks share one KV head (1 when KV heads are split, not replicated)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def q_per_rank(self) -> int:
        return self.num_q_heads // self.tp_size

    @property
    def kv_start(self) -> int:
        """Global index of this rank's first KV head."""
        return (self.tp_rank // self.replication) * self.kv_per_rank

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def group_spans_ranks(self) -> bool:
        """True when the query heads of a KV group are spread over several TP ranks."""
        return self.tp_size > self.num_kv_heads

    @property
    def local_group_offset(self) -> int:
        """Offset of this rank's query heads inside its KV group (0 unless the group spans ranks)."""
        return (self.tp_rank % self.replication) * self.q_per_rank if self.group_spans_ranks else 0


def tp_head_layout(pg_collection, num_q_heads: int, num_kv_heads: int):
    """``(tp group, HeadLayout)`` of this rank from a megatron ``ProcessGroupCollection``."""
    group = pg_collection.tp
    size = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    return group, HeadLayout(size, rank, num_q_heads, num_kv_heads)


def gather_heads(x: Tensor, layout: HeadLayout, group, kv: bool) -> Tensor:
    """All heads of ``x [s, b, h_local, D]`` on every TP rank, in global head order.

    Forward all-gather, backward keeps this rank's slice (megatron's
    ``gather_from_tensor_model_parallel_region``): correct when the gradient reaching the gathered
    tensor is the same on every rank (use :func:`replicate_grad` on the result of the computation
    that consumes it). For replicated KV heads (``kv=True`` and ``tp > Hkv``) one copy per KV head
    is kept.
    """
    if layout.tp_size == 1:
        return x
    s, b, h, d = x.shape
    full = gather_from_tensor_model_parallel_region(x.reshape(s, b, h * d), group=group)
    full = full.view(s, b, layout.tp_size * h, d)
    if kv and layout.replication > 1:
        full = full[:, :, :: layout.replication]
    return full


def replicate_grad(x: Tensor, layout: HeadLayout, group) -> Tensor:
    """Identity forward; backward all-reduces the gradient over TP.

    Applied to an output computed identically on every rank from gathered inputs (the eviction
    score of all KV heads), of which each rank only uses its own heads: the all-reduce makes the
    gradient the full one on every rank, so replicated parameters get identical, complete grads.
    """
    if layout.tp_size == 1:
        return x
    return copy_to_tensor_model_parallel_region(x, group=group)


@torch.no_grad()
def gather_group_queries(q: Tensor, layout: HeadLayout, group) -> Tensor:
    """The full query group of this rank's KV head, ``q [B, T, G_local, D] -> [B, T, G, D]`` (no grad).

    Only needed when the group spans ranks; the rank-ordered all-gather reproduces the TP=1 head
    order, so the group-summed selection scores are summed in the same order as at TP=1.
    """
    if not layout.group_spans_ranks:
        return q
    b, t, h, d = q.shape
    full = gather_from_tensor_model_parallel_region(q.reshape(b, t, h * d).contiguous(), group=group)
    full = full.view(b, t, layout.tp_size * h, d)
    g0 = (layout.tp_rank // layout.replication) * layout.group_size
    return full[:, :, g0 : g0 + layout.group_size]
