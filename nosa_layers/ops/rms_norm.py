"""Fused RMSNorm (Triton): one kernel forward, one kernel backward, instead of the reference's
eight elementwise passes over an fp32 copy of the activations (forward) and their autograd (backward).

Semantics are those of :func:`nosa_layers.megatron.norm.rms_norm_reference` (the HF Llama / MiniCPM
formula): ``y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the statistics in fp32. The backward
treats the cast to ``x.dtype`` as the identity (as autograd does) and accumulates in fp32:
``dx = rstd * (dh - xh * mean(dh * xh))`` with ``xh = x * rstd``, ``dh = dy * w``, and
``dw = sum over rows of dy * xh.to(x.dtype)``. Only ``x`` and the per-row ``rstd`` (fp32) are kept
for the backward (the reference keeps fp32 copies).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import check_device, interpreting


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, s_x, s_y, H, eps, BH: tl.constexpr):
    """One row per program: ``Y[r] = W * (X[r] * rstd).to(X.dtype)``, ``RSTD[r] = rstd``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BH)
    m = cols < H
    x = tl.load(X + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    h = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * s_y + cols, (h * w).to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + row, rstd)


@triton.jit(do_not_specialize=("N", "rows_per_program"))  # row counts vary with the batch: one compile
def _rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DWP, s_x, s_dy, s_dx, N, H, rows_per_program,
                         BH: tl.constexpr):
    """Rows ``[pid * rows_per_program, ...)``: ``DX`` of each row, and this program's fp32 partial
    sum of ``dw`` into ``DWP[pid]``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BH)
    m = cols < H
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros([BH], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, N - start)):
        r64 = start + i
        x = tl.load(X + r64 * s_x + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * s_dy + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r64)
        xh = x * rstd
        dw += dy * xh.to(X.dtype.element_ty).to(tl.float32)
        dh = dy * w
        c = tl.sum(dh * xh, 0) / H
        tl.store(DX + r64 * s_dx + cols, ((dh - xh * c) * rstd).to(DX.dtype.element_ty), mask=m)
    tl.store(DWP + pid.to(tl.int64) * H + cols, dw, mask=m)


def _num_warps(bh: int) -> int:
    return 1 if interpreting() else max(1, min(16, bh // 256))


def _backward_programs(n_rows: int, device: torch.device) -> int:
    """Programs of the backward: a few per SM (each keeps one fp32 ``dw`` partial of ``H``)."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    return max(1, min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        H = x.shape[-1]
        x2 = x.reshape(-1, H)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out_dtype = torch.result_type(x, weight)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        bh = triton.next_power_of_2(H)
        if x2.shape[0]:
            _rms_norm_fwd_kernel[(x2.shape[0],)](x2, weight, y, rstd, x2.stride(0), y.stride(0), H, eps,
                                                 BH=bh, num_warps=_num_warps(bh))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], H)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, rstd = ctx.saved_tensors
        N, H = x2.shape
        dy2 = dy.reshape(-1, H)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        programs = _backward_programs(N, x2.device)
        dwp = torch.empty(programs, H, dtype=torch.float32, device=x2.device)
        bh = triton.next_power_of_2(H)
        if N:
            _rms_norm_bwd_kernel[(programs,)](x2, weight, dy2, rstd, dx, dwp, x2.stride(0), dy2.stride(0),
                                              dx.stride(0), N, H, triton.cdiv(N, programs), BH=bh,
                                              num_warps=_num_warps(bh))
            dw = dwp.sum(0)
        else:
            dw = torch.zeros(H, dtype=torch.float32, device=x2.device)
        return dx.view(ctx.shape), dw.to(weight.dtype), None


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of ``x [..., H]`` with ``weight [H]`` (CUDA, or the interpreter)."""
    check_device(x, weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"fused_rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    return _FusedRMSNorm.apply(x, weight, eps)
