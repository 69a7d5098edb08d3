"""Causal dense attention of packed documents in one launch (CUDA): the FlashAttention-2
variable-length kernels that PyTorch ships, with GQA. No attention across documents, no loop over
documents, no host sync (the longest document comes with the batch: ``PackedSeqParams.max_seqlen_q``).
The per-document SDPA loop of ``DenseCoreAttention`` is the reference and the CPU path."""

from __future__ import annotations

import torch
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
