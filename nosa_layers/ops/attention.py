"""Autograd wrapper of the block-sparse NOSA attention kernels."""

from __future__ import annotations

import os

import torch
import triton
from torch import Tensor

from nosa_layers.config import NOSAConfig
from ._index import SparseIndex, build_index
from ._kernels import LOG2E, _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _dkdv_reduce_kernel, _fwd_kernel

# Launch parameters, per kernel: heads packed per tile (M = HP * block), warps, pipeline stages, and
# whether the loop's tile loads go through TMA descriptors (``TMA``: GPU with TMA, i.e. Hopper or
# newer, or the interpreter). Forward: ``PAIR``, two key blocks per online-softmax step. dK/dV:
# ``CHUNK``, the longest inverse-list piece per program (0: whole lists; read when the index is
# built); each piece of a split list keeps a 64 KiB fp32 partial (dK + dV) until the reduction.
# Picked by the H200 sweep for block 64, D 128 (docs/BENCHMARKS.md); CHUNK 128 instead of the
# sweep's 32 (22.35 vs 22.17 ms for the whole backward at T=32K, HQ=32) keeps ~10x fewer partials.
# Override for experiments.
CONFIG = {
    "fwd": dict(HP=1, num_warps=4, num_stages=2, TMA=False, PAIR=False),
    "dq": dict(HP=2, num_warps=8, num_stages=2, TMA=False),
    "dkdv": dict(HP=1, num_warps=4, num_stages=2, TMA=False, CHUNK=128),
}


POISON_OUTPUTS = False  # tests: fill every output buffer with NaN before the kernels write it


def _empty_like(x: Tensor) -> Tensor:
    out = torch.empty_like(x)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def _empty(*shape, **kw) -> Tensor:
    out = torch.empty(*shape, **kw)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def interpreting() -> bool:
    """True when the kernels run under the Triton interpreter (TRITON_INTERPRET=1 at import or now)."""
    return os.environ.get("TRITON_INTERPRET") == "1" or type(_fwd_kernel).__name__ == "InterpretedFunction"


def check_device(*tensors: Tensor) -> None:
    """Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 (CPU tests)."""
    if interpreting():
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise RuntimeError("nosa_layers.ops: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); "
                               "use backend='reference' on CPU")


def _hp(name: str, G: int, block: int) -> int:
    hp = CONFIG[name]["HP"]
    hp = max(1, min(hp, G))
    while G % hp:
        hp -= 1
    while hp * block < 16 and hp < G:  # tl.dot needs M >= 16
        hp *= 2
    return hp


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, block: int) -> None:
    D = q.shape[-1]
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"nosa_layers.ops: head dim must be a power of two in 16..256, got {D}")
    if block not in (16, 32, 64):
        raise ValueError(f"nosa_layers.ops: block_size must be 16, 32 or 64, got {block}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("nosa_layers.ops: q, k, v need a contiguous last dimension")


def _strides_bias(bias: Tensor | None):
    return (0, 0, 0) if bias is None else bias.stride()


def _use_tma(name: str, x: Tensor) -> bool:
    if not CONFIG[name].get("TMA", False):
        return False
    return interpreting() or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)


