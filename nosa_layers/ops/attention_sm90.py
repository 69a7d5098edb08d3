"""Hopper (sm90) forward and dQ of the block-sparse NOSA attention, scheduled by hand in Gluon.

Same programs, lists, masks and outputs as ``attention_kernels._fwd_kernel`` and ``_bwd_dq_kernel``
(the portable Triton kernels, which stay the reference fast path and the default elsewhere), with
what Triton's own scheduling does not give on Hopper:

- K/V blocks arrive by TMA into a ring of ``STAGES`` shared-memory slots, each guarded by an
  mbarrier, refilled as soon as the product that read it has completed;
- the tensor-core products are asynchronous (wgmma) and overlapped inside the warpgroup: entry
  ``e``'s scores ``Q K_e^T`` and entry ``e - 1``'s ``P V`` are in flight together, so the softmax of
  entry ``e`` runs while the tensor cores add ``P_{e-1} V_{e-1}`` (FlashAttention-3's intra-warpgroup
  overlap). Triton places the ``P V`` product right before its use and waits for it at once. The dQ
  kernel likewise keeps ``dS_{e-1} K_{e-1}`` in flight behind ``Q K_e^T`` and ``dO V_e^T``.

Inputs: q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` contiguous bf16 / fp16; the K/V operands are
TMA descriptors over the ``[B * T, Hkv * D]`` views, one ``[BS, D]`` box per list entry. Rows past a
block's document end may come from the next document (finite data, masked) or lie past ``B * T``
(zero-filled by the TMA unit). Forward outputs: o ``[B, T, Hq, D]`` and the base-2 LSE ``[B, Hq, T]``,
fp32; dQ: ``[B, T, Hq, D]`` from dO, the LSE and Delta = rowsum(dO * O) ``[B, Hq, T]``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import LOG2E, UNSPECIALIZED


@gluon.jit
def _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL: gl.constexpr,
                  HAS_BIAS: gl.constexpr):
    """Scores ``[M, BS]`` of one list entry in the log2 domain: scaled, biased, masked (the row's bit of
    a partial word, causal inside the own block, keys past the document end)."""
    s = s * qk_scale
    if HAS_BIAS:
        s = s + gl.expand_dims(bias.to(gl.float32) * 1.4426950408889634, 0)
    if (word != FULL) | (ks == kdiag):
        ktok = ks + offs_n
        bit = ((word >> r.to(word.dtype)) & 1) != 0
        allowed = gl.expand_dims(bit, 1) & (gl.expand_dims(ktok, 0) <= gl.expand_dims(tok, 1)) \
            & gl.expand_dims(ktok < de, 0)
        s = gl.where(allowed, s, float("-inf"))
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i):
    """One online-softmax step: new row max, rescale factor of the old sums, probabilities, new sums."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, p, alpha


@gluon.jit
def _issue_kv(k_desc, v_desc, bar, k_slot, v_slot, KStart, at, row0, col, ok, NBYTES: gl.constexpr):
    """TMA loads of the K and V blocks of list entry ``at`` into one ring slot (skipped unless ``ok``)."""
    ks = gl.load(KStart + at, mask=ok, other=0)
    mbarrier.expect(bar, NBYTES, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [row0 + ks, col], bar, k_slot, pred=ok)
    tma.async_copy_global_to_shared(v_desc, [row0 + ks, col], bar, v_slot, pred=ok)


@gluon.jit
def _tile_operand(X, b, s_xb, s_xt, s_xh, qs, de, h, pack, k_desc, G: gl.constexpr, HP: gl.constexpr,
                  M: gl.constexpr, D: gl.constexpr, op_layout: gl.constexpr, IN_REGS: gl.constexpr,
                  num_warps: gl.constexpr):
    """The query tile's rows of ``X`` (q or dO: row m = token m // HP, head pack * HP + m % HP) as the A
    operand of a wgmma: registers in ``op_layout``, or shared memory in the K tiles' layout."""
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, ld_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    tok = qs + offs_m // HP
    head = h * G + pack * HP + offs_m % HP
    x = gl.load(X + b * s_xb + gl.expand_dims(tok.to(gl.int64) * s_xt + head * s_xh, 1) + gl.expand_dims(offs_d, 0),
                mask=gl.expand_dims(tok < de, 1), other=0.0)
    if IN_REGS:
        return gl.convert_layout(x, op_layout)
    else:
        out = gl.allocate_shared_memory(x.dtype, [M, D], k_desc.layout, x)
        fence_async_shared()
        return out


