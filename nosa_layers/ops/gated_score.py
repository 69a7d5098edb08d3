"""Fused value-gated eviction score (Triton): ``s = A * softplus(v_row @ W^T + b)`` in one kernel
forward and two backward (per-tile gradients + one ordered reduction of the parameter partials),
instead of the reference's six launches forward (three casts, the product, softplus, the scale)
and about twelve backward.

Semantics: :func:`nosa_layers.eviction.value_gated_score` (ED-DMA / DMA / S-DMA's ``gated_score``):
``v [B, T, Hkv, D]`` (any float dtype), ``W [Hkv, Hkv * D]`` (the row of all KV heads, head-major),
``b [Hkv]`` or ``None``, ``A [Hkv]``; the score ``[B, T, Hkv]`` is fp32 and everything is computed
in fp32. Products are summed in a different order than cuBLAS, so results equal the reference to
fp32 rounding, not bit for bit. Deterministic: the parameter gradients are reduced over the
per-tile partials in a fixed order. The forward keeps the pre-activation ``z [B, T, Hkv]`` (fp32)
and the values (a compact copy when ``v`` is a view of a larger buffer) for the backward.

Every product is a 2-D tile ``[ROWS, D]`` reduced over one axis, one (input head, output head) pair
at a time: a first version that broadcast ``[ROWS, heads, D]`` tiles and reduced them compiled to a
wrong ``dv`` on an H200 (Triton 3.6, 2 and 4 KV heads) while the interpreter was right, and a
version with fp32 ``tl.dot`` tiles (exact, ``ieee``) took about 0.3 ms per backward at 16K tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch import Tensor

from ._common import interpreting, kernels_run_on


def rows_per_program(head_dim: int) -> int:
    """Tokens per program: 64, or 32 at head dim 256 (the backward holds two ``[rows, D]`` fp32 tiles,
    the values and their gradient, in registers)."""
    return 64 if head_dim <= 128 else 32


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """``exp`` in fp32: libdevice's (correctly rounded) when compiled; ``tl.exp`` (numpy's) under the
    interpreter, which has no libdevice. ``tl.exp``'s fast ``ex2.approx`` loses about 20 ulp far in
    the left tail, where the score ``~ exp(z)`` still ranks blocks."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _softplus(z, LIBDEVICE: tl.constexpr):
    """torch's softplus (beta 1, threshold 20) in fp32: ``max(z, 0) + log1p(exp(-|z|))``, with log1p
    evaluated as ``log(w) * u / (w - 1)``, ``w = 1 + u`` (exact to a few ulps for small ``u``)."""
    u = _exp(-tl.abs(z), LIBDEVICE)
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))
    return tl.where(z > 20.0, z, tl.maximum(z, 0.0) + log1p)


