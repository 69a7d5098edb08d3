"""Hopper (sm90) block-sparse NOSA attention, host side: which inputs the hand-scheduled Gluon kernels are
written for, their TMA descriptors, the key-major bias they read, and their launches.

The kernels (same programs, lists, masks and outputs as the portable Triton kernels of
``attention_kernels``, which stay the reference fast path and the default elsewhere):

- ``attention_sm90_fwd_dq``: the forward and dQ, one list entry per step (K/V rings filled by TMA,
  asynchronous overlapped wgmma products, small loads one entry ahead);
- ``attention_sm90_pairs``: the forward with two list entries (128 keys) per step, the default forward
  over 64-row query tiles;
- ``attention_sm90_dkdv``: the warp-specialised dK/dV (a TMA producer warp, a consumer warpgroup per block).

Inputs: q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` contiguous bf16 / fp16; the K/V operands are
TMA descriptors over the ``[B * T, Hkv * D]`` views, one ``[BS, D]`` box per list entry. Rows past a
block's document end may come from the next document (finite data, masked) or lie past ``B * T``
(zero-filled by the TMA unit). Forward outputs: o ``[B, T, Hq, D]`` and the base-2 LSE ``[B, Hq, T]``,
fp32; dQ: ``[B, T, Hq, D]`` from dO, the LSE and Delta = rowsum(dO * O) ``[B, Hq, T]``. The forward
and dQ take the bias as ``key_major_bias`` ``[B, Hkv, T + block]``, dK/dV as given ``[B, T, Hkv]``.
dK/dV reads q and dO through ``[1, qt, hp, D]`` TMA boxes of their ``[B, T, Hq, D]`` views (rows past
the batch row's end zero-filled, rows past a document's end masked through the LSE) and writes dK,
dV, db or the fp32 partials of split lists as the Triton kernel does.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import LOG2E, padded_heads
from .attention_sm90_dkdv import _bwd_dkdv_kernel_sm90
from .attention_sm90_fwd_dq import _bwd_dq_kernel_sm90, _fwd_kernel_sm90
from .attention_sm90_pairs import _fwd_kernel_sm90_pairs


def covers(q: torch.Tensor, block: int) -> bool:
    """The inputs every Hopper kernel is written for: 16-bit ``q``, head dim 64 or 128, 64-key blocks."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and block == 64


def supported(q: torch.Tensor, block: int, rows: int) -> bool:
    """Shapes the forward / dQ kernels are written for: ``covers`` and query tiles of ``rows`` = 64 or
    128 (tokens x packed heads: one or two warpgroups, ``warps_for``); other shapes take the Triton kernel."""
    return covers(q, block) and rows in (64, 128)


def warps_for(rows: int) -> int:
    """Warps of a forward / dQ program over a query tile of ``rows`` rows: 16 rows per warp (one
    warpgroup per 64 rows; two warpgroups share each K / V block that the ring loads)."""
    return rows // 16


def supported_dkdv(q: torch.Tensor, block: int, rows: int, kb: int) -> bool:
    """Shapes the dK/dV kernel is written for: ``covers``, one or two blocks per group (a consumer
    warpgroup per block), query steps of 16-64 rows (the N of ``K Q^T``)."""
    return covers(q, block) and kb in (1, 2) and rows in (16, 32, 64)


@functools.lru_cache(maxsize=64)
def _box_layout(box: tuple, dtype: torch.dtype):
    """Shared-memory layout of one TMA box of ``dtype`` (bf16 or fp16; Gluon's default swizzle; cached: computing it
    took about 10 us of host time per descriptor, six descriptors per training step of a layer)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def kv_descriptor(x: torch.Tensor, block: int) -> TensorDescriptor:
    """TMA descriptor over the ``[B * T, Hkv * D]`` view of a contiguous k or v, one ``[block, D]`` box."""
    B, T, H, D = x.shape
    return TensorDescriptor(x, [B * T, H * D], [H * D, 1], [block, D], _box_layout((block, D), x.dtype))


def key_major_bias(bias: torch.Tensor | None, block: int) -> torch.Tensor | None:
    """The bias ``[B, T, Hkv]`` as the forward and dQ read it: fp32 ``[B, Hkv, T + block]`` in log2 units
    (times log2(e)), each head's keys contiguous and ``block`` zeros past the end, so that a list
    entry's ``block`` values are unmasked loads from one base address."""
    if bias is None:
        return None
    B, T, H = bias.shape
    src = bias.detach().permute(0, 2, 1)  # the kernels' input, not differentiated through
    out = torch.empty(B, H, T + block, dtype=torch.float32, device=bias.device)
    out[..., T:].zero_()  # two launches and no padding copy: part of the forward's host time before its kernel
    torch.mul(src if src.dtype == torch.float32 else src.float(), LOG2E, out=out[..., :T])
    return out