@gluon.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"])
def _fwd_kernel_sm90(Q, k_desc, v_desc, Bias, O, LSE, Blocks, Count, KStart, Word, n_tiles, cap, T,
                     s_qb, s_qt, s_qh, s_bb, s_bt, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale,
                     HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                     D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, IN_REGS: gl.constexpr,
                     num_warps: gl.constexpr):
    """One program per (query tile, KV head, pack of HP heads), later tiles first, as the Triton kernel."""
    M: gl.constexpr = HP * QT
    S: gl.constexpr = BS // QT
    NP: gl.constexpr = G // HP
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    NBYTES: gl.constexpr = 2 * BS * D * k_desc.dtype.primitive_bitwidth // 8
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid = gl.program_id(0)
    pack = pid % NP
    rest = pid // NP
    h = rest % HKV
    i = n_tiles - 1 - rest // HKV
    c = i // S
    b = gl.load(Blocks + c * 4 + 0).to(gl.int64)
    kdiag = gl.load(Blocks + c * 4 + 1)
    de = gl.load(Blocks + c * 4 + 3)
    qs = kdiag + (i % S) * QT
    w = (i * HKV + h).to(gl.int64)
    base = w * cap
    n = gl.minimum(gl.load(Count + w), cap)
    row0 = (b * T).to(gl.int32)
    col = h * D

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BS, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, bars.index(j), k_smem.index(j), v_smem.index(j), KStart, base + j, row0, col,
                  j < n, NBYTES)

    # the query tile: row m is token m // HP of the tile, head pack * HP + m % HP of the KV group
    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, M, D, a_layout, IN_REGS, num_warps)

    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HP
    tok = qs + r
    offs_n = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    bbase = Bias + b * s_bb + h * s_bh
    s_zero = gl.zeros([M, BS], gl.float32, s_layout)
    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M], gl.float32, row_s)
    o = gl.zeros([M, D], gl.float32, o_layout)
    if n > 0:
        # entry 0 (no P V product before it)
        ks = gl.load(KStart + base)
        word = gl.load(Word + base)
        bias = gl.load(bbase + (ks + offs_n).to(gl.int64) * s_bt, mask=(ks + offs_n) < de, other=0.0)
        mbarrier.wait(bars.index(0), 0)
        s_t = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_t, ))
        s = _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
        m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
        p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        for e in range(1, n):
            slot = e % STAGES
            prev = (e - 1) % STAGES
            ks = gl.load(KStart + base + e)
            word = gl.load(Word + base + e)
            bias = gl.load(bbase + (ks + offs_n).to(gl.int64) * s_bt, mask=(ks + offs_n) < de, other=0.0)
            mbarrier.wait(bars.index(slot), (e // STAGES) & 1)
            s_t = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_t = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_t, ))
            s = _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
            m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
            o, p_op = warpgroup_mma_wait(0, deps=(o_t, p_op))
            # entry e - 1's slot is free: refill it with entry e - 1 + STAGES
            _issue_kv(k_desc, v_desc, bars.index(prev), k_smem.index(prev), v_smem.index(prev), KStart,
                      base + e - 1 + STAGES, row0, col, e - 1 + STAGES < n, NBYTES)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        o_t = warpgroup_mma(p_op, v_smem.index((n - 1) % STAGES), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o_t, ))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    offs_mo = gl.arange(0, M, layout=row_o)
    offs_do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    tok_o = qs + offs_mo // HP
    head_o = h * G + pack * HP + offs_mo % HP
    out = o / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    gl.store(O + b * s_ob + gl.expand_dims(tok_o.to(gl.int64) * s_ot + head_o * s_oh, 1) + gl.expand_dims(offs_do, 0),
             out.to(O.dtype.element_ty), mask=gl.expand_dims(tok_o < de, 1))
    head = h * G + pack * HP + offs_m % HP
    lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(l_safe))
    gl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=tok < de)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_bwd_dq_kernel"])