@triton.jit(do_not_specialize=("T",))
def _gated_score_fwd_kernel(V, W, Bias, A, S, Z, VC, T, s_vb, s_vt, s_vh, s_sb, s_st,
                            HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                            COPY_V: tl.constexpr, ROWS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (tile, b): ``ROWS`` tokens of row ``b``; ``S``/``Z`` ``[B, T, HKV]`` (strides s_sb, s_st).
    ``z[:, j] = sum_h v_h [ROWS, D] . W[j, h*D:(h+1)*D]``: one row reduction per (h, j), fp32.
    ``COPY_V``: also write the values it reads to the contiguous ``VC [B, T, HKV, D]``."""
    tile, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = tile * ROWS + tl.arange(0, ROWS)
    tm = t < T
    jj = tl.arange(0, HP)  # output head (heads >= HKV are masked)
    jm = jj < HKV
    d = tl.arange(0, D)
    z = tl.zeros([ROWS, HP], dtype=tl.float32)
    for h in range(HKV):  # input head: columns h*D .. h*D+D of the value row
        v = tl.load(V + b * s_vb + t[:, None].to(tl.int64) * s_vt + h * s_vh + d[None, :], mask=tm[:, None],
                    other=0.0)
        if COPY_V:
            tl.store(VC + (b * T + t[:, None].to(tl.int64)) * (HKV * D) + h * D + d[None, :], v, mask=tm[:, None])
        v = v.to(tl.float32)
        for j in range(HKV):
            w = tl.load(W + j * (HKV * D) + h * D + d).to(tl.float32)
            z += tl.where(jj[None, :] == j, tl.sum(v * w[None, :], axis=1)[:, None], 0.0)
    if HAS_BIAS:
        z += tl.load(Bias + jj, mask=jm, other=0.0).to(tl.float32)[None, :]
    a = tl.load(A + jj, mask=jm, other=0.0).to(tl.float32)
    s = a[None, :] * _softplus(z, LIBDEVICE)
    off = b * s_sb + t[:, None].to(tl.int64) * s_st + jj[None, :]
    m = tm[:, None] & jm[None, :]
    tl.store(S + off, s, mask=m)
    tl.store(Z + off, z, mask=m)


@triton.jit(do_not_specialize=("T", "n_tiles"))
def _gated_score_bwd_kernel(V, W, A, Z, G, DV, P, T, n_tiles, s_vb, s_vt, s_vh, s_dvb, s_dvt, s_dvh,
                            s_zb, s_zt, s_gb, s_gt, s_gh,
                            HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NEED_DV: tl.constexpr,
                            ROWS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (tile, b): ``dv`` of its tokens and its fp32 partials ``P[b * n_tiles + tile]``:
    ``[HKV, HKV * D]`` of dW, then ``[HKV]`` of db and ``[HKV]`` of dA (row length ``HKV * (HKV*D + 2)``).
    Per (h, j): ``dW[j, h*D:] = dz[:, j] . v_h`` (a column reduction) and ``dv_h += dz[:, j] W[j, h*D:]``."""
    tile, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = tile * ROWS + tl.arange(0, ROWS)
    tm = t < T
    jj = tl.arange(0, HP)
    jm = jj < HKV
    d = tl.arange(0, D)
    m = tm[:, None] & jm[None, :]
    z = tl.load(Z + b * s_zb + t[:, None].to(tl.int64) * s_zt + jj[None, :], mask=m, other=0.0)
    g = tl.load(G + b * s_gb + t[:, None].to(tl.int64) * s_gt + jj[None, :] * s_gh, mask=m, other=0.0)
    a = tl.load(A + jj, mask=jm, other=0.0).to(tl.float32)
    sig = tl.where(z > 20.0, 1.0, 1.0 / (1.0 + _exp(-z, LIBDEVICE)))  # d softplus / dz (threshold as torch)
    dz = g * a[None, :] * sig  # [ROWS, HP], 0 on masked rows / heads
    row = P + (b * n_tiles + tile) * (HKV * (HKV * D + 2))
    for h in range(HKV):
        v = tl.load(V + b * s_vb + t[:, None].to(tl.int64) * s_vt + h * s_vh + d[None, :], mask=tm[:, None],
                    other=0.0).to(tl.float32)
        dv = tl.zeros([ROWS, D], dtype=tl.float32)
        for j in range(HKV):
            dz_j = tl.sum(tl.where(jj[None, :] == j, dz, 0.0), axis=1)  # [ROWS]
            tl.store(row + j * (HKV * D) + h * D + d, tl.sum(dz_j[:, None] * v, axis=0))
            if NEED_DV:
                dv += dz_j[:, None] * tl.load(W + j * (HKV * D) + h * D + d).to(tl.float32)[None, :]
        if NEED_DV:
            tl.store(DV + b * s_dvb + t[:, None].to(tl.int64) * s_dvt + h * s_dvh + d[None, :],
                     dv.to(DV.dtype.element_ty), mask=tm[:, None])
    tl.store(row + HKV * (HKV * D) + jj, tl.sum(dz, axis=0), mask=jm)
    tl.store(row + HKV * (HKV * D + 1) + jj, tl.sum(g * _softplus(z, LIBDEVICE), axis=0), mask=jm)


@triton.jit(do_not_specialize=("n_parts",))
def _partials_reduce_kernel(P, DW, DB, DA, n_parts, HKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                            COLS: tl.constexpr):
    """Sum the partial rows of ``P`` in order (deterministic) for ``COLS`` columns per program and
    write them, cast, to ``DW [HKV, HKV*D]``, ``DB [HKV]`` and ``DA [HKV]``."""
    width = HKV * (HKV * D + 2)
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cm = c < width
    acc = tl.zeros([COLS], dtype=tl.float32)
    ptr = P + c
    for _ in range(0, n_parts):
        acc += tl.load(ptr, mask=cm, other=0.0)
        ptr += width
    tl.store(DW + c, acc.to(DW.dtype.element_ty), mask=cm & (c < HKV * (HKV * D)))
    k = c - HKV * (HKV * D)
    if HAS_BIAS:
        tl.store(DB + k, acc.to(DB.dtype.element_ty), mask=cm & (k >= 0) & (k < HKV))
    k = k - HKV
    tl.store(DA + k, acc.to(DA.dtype.element_ty), mask=cm & (k >= 0) & (k < HKV))


def _warps() -> int:
    return 1 if interpreting() else 4


class _FusedGatedScore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor) -> Tensor:
        B, T, Hkv, D = v.shape
        hp = triton.next_power_of_2(Hkv)
        s = torch.empty(B, T, Hkv, dtype=torch.float32, device=v.device)
        z = torch.empty_like(s)
        w, a = weight.contiguous(), A.contiguous()
        # A view of a larger buffer (megatron's fused QKV projection) is saved as a compact copy the
        # forward writes on the way: saving the view would keep the whole buffer alive until backward.
        copy_v = v.untyped_storage().nbytes() > v.numel() * v.element_size()
        saved_v = torch.empty(v.shape, dtype=v.dtype, device=v.device) if copy_v else v
        if B * T:
            rows = rows_per_program(D)
            _gated_score_fwd_kernel[(triton.cdiv(T, rows), B)](
                v, w, a if bias is None else bias.contiguous(), a, s, z, saved_v, T, *v.stride()[:3],
                *s.stride()[:2], HKV=Hkv, HP=hp, D=D, HAS_BIAS=bias is not None, COPY_V=copy_v, ROWS=rows,
                LIBDEVICE=not interpreting(), num_warps=_warps())
        ctx.save_for_backward(saved_v, w, a, z)
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return s

    @staticmethod
    def backward(ctx, g: Tensor):
        v, w, a, z = ctx.saved_tensors
        B, T, Hkv, D = v.shape
        hp = triton.next_power_of_2(Hkv)
        need_dv = ctx.needs_input_grad[0]
        dv = torch.empty_like(v) if need_dv else None
        dw, da = torch.empty_like(w), torch.empty_like(a)
        db = torch.empty(Hkv, dtype=ctx.bias_dtype, device=v.device) if ctx.has_bias else None
        rows = rows_per_program(D)
        n_tiles = triton.cdiv(T, rows)
        width = Hkv * (Hkv * D + 2)
        parts = torch.empty(max(B * n_tiles, 1), width, dtype=torch.float32, device=v.device)
        if B * T:
            out = v if dv is None else dv
            _gated_score_bwd_kernel[(n_tiles, B)](
                v, w, a, z, g, out, parts, T, n_tiles, *v.stride()[:3], *out.stride()[:3], *z.stride()[:2],
                *g.stride(), HKV=Hkv, HP=hp, D=D, NEED_DV=need_dv, ROWS=rows, LIBDEVICE=not interpreting(),
                num_warps=_warps())
        else:
            parts.zero_()
        cols = 256
        _partials_reduce_kernel[(triton.cdiv(width, cols),)](
            parts, dw, da if db is None else db, da, parts.shape[0], HKV=Hkv, D=D, HAS_BIAS=db is not None,
            COLS=cols, num_warps=_warps())
        return dv, dw, db, da