def _bias_args(q: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """``Bias, s_bb, s_bh`` of the forward / dQ (a stand-in pointer without a bias)."""
    return (q, 0, 0) if bias is None else (bias, bias.stride(0), bias.stride(1))


def _forward_args(q, k, v, bias, o, lse, idx, hp: int, qk_scale: float) -> tuple[tuple, dict]:
    """The arguments and constexprs both forward kernels (ring and pairs) take."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    Bias, s_bb, s_bh = _bias_args(q, bias)
    args = (q, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), Bias, o, lse,
            idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
            *q.stride()[:3], s_bb, s_bh, *o.stride()[:3], lse.stride(0), lse.stride(1), qk_scale)
    consts = dict(HKV=Hkv, G=Hq // Hkv, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=idx.block, D=D,
                  HAS_BIAS=bias is not None, num_warps=warps_for(padded_heads(hp) * idx.qt))
    return args, consts


def launch_forward(q, k, v, bias, o, lse, idx, grid: int, hp: int, qk_scale: float, stages: int,
                   in_regs: bool, maxnreg: int | None = None) -> None:
    """Launch ``_fwd_kernel_sm90`` over ``grid`` programs (as the Triton forward's grid); ``bias``:
    ``key_major_bias``'s or ``None``; ``maxnreg``: registers per thread at most (None: the compiler's
    choice; e.g. 168 lets three programs of two ring slots share an SM)."""
    args, consts = _forward_args(q, k, v, bias, o, lse, idx, hp, qk_scale)
    _fwd_kernel_sm90[(grid,)](*args, **consts, STAGES=stages, IN_REGS=in_regs, maxnreg=maxnreg)


def supported_pairs(rows: int) -> bool:
    """Query tiles the pair forward is written for: 64 rows (one warpgroup)."""
    return rows == 64


def launch_forward_pairs(q, k, v, bias, o, lse, idx, grid: int, hp: int, qk_scale: float) -> None:
    """Launch ``_fwd_kernel_sm90_pairs`` over ``grid`` programs (the default Hopper forward's grid,
    64-row query tiles: ``supported_pairs``); ``bias``: ``key_major_bias``'s or ``None``."""
    args, consts = _forward_args(q, k, v, bias, o, lse, idx, hp, qk_scale)
    _fwd_kernel_sm90_pairs[(grid,)](*args, **consts)


def launch_dq(q, k, v, bias, do, lse, delta, dq, idx, grid: int, hp: int, qk_scale: float, sm_scale: float,
              stages: int, in_regs: bool) -> None:
    """Launch ``_bwd_dq_kernel_sm90`` over ``grid`` programs (as the Triton dQ's grid); dq takes q's strides;
    ``bias``: ``key_major_bias``'s or ``None``."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    Bias, s_bb, s_bh = _bias_args(q, bias)
    _bwd_dq_kernel_sm90[(grid,)](
        q, do, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), Bias, lse, delta, dq,
        idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
        *q.stride()[:3], s_bb, s_bh, *do.stride()[:3], lse.stride(0), lse.stride(1), qk_scale, sm_scale,
        HKV=Hkv, G=Hq // Hkv, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None,
        STAGES=stages, IN_REGS=in_regs, num_warps=warps_for(padded_heads(hp) * idx.qt))


def rows_descriptor(x: torch.Tensor, qt: int, hp: int) -> TensorDescriptor:
    """TMA descriptor over q or dO ``[B, T, Hq, D]`` (any strides with a unit last one), one
    ``[1, qt, hp, D]`` box: the ``qt x hp`` rows of a dK/dV step, token-major (``hp`` padded to a power of
    two: the extra heads' rows are another pack's or zeros past ``Hq``, masked by the kernel)."""
    D = x.shape[-1]
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, qt, hp, D], _box_layout((1, qt, hp, D), x.dtype))


def launch_dkdv(args: tuple, hp: int, kb: int, need_db: bool, has_bias: bool, idx, stages: int) -> None:
    """Launch ``_bwd_dkdv_kernel_sm90`` over ``idx.max_pieces`` programs with the Triton dK/dV kernel's
    runtime arguments ``args`` (same order): 4 consumer warps per 64-key block of a group, plus one
    producer warp; registers capped so that the warpgroups fit the SM (one program per SM at two
    blocks, two at one)."""
    q, k, v, do = args[0], args[1], args[2], args[4]
    if do.data_ptr() % 16 or any(st % 8 for st in do.stride()[:3]):  # TMA: 16-byte aligned base and strides
        do = do.contiguous()
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    _bwd_dkdv_kernel_sm90[(idx.max_pieces,)](
        *args, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), rows_descriptor(q, idx.qt, padded_heads(hp)),
        rows_descriptor(do, idx.qt, padded_heads(hp)), T,
        HKV=Hkv, G=Hq // Hkv, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=idx.block, KB=kb, D=D, HAS_BIAS=has_bias,
        NEED_DB=need_db, STAGES=stages, num_warps=4, maxnreg=dkdv_maxnreg(kb))


def dkdv_maxnreg(kb: int) -> int:
    """Registers per thread at the launch of the warp-specialised dK/dV (the pool its warpgroups share:
    ``kb`` consumer warpgroups + the producer's, 64K registers per SM): one program per SM at two blocks,
    two at one."""
    return 168 if kb == 2 else 128
