"""Causal dense attention of packed documents in one launch (CUDA): the FlashAttention-2
variable-length kernels that PyTorch ships, with GQA. No attention across documents, no loop over
documents, no host sync (the longest document comes with the batch: ``PackedSeqParams.max_seqlen_q``).
The per-document SDPA loop of ``DenseCoreAttention`` is the reference and the CPU path.

Context parallelism: :func:`chunked_varlen_attention` (CUDA) runs a rank's query chunks against the
gathered keys in one call; :func:`pieces_attention` is its reference and the CPU path."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def varlen_supported(q: Tensor, k: Tensor) -> bool:
    """Whether :func:`causal_varlen_attention` takes these tensors (CUDA, fp16 / bf16, head dim a
    multiple of 8 up to 256, query heads a multiple of the KV heads)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and q.shape[-2] % k.shape[-2] == 0)


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, longest, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, 0.0, True, rng, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def causal_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                            softmax_scale: float | None = None) -> Tensor:
    """q ``[t, Hq, D]``, k/v ``[t, Hkv, D]`` of documents packed at ``cu_seqlens`` ``[docs + 1]``, the
    longest at most ``max_seqlen`` tokens: causal attention inside each document, ``[t, Hq, D]``;
    differentiable in q, k, v."""
    if not varlen_supported(q, k):
        raise ValueError("causal_varlen_attention needs CUDA fp16/bf16 tensors, head dim a multiple of 8 "
                         f"up to 256 and query heads a multiple of KV heads; got {q.dtype} on {q.device}, "
                         f"shapes {tuple(q.shape)} / {tuple(k.shape)}")
    cu = cu_seqlens.to(torch.int32)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu, int(max_seqlen), softmax_scale)


def pieces_attention(q: Tensor, k: Tensor, v: Tensor, pieces, scale: float | None = None) -> Tensor:
    """Causal attention of the query rows of ``pieces`` (``QueryChunks.pieces``: chunks cut at the documents)
    against their documents' keys: q ``[b, h, Tq, D]``, k/v ``[b, hk, T, D]`` -> ``[b, h, Tq, D]`` (one SDPA
    call per piece; query ``i`` of a piece starting at token ``lo`` sees the keys up to ``lo + i``)."""
    outs = []
    for s, _e, lo, hi, row in pieces:
        n, nk = hi - lo, hi - s
        mask = torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, row:row + n], k[:, :, s:hi], v[:, :, s:hi], attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class _FlashChunks(torch.autograd.Function):
    """Variable-length FlashAttention with query pieces against key pieces of their own lengths: causal
    bottom-right aligned (query ``i`` of a piece sees its keys up to ``i + kv_len - q_len``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def _piece_tables(plan, rows: int, device) -> tuple:
    """``(key_index, cu_q, cu_k, max_q, max_k)`` of ``rows`` batch rows of the plan's pieces: key rows of
    each piece (its document's prefix up to its last query) in the flattened ``[rows * T]`` keys."""
    cache = plan.__dict__.setdefault("_varlen_tables", {})
    key = (rows, str(device))
    if key not in cache:
        T = plan.seq_len
        keys, cu_q, cu_k = [], [0], [0]
        for b in range(rows):
            for s, _e, lo, hi, _row in plan.pieces:
                keys.append(torch.arange(b * T + s, b * T + hi))
                cu_q.append(cu_q[-1] + hi - lo)
                cu_k.append(cu_k[-1] + hi - s)
        lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
        lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
        as_dev = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        cache[key] = (torch.cat(keys).to(device), as_dev(cu_q), as_dev(cu_k), max(lens_q), max(lens_k))
    return cache[key]


def chunked_varlen_attention(q: Tensor, k: Tensor, v: Tensor, plan, softmax_scale: float | None = None) -> Tensor:
    """Context-parallel dense attention on a GPU: q ``[b, s_local, Hq, D]`` (this rank's chunks, in order)
    against the whole rows k/v ``[b, T, Hkv, D]``; each piece of ``plan.pieces`` (a chunk cut at the
    documents) attends causally to its document's prefix, in one variable-length call (the keys of the
    pieces are copied side by side; their gradients are summed back). Returns ``[b, s_local, Hq, D]``."""
    b, s, hq, d = q.shape
    index, cu_q, cu_k, max_q, max_k = _piece_tables(plan, b, q.device)
    kk = k.reshape(-1, *k.shape[2:]).index_select(0, index)
    vv = v.reshape(-1, *v.shape[2:]).index_select(0, index)
    out = _FlashChunks.apply(q.reshape(b * s, hq, d).contiguous(), kk, vv, cu_q, cu_k, max_q, max_k,
                             softmax_scale)
    return out.view(b, s, hq, d)