def _bwd_dq_kernel_sm90(Q, DO, k_desc, v_desc, Bias, LSE, Delta, DQ, Blocks, Count, KStart, Word, n_tiles, cap, T,
                        s_qb, s_qt, s_qh, s_bb, s_bt, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale, sm_scale,
                        HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                        D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, IN_REGS: gl.constexpr,
                        num_warps: gl.constexpr):
    """dQ: the forward's programs and lists; P recomputed from the saved LSE. Per entry three products:
    ``S = Q K^T`` and ``dP = dO V^T`` (issued together), then ``dQ += dS K`` left in flight until the
    next entry's ``dS`` is ready."""
    M: gl.constexpr = HP * QT
    S: gl.constexpr = BS // QT
    NP: gl.constexpr = G // HP
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    NBYTES: gl.constexpr = 2 * BS * D * k_desc.dtype.primitive_bitwidth // 8
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid = gl.program_id(0)
    pack = pid % NP
    rest = pid // NP
    h = rest % HKV
    i = n_tiles - 1 - rest // HKV
    c = i // S
    b = gl.load(Blocks + c * 4 + 0).to(gl.int64)
    kdiag = gl.load(Blocks + c * 4 + 1)
    de = gl.load(Blocks + c * 4 + 3)
    qs = kdiag + (i % S) * QT
    w = (i * HKV + h).to(gl.int64)
    base = w * cap
    n = gl.minimum(gl.load(Count + w), cap)
    row0 = (b * T).to(gl.int32)
    col = h * D

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BS, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, bars.index(j), k_smem.index(j), v_smem.index(j), KStart, base + j, row0, col,
                  j < n, NBYTES)
    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, M, D, a_layout, IN_REGS, num_warps)
    do_op = _tile_operand(DO, b, s_ob, s_ot, s_oh, qs, de, h, pack, k_desc, G, HP, M, D, a_layout, IN_REGS,
                          num_warps)

    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HP
    tok = qs + r
    head = h * G + pack * HP + offs_m % HP
    rvalid = tok < de
    lse = gl.load(LSE + b * s_lb + head * s_lh + tok, mask=rvalid, other=float("inf"))
    delta = gl.load(Delta + b * s_lb + head * s_lh + tok, mask=rvalid, other=0.0)
    offs_n = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    bbase = Bias + b * s_bb + h * s_bh
    s_zero = gl.zeros([M, BS], gl.float32, s_layout)
    dq = gl.zeros([M, D], gl.float32, o_layout)
    if n > 0:
        ks = gl.load(KStart + base)
        word = gl.load(Word + base)
        bias = gl.load(bbase + (ks + offs_n).to(gl.int64) * s_bt, mask=(ks + offs_n) < de, other=0.0)
        mbarrier.wait(bars.index(0), 0)
        s_t = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(do_op, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(1, deps=(s_t, ))
        sc = _entry_scores(sc, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
        p = gl.exp2(sc - gl.expand_dims(lse, 1))
        dp = warpgroup_mma_wait(0, deps=(dp_t, ))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(k_desc.dtype), ds_layout)
        for e in range(1, n):
            slot = e % STAGES
            prev = (e - 1) % STAGES
            ks = gl.load(KStart + base + e)
            word = gl.load(Word + base + e)
            bias = gl.load(bbase + (ks + offs_n).to(gl.int64) * s_bt, mask=(ks + offs_n) < de, other=0.0)
            mbarrier.wait(bars.index(slot), (e // STAGES) & 1)
            s_t = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(do_op, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dq_t = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            sc = warpgroup_mma_wait(2, deps=(s_t, ))
            sc = _entry_scores(sc, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
            p = gl.exp2(sc - gl.expand_dims(lse, 1))
            dp = warpgroup_mma_wait(1, deps=(dp_t, ))
            ds = p * (dp - gl.expand_dims(delta, 1))
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_t, ds_op))
            # entry e - 1's slot is free: refill it with entry e - 1 + STAGES
            _issue_kv(k_desc, v_desc, bars.index(prev), k_smem.index(prev), v_smem.index(prev), KStart,
                      base + e - 1 + STAGES, row0, col, e - 1 + STAGES < n, NBYTES)
            ds_op = gl.convert_layout(ds.to(k_desc.dtype), ds_layout)
        dq_t = warpgroup_mma(ds_op, k_smem.index((n - 1) % STAGES), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq_t, ))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))

    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_mo = gl.arange(0, M, layout=row_o)
    offs_do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    tok_o = qs + offs_mo // HP
    head_o = h * G + pack * HP + offs_mo % HP
    gl.store(DQ + b * s_qb + gl.expand_dims(tok_o.to(gl.int64) * s_qt + head_o * s_qh, 1) + gl.expand_dims(offs_do, 0),
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(tok_o < de, 1))


def supported(q: torch.Tensor, block: int, rows: int) -> bool:
    """Shapes this kernel is written for: 16-bit inputs, head dim 64 or 128, 64-key blocks and query
    tiles of ``rows`` = 64 (tokens x packed heads: one warpgroup); other shapes take the Triton kernel."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and block == 64 and rows == 64


def kv_descriptor(x: torch.Tensor, block: int) -> TensorDescriptor:
    """TMA descriptor over the ``[B * T, Hkv * D]`` view of a contiguous k or v, one ``[block, D]`` box."""
    B, T, H, D = x.shape
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block, D], dtype)
    return TensorDescriptor(x, [B * T, H * D], [H * D, 1], [block, D], layout)


def launch_forward(q, k, v, bias, o, lse, idx, grid: int, hp: int, qk_scale: float, stages: int, in_regs: bool,
                   bias_strides) -> None:
    """Launch ``_fwd_kernel_sm90`` over ``grid`` programs (as the Triton forward's grid)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    _fwd_kernel_sm90[(grid,)](
        q, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), q if bias is None else bias, o, lse,
        idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
        *q.stride()[:3], *bias_strides, *o.stride()[:3], lse.stride(0), lse.stride(1), qk_scale,
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None, STAGES=stages,
        IN_REGS=in_regs, num_warps=4)


def launch_dq(q, k, v, bias, do, lse, delta, dq, idx, grid: int, hp: int, qk_scale: float, sm_scale: float,
              stages: int, in_regs: bool, bias_strides) -> None:
    """Launch ``_bwd_dq_kernel_sm90`` over ``grid`` programs (as the Triton dQ's grid); dq takes q's strides."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    _bwd_dq_kernel_sm90[(grid,)](
        q, do, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), q if bias is None else bias, lse, delta, dq,
        idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
        *q.stride()[:3], *bias_strides, *do.stride()[:3], lse.stride(0), lse.stride(1), qk_scale, sm_scale,
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None, STAGES=stages,
        IN_REGS=in_regs, num_warps=4)
