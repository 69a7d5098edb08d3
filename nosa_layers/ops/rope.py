"""Fused rotary position embedding (Triton): one kernel forward, one kernel backward.

Semantics are those of :func:`rope_reference`, which is megatron-core's unfused, non-interleaved
``_apply_rotary_pos_emb_bshd`` with the cos / sin already scaled (LongRoPE's attention factor) and
cast to the input dtype: ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
cat(-x2, x1)``, every product and the sum rounded to the input dtype as PyTorch's elementwise ops
round them, so the output and the gradient equal the unfused path's bit for bit (16-bit inputs; fp32
may differ by a fused multiply-add). megatron's path makes about six passes over ``x`` each way (two
products, the rotation's ``neg`` and ``cat``, the sum, the final ``cat``); this reads ``x`` (or the
output gradient) once and writes once, and keeps only the small cos / sin tables for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import check_device, interpreting


def rope_tables(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin`` ``[P, R]`` in ``dtype`` from megatron's angles ``freqs [P, 1, 1, R]`` (or ``[P, R]``), fp32:
    ``(cos(freqs) * mscale).to(dtype)``, exactly as megatron scales and casts them."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    return (torch.cos(f) * mscale).to(dtype).contiguous(), (torch.sin(f) * mscale).to(dtype).contiguous()


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None) -> Tensor:
    """``x [S, B, H, D]`` rotated at rows ``positions [S]`` (default ``arange(S)``) of ``cos`` / ``sin``
    ``[P, D]`` (``rope_tables``), in ``x.dtype``: megatron's unfused formula."""
    c = cos[:x.shape[0]] if positions is None else cos[positions]
    s = sin[:x.shape[0]] if positions is None else sin[positions]
    c, s = c[:, None, None, :], s[:, None, None, :]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


@triton.jit
def _rope_kernel(X, COS, SIN, POS, OUT, B, H, s_xs, s_xb, s_xh, s_os, s_ob, s_oh, s_p, SIGN: tl.constexpr,
                 HAS_POS: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr):
    """One (token, sequence) row per program, all ``H`` heads: ``out1 = x1 c1 - x2 s1``, ``out2 = x2 c2 + x1 s2``
    (``SIGN = 1``, the forward) or the transposed rotation ``dx1 = g1 c1 + g2 s2``, ``dx2 = g2 c2 - g1 s1``
    (``SIGN = -1``, the backward); each product and the sum rounded to ``X``'s dtype."""
    row = tl.program_id(0)
    s_idx = (row // B).to(tl.int64)
    b_idx = (row % B).to(tl.int64)
    if HAS_POS:
        p = tl.load(POS + s_idx).to(tl.int64)
    else:
        p = s_idx
    offs_h = tl.arange(0, BH)
    offs_d = tl.arange(0, HALF)
    m = (offs_h < H)[:, None]
    xrow = X + s_idx * s_xs + b_idx * s_xb + offs_h[:, None].to(tl.int64) * s_xh + offs_d[None, :]
    x1 = tl.load(xrow, mask=m, other=0.0)
    x2 = tl.load(xrow + HALF, mask=m, other=0.0)
    c1 = tl.load(COS + p * s_p + offs_d)[None, :]
    c2 = tl.load(COS + p * s_p + HALF + offs_d)[None, :]
    s1 = tl.load(SIN + p * s_p + offs_d)[None, :]
    s2 = tl.load(SIN + p * s_p + HALF + offs_d)[None, :]
    dt = X.dtype.element_ty
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
    if SIGN == 1:
        b1 = -(x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
    else:
        b1 = (x2.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
        b2 = -(x1.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
    orow = OUT + s_idx * s_os + b_idx * s_ob + offs_h[:, None].to(tl.int64) * s_oh + offs_d[None, :]
    tl.store(orow, (a1 + b1).to(OUT.dtype.element_ty), mask=m)
    tl.store(orow + HALF, (a2 + b2).to(OUT.dtype.element_ty), mask=m)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, sign: int) -> Tensor:
    S, B, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    if out.numel():
        pos = positions if positions is not None else cos  # a stand-in pointer, never read
        _rope_kernel[(S * B,)](x, cos, sin, pos, out, B, H, *x.stride()[:3], *out.stride()[:3], cos.stride(0),
                               SIGN=sign, HAS_POS=positions is not None, HALF=D // 2,
                               BH=triton.next_power_of_2(H), num_warps=1 if interpreting() else 4,
                               enable_fp_fusion=False)  # no multiply-add: PyTorch rounds each product
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> Tensor:
        ctx.save_for_backward(cos, sin, positions)
        return _launch(x, cos, sin, positions, 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin, positions = ctx.saved_tensors
        return _launch(grad, cos, sin, positions, -1), None, None, None


def fused_rope(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None) -> Tensor:
    """:func:`rope_reference` in one kernel each way: ``x [S, B, H, D]`` (16-bit or fp32, unit last
    stride), ``cos`` / ``sin`` ``[P, D]`` in ``x.dtype`` (``rope_tables``), ``positions [S]`` integer rows of
    the tables (default ``arange(S)``, then ``P >= S``); returns a contiguous ``[S, B, H, D]``,
    differentiable in ``x``."""
    check_device(x, cos, sin, positions)
    if x.dim() != 4:
        raise ValueError(f"fused_rope: x must be [S, B, H, D], got {tuple(x.shape)}")
    S, _, _, D = x.shape
    if D % 2 or D // 2 & (D // 2 - 1):
        raise ValueError(f"fused_rope: head dim must be twice a power of two, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != D or t.stride(1) != 1 or t.dtype != x.dtype:
            raise ValueError(f"fused_rope: {name} must be [P, {D}] {x.dtype} with a unit last stride, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError("fused_rope: cos and sin must have the same shape and strides")
    if positions is None and cos.shape[0] < S:
        raise ValueError(f"fused_rope: {S} tokens but only {cos.shape[0]} table rows")
    if positions is not None and (positions.shape != (S,) or positions.dtype.is_floating_point):
        raise ValueError(f"fused_rope: positions must be [{S}] integers, got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    return _FusedRope.apply(x, cos, sin, positions)
