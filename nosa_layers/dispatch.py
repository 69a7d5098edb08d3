"""The one entry point of NOSA attention and selection: chooses the backend, nothing else.

Backends: ``reference`` (pure PyTorch in ``selection.py`` / ``reference.py``, CPU/GPU, fp32/fp64, the
ground truth), ``triton`` (the kernels in ``nosa_layers.ops``), ``auto`` (Triton on CUDA when
available, else reference). The environment variable ``NOSA_ATTN_BACKEND`` overrides ``auto`` for
debugging. Its place between the kernels and the layers: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from nosa_layers.config import BIAS_FROM_SCORE, NOSAConfig
from nosa_layers.query_chunks import QueryChunks, full_chunks
from nosa_layers.reference import block_sparse_attention
from nosa_layers.selection import check_inputs, document_spans, select_blocks_reference

try:  # the Triton backend needs triton (no GPU needed to import it)
    from nosa_layers import ops
except ImportError:
    ops = None

BACKENDS = ("reference", "triton", "auto")


def resolve_backend(backend: str, device: torch.device, head_dim: int | None = None,
                    block_size: int | None = None) -> str:
    """Map ``auto`` to a concrete backend for tensors on ``device`` (the reference for a head dim /
    block size the kernels do not cover, when given)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown NOSA backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = os.environ.get("NOSA_ATTN_BACKEND", "auto")
        if backend == "auto":
            fits = ops is not None and (head_dim is None or ops.supports_attention(head_dim, block_size or 64))
            return "triton" if device.type == "cuda" and fits else "reference"
        if backend not in ("reference", "triton"):
            raise ValueError(f"NOSA_ATTN_BACKEND={backend!r}; use reference or triton")
    if backend == "triton" and ops is None:
        raise RuntimeError("NOSA backend 'triton' is not available (triton is not installed); "
                           "use backend='reference'")
    return backend


@torch.no_grad()
def select_blocks(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                  cu_seqlens: Tensor | None = None, softmax_scale: float | None = None,
                  backend: str = "reference", q_chunks: QueryChunks | None = None) -> Tensor:
    """Causal NOSA block selection of every query token: bool ``[B, Hkv, T, nb]``.

    Shapes and semantics: ``selection.select_blocks_reference``. ``backend="triton"`` runs the GPU
    kernels (same semantics and tie-breaking; block scores from tensor-core products, so rows whose
    block scores are within rounding of a tie may differ); geometries the kernels do not cover
    fall back to the reference. ``q_chunks``: q holds only those query rows of the ``T``-token row
    (context parallelism); the result is ``[B, Hkv, Tq, nb]``, each row as in the full-row call.
    """
    check_inputs(q, k, evict_score, cu_seqlens, q_chunks)
    if resolve_backend(backend, q.device) == "triton" and ops.supports_selection(cfg, q.shape[-1]):
        return ops.select_blocks_triton(q, k, evict_score, cfg, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                                        q_chunks=q_chunks)
    return select_blocks_reference(q, k, evict_score, cfg, cu_seqlens, softmax_scale, q_chunks=q_chunks)


@dataclass
class PreparedSelection:
    """A selection computed once (no grad) and reused, e.g. by the recompute of a checkpointed
    attention: ``selected`` bool ``[B, Hkv, T, nb]``; ``index``: what the Triton backend builds
    from it (its block-sparse index), ``None`` for the reference backend."""

    selected: Tensor
    index: object | None = None


@torch.no_grad()
def prepare_selection(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                      cu_seqlens: Tensor | None = None, backend: str = "reference",
                      softmax_scale: float | None = None, selected: Tensor | None = None,
                      attn_heads: int | None = None, q_chunks: QueryChunks | None = None) -> PreparedSelection:
    """Selection (``select_blocks``, or the given ``selected``) plus the backend's index built from it,
    for ``nosa_attention(..., selected=<this>)``. Shapes as in ``nosa_attention``; ``q`` may hold
    more query heads than the attention call (a whole KV group gathered over tensor parallelism):
    ``attn_heads`` is then the attention's query-head count (it shapes the kernels' query tiles)."""
    backend = resolve_backend(backend, q.device, q.shape[-1], cfg.block_size)
    score = None if evict_score is None else evict_score.detach()
    given = selected is not None  # a caller's selection may exceed the topk budget per row
    if selected is None:
        selected = select_blocks(q.detach(), k.detach(), score, cfg, cu_seqlens, softmax_scale, backend=backend,
                                 q_chunks=q_chunks)
    if backend != "triton":
        return PreparedSelection(selected)
    index = ops.build_sparse_index(selected, cfg, k.shape[1], cu_seqlens, num_q_heads=attn_heads or q.shape[2],
                                   row_budget=None if given else cfg.topk, q=q, q_chunks=q_chunks)
    return PreparedSelection(selected, index)