def _tma_desc(x: Tensor, *block: int):
    """TMA descriptor of a contiguous ``[B, T, H, D]`` tensor seen as ``[B*T, H*D]`` (``block`` of 2
    dims: K/V tiles ``[block, D]``) or ``[B*T, H, D]`` (3 dims: Q/dO tiles ``[block, heads, D]``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, T, H, D = x.shape
    view = x.view(B * T, H * D) if len(block) == 2 else x.view(B * T, H, D)
    return TensorDescriptor.from_tensor(view, list(block))


def attention_forward(q, k, v, bias, idx: SparseIndex, scale: float):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    BT = idx.block
    o = _empty_like(q)
    lse = _empty(B, Hq, T, dtype=torch.float32, device=q.device)
    hp = _hp("fwd", G, BT)
    cfg = CONFIG["fwd"]
    grid = (idx.n_tiles * Hkv * (G // hp),)
    tma = _use_tma("fwd", q)
    kd, vd = (_tma_desc(k, BT, D), _tma_desc(v, BT, D)) if tma else (None, None)
    if grid[0]:
        _fwd_kernel[grid](q, k, v, kd, vd, q if bias is None else bias, o, lse, idx.tiles, idx.row_ptr, idx.fwd_ks,
                          idx.fwd_word, idx.fwd_order, T,
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
                          *o.stride()[:3], lse.stride(0), lse.stride(1),
                          scale * LOG2E, HKV=Hkv, G=G, HP=hp, BT=BT, D=D, HAS_BIAS=bias is not None,
                          TMA=tma, PAIR=cfg.get("PAIR", False), num_warps=cfg["num_warps"],
                          num_stages=cfg["num_stages"])
    return o, lse


def attention_backward(q, k, v, bias, o, lse, do, idx: SparseIndex, scale: float, need_db: bool):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    BT = idx.block
    # the kernels need a contiguous head dim; the TMA descriptor of dO (dK/dV) needs a dense layout
    if do.stride(-1) != 1 or (_use_tma("dkdv", q) and not do.is_contiguous()):
        do = do.contiguous()
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if T:
        _bwd_delta_kernel[(triton.cdiv(T, 64), B * Hq)](o, do, delta, T, Hq, *o.stride()[:3], *do.stride()[:3],
                                                        delta.stride(0), delta.stride(1), BM=64, D=D)
    dq = _empty_like(q)
    dk = _empty_like(k)
    dv = _empty_like(v)
    db = _empty(B, T, Hkv, dtype=torch.float32, device=q.device) if need_db else None
    if idx.n_tiles == 0:
        return dq, dk, dv, db
    bias_arg = q if bias is None else bias
    hp = _hp("dq", G, BT)
    cfg = CONFIG["dq"]
    tma = _use_tma("dq", q)
    kd, vd = (_tma_desc(k, BT, D), _tma_desc(v, BT, D)) if tma else (None, None)
    _bwd_dq_kernel[(idx.n_tiles * Hkv * (G // hp),)](
        q, k, v, kd, vd, bias_arg, do, lse, delta, dq, idx.tiles, idx.row_ptr, idx.fwd_ks, idx.fwd_word,
        idx.fwd_order, T,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
        *do.stride()[:3], lse.stride(0), lse.stride(1), scale * LOG2E, scale,
        HKV=Hkv, G=G, HP=hp, BT=BT, D=D, HAS_BIAS=bias is not None, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    hp = _hp("dkdv", G, BT)
    cfg = CONFIG["dkdv"]
    tma = _use_tma("dkdv", q)
    qd, dod = (_tma_desc(q, BT, hp, D), _tma_desc(do, BT, hp, D)) if tma else (None, None)
    dbs = db.stride() if need_db else (0, 0, 0)
    db_arg = dk if db is None else db
    n_ws = max(idx.n_slots, 1)
    wdk = torch.empty(n_ws, BT, D, dtype=torch.float32, device=q.device)
    wdv = torch.empty_like(wdk)
    wdb = torch.empty(n_ws, BT, dtype=torch.float32, device=q.device)
    _bwd_dkdv_kernel[(idx.dkdv_order.numel(),)](
        q, k, v, qd, dod, bias_arg, do, lse, delta, dk, dv, db_arg, wdk, wdv, wdb, idx.tiles, idx.dkdv_items,
        idx.inv_qs, idx.inv_word, idx.dkdv_order, T,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
        *do.stride()[:3], lse.stride(0), lse.stride(1), *dbs, scale * LOG2E, scale,
        HKV=Hkv, G=G, HP=hp, BT=BT, D=D, HAS_BIAS=bias is not None, NEED_DB=need_db, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if idx.reduce_items.shape[0]:
        _dkdv_reduce_kernel[(idx.reduce_items.shape[0],)](
            wdk, wdv, wdb, dk, dv, db_arg, idx.tiles, idx.reduce_items, *k.stride()[:3], *v.stride()[:3], *dbs, scale,
            HKV=Hkv, BT=BT, D=D, NEED_DB=need_db, num_warps=4)
    return dq, dk, dv, db


class _NosaSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, idx, scale):
        o, lse = attention_forward(q, k, v, bias, idx, scale)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.idx, ctx.scale, ctx.has_bias = idx, scale, bias is not None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, o, lse = ctx.saved_tensors
        need_db = ctx.has_bias and ctx.needs_input_grad[3]
        dq, dk, dv, db = attention_backward(q, k, v, bias, o, lse, do, ctx.idx, ctx.scale, need_db)
        if db is not None:
            db = db.to(bias.dtype)
        return dq, dk, dv, db, None, None


def _prep(x: Tensor) -> Tensor:
    """Contiguous input: the gradient buffers (``empty_like``) reuse the input strides in the kernels,
    which only matches for dense layouts (megatron hands over strided views of the fused QKV)."""
    return x if x.is_contiguous() else x.contiguous()


def sparse_attention_from_selection(q: Tensor, k: Tensor, v: Tensor, selected: Tensor, cfg: NOSAConfig,
                                    cu_seqlens: Tensor | None = None, bias: Tensor | None = None,
                                    softmax_scale: float | None = None,
                                    index: SparseIndex | None = None) -> Tensor:
    """Attention over a precomputed selection ``selected`` bool ``[B, Hkv, T, nb]`` (same layout as
    ``select_blocks``); differentiable in q, k, v, bias. ``index`` (from ``build_sparse_index``)
    skips the index construction."""
    from nosa_layers.selection import document_spans

    check_device(q, k, v, bias)
    _check_shapes(q, k, v, cfg.block_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if index is None:
        index = build_index(selected, document_spans(cu_seqlens, q.shape[1]), cfg.block_size,
                            CONFIG["dkdv"].get("CHUNK", 0))
    if bias is not None and bias.dtype != torch.float32 and bias.dtype != q.dtype:
        bias = bias.float()
    return _NosaSparseAttention.apply(_prep(q), _prep(k), _prep(v), bias, index, float(scale))


def build_sparse_index(selected: Tensor, cfg: NOSAConfig, seq_len: int, cu_seqlens: Tensor | None = None) -> SparseIndex:
    from nosa_layers.selection import document_spans

    return build_index(selected, document_spans(cu_seqlens, seq_len), cfg.block_size, CONFIG["dkdv"].get("CHUNK", 0))


def nosa_attention_triton(q: Tensor, k: Tensor, v: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                          cu_seqlens: Tensor | None = None, bias: Tensor | None = None,
                          softmax_scale: float | None = None) -> Tensor:
    """NOSA attention: Triton selection (no grad) + block-sparse attention with the bias gradient."""
    from .selection import select_blocks_triton

    check_device(q, k, v, evict_score, bias)
    _check_shapes(q, k, v, cfg.block_size)
    with torch.no_grad():
        score = None if evict_score is None else evict_score.detach()
        selected = select_blocks_triton(q.detach(), k.detach(), score, cfg, cu_seqlens=cu_seqlens,
                                        softmax_scale=softmax_scale)
    return sparse_attention_from_selection(q, k, v, selected, cfg, cu_seqlens=cu_seqlens, bias=bias,
                                           softmax_scale=softmax_scale)
