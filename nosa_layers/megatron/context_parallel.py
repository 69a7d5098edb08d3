"""All-gather context parallelism of the NOSA layers (the scheme of megatron-core's ``cp_comm_type="all_gather"``).

Each rank of megatron-core's context-parallel group keeps the tokens of two chunks of every row (zigzag,
``nosa_layers.query_chunks.zigzag_chunks``: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``; megatron-core's
``get_batch_on_this_cp_rank``; a packed THD row is one row). Before attention the keys, values and the
eviction score/bias of the whole row are all-gathered in the group (:func:`gather_sequence`: all-gather
forward, reduce-scatter backward, so every rank gets back the gradient of its own tokens from all ranks'
queries); compressed keys, block selection and the sparse attention then run for the rank's queries
against the whole causal prefix (``nosa_attention(..., q_chunks=...)``). Everything position-dependent
uses the global token index: RoPE (per-document positions of packed rows), windows, sink, documents.

:class:`ContextParallelPlan`: the chunks, the gather order and the per-document pieces of one micro-batch
shape, built once and cached (packed rows: on the ``PackedSeqParams``, one host read of ``cu_seqlens``
per micro-batch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from nosa_layers.query_chunks import QueryChunks, zigzag_chunks, zigzag_permutation
from nosa_layers.rope.packed import document_positions
from nosa_layers.selection import document_spans


class _GatherSequence(torch.autograd.Function):
    """``x [s_local, ...]`` -> ``[s, ...]`` in global token order (all-gather over ``group``, then the
    rank-major rows put in place); backward: the gradient's rows in rank-major order, reduce-scattered
    (each rank receives the sum over all ranks of the gradient of its own tokens)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.group, ctx.order = group, order
        size = group.size()
        gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        return gathered.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank_major = grad.index_select(0, ctx.order).contiguous()
        out = torch.empty((rank_major.shape[0] // ctx.group.size(), *rank_major.shape[1:]), dtype=grad.dtype,
                          device=grad.device)
        dist.reduce_scatter_tensor(out, rank_major, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True)
class ContextParallelPlan:
    """How one micro-batch row of ``seq_len`` tokens is shared by the ``size`` ranks of a CP group.

    ``chunks``: this rank's query chunks; ``order`` int64 ``[seq_len]``: global token of each row of the
    rank-major concatenation; ``inverse``: its inverse permutation; ``pieces``: the chunks cut at the
    documents (``QueryChunks.pieces``, host values)."""

    group: object
    size: int
    rank: int
    seq_len: int
    chunks: QueryChunks
    order: Tensor
    inverse: Tensor
    pieces: tuple

    def gather(self, x: Tensor, grad: bool = True) -> Tensor:
        """The whole row of ``x [s_local, ...]`` (sequence first), differentiable (reduce-scatter backward)
        unless ``grad=False``."""
        if not grad or not torch.is_grad_enabled() or not x.requires_grad:
            with torch.no_grad():
                return _GatherSequence.forward(_NoCtx(), x, self.group, self.order, self.inverse)
        return _GatherSequence.apply(x, self.group, self.order, self.inverse)

    def local_rows(self, device) -> Tensor:
        """Global token index of this rank's tokens, int64 ``[s_local]``."""
        return self.chunks.rows(device)


class _NoCtx:
    """Stand-in ``ctx`` for a gather without autograd."""


_ROW_PLANS: dict = {}  # plans of unpacked rows: (group id, seq_len, device, None) -> (group, plan)


@functools.lru_cache(maxsize=16)
def _orders(seq_len: int, size: int, device: str) -> tuple[Tensor, Tensor]:
    order = zigzag_permutation(seq_len, size)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return order.to(device), inverse.to(device)


def cp_group_of(pg_collection) -> Optional[object]:
    """The context-parallel group of a megatron ``ProcessGroupCollection`` (``None`` when CP = 1)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None and group.size() > 1 else None


def _host_cu_seqlens(cu_seqlens: Tensor) -> list[int]:
    """Host values of ``cu_seqlens``: the ones the trainer handed to the kernels' block table when there are
    some (no device read), else one read."""
    try:
        from nosa_layers.ops.layout import host_values
    except ImportError:
        host_values = None
    values = host_values(cu_seqlens) if host_values is not None else None
    return values if values is not None else cu_seqlens.tolist()


def context_parallel_plan(group, local_len: int, device, packed_seq_params=None,
                          cu_seqlens: Optional[Tensor] = None) -> ContextParallelPlan:
    """The plan of a row whose local part holds ``local_len`` tokens (packed: ``cu_seqlens`` of the whole
    row, the plan cached on ``packed_seq_params``)."""
    size, rank = group.size(), group.rank()
    seq_len = local_len * size
    key = (id(group), seq_len, str(device), None if cu_seqlens is None else id(cu_seqlens))
    cache = packed_seq_params.__dict__.setdefault("_nosa_cp_plans", {}) if cu_seqlens is not None else _ROW_PLANS
    if key in cache:
        return cache[key][1]
    chunks = zigzag_chunks(seq_len, size, rank)
    order, inverse = _orders(seq_len, size, str(device))
    docs = [(0, seq_len)] if cu_seqlens is None else document_spans(
        torch.tensor(_host_cu_seqlens(cu_seqlens)), seq_len)
    plan = ContextParallelPlan(group, size, rank, seq_len, chunks, order, inverse, tuple(chunks.pieces(docs)))
    if cu_seqlens is None and len(cache) >= 8:
        cache.clear()
    cache[key] = (cu_seqlens if cu_seqlens is not None else group, plan)  # keeps it alive: its id stays its own
    return plan


def local_document_positions(plan: ContextParallelPlan, cu_seqlens: Tensor) -> Tensor:
    """Position of every local token of a packed row within its document, int64 ``[s_local]`` (device)."""
    return document_positions(cu_seqlens, plan.seq_len)[plan.local_rows(cu_seqlens.device)]