def nosa_attention(q: Tensor, k: Tensor, v: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                   cu_seqlens: Tensor | None = None, backend: str = "reference",
                   attn_bias: Tensor | None | str = BIAS_FROM_SCORE,
                   softmax_scale: float | None = None,
                   selected: Tensor | PreparedSelection | None = None,
                   q_chunks: QueryChunks | None = None) -> Tensor:
    """NOSA sparse attention (training / prefill path).

    Args:
        q: ``[B, T, Hq, D]`` queries after RoPE.
        k, v: ``[B, T, Hkv, D]`` keys after RoPE, values.
        evict_score: ``[B, T, Hkv]`` query-agnostic eviction score (ranked by the selection), or
            ``None`` for query-aware-only selection (InfLLM-V2).
        cfg: selection geometry and budget.
        cu_seqlens: ``[n_docs + 1]`` int document offsets for packed sequences (B must be 1):
            no attention, window or block crosses a boundary; positions restart per document.
        backend: ``reference`` | ``triton`` | ``auto``.
        attn_bias: ``[B, T, Hkv]`` additive logit bias at full scale; default: ``evict_score``
            (ED-DMA). ``None`` for no bias.
        softmax_scale: defaults to ``1/sqrt(D)``.
        selected: optional precomputed ``select_blocks`` result ``[B, Hkv, T, nb]`` (e.g. selected
            once for a KV group whose query heads span tensor-parallel ranks), or a
            ``prepare_selection`` result (the selection plus the backend's index); skips selection.
        q_chunks: q holds only the query rows of these chunks of the ``T``-token row (context
            parallelism: k, v, scores and ``cu_seqlens`` are the whole row); positions, causality and
            documents follow the global token index, so every output row equals the full-row call's.

    Returns ``[B, Tq, Hq, D]`` in q's dtype (``Tq = T`` without ``q_chunks``); differentiable in q, k, v
    and the bias. The selection itself is not differentiable (it runs on detached tensors).
    """
    check_inputs(q, k, evict_score, cu_seqlens, q_chunks)
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have the shape of k {tuple(k.shape)}")
    bias = evict_score if isinstance(attn_bias, str) and attn_bias == BIAS_FROM_SCORE else attn_bias
    if bias is not None and bias.shape != k.shape[:3]:
        raise ValueError(f"attn_bias must be [B, T, Hkv] = {tuple(k.shape[:3])}, got {tuple(bias.shape)}")
    backend = resolve_backend(backend, q.device, q.shape[-1], cfg.block_size)
    if not isinstance(selected, PreparedSelection):
        if selected is not None and selected.shape[:3] != (q.shape[0], k.shape[2], q.shape[1]):
            raise ValueError(f"selected must be [B, Hkv, T, nb] with B, Hkv, T = "
                             f"{(q.shape[0], k.shape[2], q.shape[1])}, got {tuple(selected.shape)}")
        selected = prepare_selection(q, k, evict_score, cfg, cu_seqlens, backend, softmax_scale, selected,
                                     q_chunks=q_chunks)

    if backend == "triton":
        index = selected.index
        if index is None:  # a reference-backend preparation handed to the Triton backend
            index = ops.build_sparse_index(selected.selected, cfg, k.shape[1], cu_seqlens, num_q_heads=q.shape[2],
                                           q=q, q_chunks=q_chunks)
        return ops.sparse_attention(q, k, v, index, bias=bias, softmax_scale=softmax_scale)

    sel = selected.selected
    outs = []
    for s, e, lo, hi, row in (q_chunks or full_chunks(k.shape[1])).pieces(document_spans(cu_seqlens, k.shape[1])):
        rows = slice(row, row + hi - lo)
        outs.append(block_sparse_attention(
            q[:, rows], k[:, s:hi], v[:, s:hi], sel[:, :, rows], cfg.block_size,
            bias=None if bias is None else bias[:, s:hi], softmax_scale=softmax_scale, q_offset=lo - s))
    if not outs:
        return q.new_zeros(q.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def kernel_plan(num_q_heads: int, num_kv_heads: int, head_dim: int, cfg: NOSAConfig, dtype: torch.dtype,
                device: torch.device, backend: str = "auto") -> list[str]:
    """What NOSA attention of this shape runs on ``device``, decided before any step: one line per
    fast path it does not take (the kernel that serves instead and why), and one on the padding of query
    tiles for a KV group that is not a power of two; ``[]`` where every fast path runs as designed."""
    backend = resolve_backend(backend, device, head_dim, cfg.block_size)
    if device.type != "cuda":
        return []
    if backend != "triton":
        why = "triton is not installed" if ops is None else f"head dim {head_dim} / block {cfg.block_size}"
        return [f"NOSA kernels: the PyTorch reference runs attention and selection ({why}; the kernels take "
                f"head dims {ops.HEAD_DIMS if ops else '16..256'} and 16/32/64-token blocks): slow, for checks only"]
    notes = []
    if not ops.supports_selection(cfg, head_dim):
        notes.append(f"NOSA kernels: block selection runs the PyTorch reference (no kernel for head dim {head_dim}, "
                     f"block/stride/kernel {cfg.block_size}/{cfg.kernel_stride}/{cfg.kernel_size})")
    return notes + ops.attention_plan(num_q_heads // num_kv_heads, head_dim, cfg.block_size, dtype, device)


def host_cu_seqlens(cu_seqlens: Tensor) -> list[int]:
    """Host values of ``cu_seqlens``: those the trainer handed to the kernels' block table when there
    are some (no device read), else one read."""
    try:
        from nosa_layers.ops.layout import host_values
    except ImportError:  # no Triton: nothing was handed over
        return cu_seqlens.tolist()
    values = host_values(cu_seqlens)
    return values if values is not None else cu_seqlens.tolist()