def supports_gated_score(v: Tensor) -> bool:
    """Whether the kernels cover ``v [B, T, Hkv, D]``: D a power of two up to 256, at most 16 KV
    heads, the head dim contiguous, on a device the kernels run on."""
    D, Hkv = v.shape[-1], v.shape[-2]
    return (kernels_run_on(v) and v.dim() == 4 and 16 <= D <= 256 and D & (D - 1) == 0 and Hkv <= 16
            and v.stride(-1) == 1)


def fused_gated_score(v: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor) -> Tensor:
    """``A * softplus(v.flatten(-2) @ weight.T + bias)`` fp32 ``[B, T, Hkv]`` of ``v [B, T, Hkv, D]``:
    the kernels where :func:`supports_gated_score`, else the reference
    (:func:`nosa_layers.eviction.value_gated_score`); differentiable in v, weight, bias and A."""
    from nosa_layers.eviction import value_gated_score

    Hkv, D = v.shape[-2], v.shape[-1]
    if weight.shape != (Hkv, Hkv * D) or A.shape != (Hkv,) or (bias is not None and bias.shape != (Hkv,)):
        raise ValueError(f"fused_gated_score: weight {tuple(weight.shape)}, A {tuple(A.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit v {tuple(v.shape)}")
    if not supports_gated_score(v):
        return value_gated_score(v, weight, bias, A)
    return _FusedGatedScore.apply(v, weight, bias, A)
