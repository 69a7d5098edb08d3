"""Hopper (sm90) forward, dQ and dK/dV of the block-sparse NOSA attention, scheduled by hand in Gluon.

Same programs, lists, masks and outputs as ``attention_kernels._fwd_kernel``, ``_bwd_dq_kernel`` and
``_bwd_dkdv_kernel`` (the portable Triton kernels, which stay the reference fast path and the default
elsewhere; over 64-row tiles the forward by default is ``attention_sm90_pairs``'s, two list entries per
step on the helpers below), with what Triton's own scheduling does not give on Hopper:

- K/V blocks arrive by TMA into a ring of ``STAGES`` shared-memory slots, each guarded by an
  mbarrier, refilled as soon as the product that read it has completed;
- the tensor-core products are asynchronous (wgmma) and overlapped inside the warpgroup: entry
  ``e``'s scores ``Q K_e^T`` and entry ``e - 1``'s ``P V`` are in flight together, so the softmax of
  entry ``e`` runs while the tensor cores add ``P_{e-1} V_{e-1}`` (FlashAttention-3's intra-warpgroup
  overlap). Triton places the ``P V`` product right before its use and waits for it at once. The dQ
  kernel likewise keeps ``dS_{e-1} K_{e-1}`` in flight behind ``Q K_e^T`` and ``dO V_e^T``;
- the forward and dQ issue a list entry's small loads (key start, mask word, the bias of its keys) one
  entry ahead, so their latency hides behind the previous entry's products, and read the bias from a
  key-major copy in log2 units (``key_major_bias``: 64 consecutive values, no mask);
- dK/dV is warp-specialised (FlashAttention-3's producer / consumer split): one producer warp loads
  each step's query and dO rows by TMA into a ring, one consumer warpgroup per 64-key block computes,
  and the consumers never wait for each other (a slot is refilled once every consumer released it),
  so one warpgroup's exponentials overlap the other's (or the other program's) tensor-core products.

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import LOG2E, UNSPECIALIZED
from .attention_kernels import _dkdv_piece, _query_tile  # scalar work items, shared with the Triton kernels


@gluon.jit
def _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL: gl.constexpr,
                  HAS_BIAS: gl.constexpr):
    """Scores ``[M, BS]`` of one list entry in the log2 domain: scaled, biased, masked (the row's bit of
    a partial word, causal inside the own block, keys past the document end)."""
    if HAS_BIAS:
        s = s * qk_scale + gl.expand_dims(bias, 0)  # the bias comes scaled to log2 units (``key_major_bias``)
    else:
        s = s * qk_scale
    if (word != FULL) | (ks == kdiag):
        ktok = ks + offs_n
        bit = ((word >> r.to(word.dtype)) & 1) != 0
        allowed = gl.expand_dims(bit, 1) & (gl.expand_dims(ktok, 0) <= gl.expand_dims(tok, 1)) \
            & gl.expand_dims(ktok < de, 0)
        s = gl.where(allowed, s, float("-inf"))
    return s


@gluon.jit
def _entry_bias(bbase, ks, offs_n, HAS_BIAS: gl.constexpr):
    """The bias of list entry ``ks``'s keys ``[BS]`` (zero without a bias) from the head's row of the
    key-major bias (``key_major_bias``): consecutive addresses from one base, no mask (keys past the
    document end are masked in the scores)."""
    if HAS_BIAS:
        return gl.load(bbase + ks + offs_n)
    else:
        return offs_n.to(gl.float32) * 0.0


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
def _issue_kv(k_desc, v_desc, bar, k_slot, v_slot, ks, row0, col, ok):
    """TMA loads of the K and V blocks of the list entry whose keys start at ``ks`` into one ring slot
    (skipped unless ``ok``)."""
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [row0 + ks, col], bar, k_slot, pred=ok)
    tma.async_copy_global_to_shared(v_desc, [row0 + ks, col], bar, v_slot, pred=ok)


@gluon.jit
def _refill(k_desc, v_desc, bars, k_smem, v_smem, KStart, base, n, at, ks1, ks2, row0, col, STAGES: gl.constexpr):
    """Request list entry ``at`` = e - 1 + STAGES into the slot entry e - 1 freed, with its key start from
    the registers ``_entry_ahead`` filled (entry e + 1's ``ks1``, e + 2's ``ks2``) where it is one of
    them, else loaded here."""
    slot = (at - STAGES) % STAGES
    if STAGES == 2:
        ks = ks1
    elif STAGES == 3:
        ks = ks2
    else:
        ks = gl.load(KStart + base + at, mask=at < n, other=0)
    _issue_kv(k_desc, v_desc, bars.index(slot), k_smem.index(slot), v_smem.index(slot), ks, row0, col, at < n)


@gluon.jit
def _entry_ahead(KStart, Word, bbase, base, n, e, ks1, offs_n, HAS_BIAS: gl.constexpr):
    """Loads issued while list entry ``e`` computes, so that their latency hides behind its products
    instead of stalling the next entry: entry e + 1's word and bias (from its key start ``ks1``, loaded
    one entry earlier still) and entry e + 2's key start (0 past the list's end)."""
    word1 = gl.load(Word + base + e + 1, mask=e + 1 < n, other=0)
    bias1 = _entry_bias(bbase, ks1, offs_n, HAS_BIAS)
    ks2 = gl.load(KStart + base + e + 2, mask=e + 2 < n, other=0)
    return word1, bias1, ks2


@gluon.jit
def _query_program(Blocks, Count, n_tiles, cap, T, HKV: gl.constexpr, NP: gl.constexpr, S: gl.constexpr,
                   QT: gl.constexpr, D: gl.constexpr):
    """Work item of a forward / dQ program (``_query_tile``, the Triton kernels' mapping): head pack,
    KV head, batch row (int64), the tile's own block start ``kdiag``, document end, first query token,
    its list's offset (int64) and length, and the K / V descriptors' row and column of its batch row
    and KV head."""
    pack, h, w, b, kdiag, de, qs = _query_tile(Blocks, n_tiles, HKV, NP, S, QT)
    return (pack, h, b, kdiag, de, qs, w * cap, gl.minimum(gl.load(Count + w), cap), (b * T).to(gl.int32), h * D)


@gluon.jit
def _kv_ring(k_desc, v_desc, KStart, base, n, row0, col, STAGES: gl.constexpr, BS: gl.constexpr, D: gl.constexpr):
    """``STAGES`` K / V slots ``[STAGES, BS, D]`` with one mbarrier each, the first ``STAGES`` list entries
    (of ``n``, at ``base``) already requested."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BS, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, bars.index(j), k_smem.index(j), v_smem.index(j),
                  gl.load(KStart + base + j, mask=j < n, other=0), row0, col, j < n)
    return k_smem, v_smem, bars


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


@gluon.jit
def _store_tile(X, x, b, s_xb, s_xt, s_xh, qs, de, h, pack, G: gl.constexpr, HP: gl.constexpr, M: gl.constexpr,
                D: gl.constexpr, layout: gl.constexpr):
    """Store ``x`` ``[M, D]`` (in ``layout``) to the query tile's rows of ``X`` (o or dq; row m = token
    m // HP, head pack * HP + m % HP), rows past the document end skipped: ``_tile_operand``'s inverse."""
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    tok = qs + offs_m // HP
    head = h * G + pack * HP + offs_m % HP
    gl.store(X + b * s_xb + gl.expand_dims(tok.to(gl.int64) * s_xt + head * s_xh, 1) + gl.expand_dims(offs_d, 0),
             x.to(X.dtype.element_ty), mask=gl.expand_dims(tok < de, 1))


@gluon.jit
def _store_forward(O, LSE, o, m_i, l_i, b, s_ob, s_ot, s_oh, s_lb, s_lh, qs, de, h, pack, offs_m, tok, G: gl.constexpr,
                   HP: gl.constexpr, M: gl.constexpr, D: gl.constexpr, o_layout: gl.constexpr):
    """A forward program's outputs: o = acc / l ``[M, D]`` (``_store_tile``) and the base-2 LSE of its rows
    (``offs_m`` / ``tok``: the rows and their tokens; ``inf`` on rows that attended to no key)."""
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    _store_tile(O, o / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1), b, s_ob, s_ot, s_oh,
                qs, de, h, pack, G, HP, M, D, o_layout)
    head = h * G + pack * HP + offs_m % HP
    lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(l_safe))
    gl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=tok < de)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"])
def _fwd_kernel_sm90(Q, k_desc, v_desc, Bias, O, LSE, Blocks, Count, KStart, Word, n_tiles, cap, T,
                     s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale,
                     HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                     D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, IN_REGS: gl.constexpr,
                     num_warps: gl.constexpr):
    """One program per (query tile, KV head, pack of HP heads), later tiles first, as the Triton kernel."""
    M: gl.constexpr = HP * QT
    S: gl.constexpr = BS // QT
    NP: gl.constexpr = G // HP
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pack, h, b, kdiag, de, qs, base, n, row0, col = _query_program(Blocks, Count, n_tiles, cap, T, HKV, NP, S, QT, D)
    k_smem, v_smem, bars = _kv_ring(k_desc, v_desc, KStart, base, n, row0, col, STAGES, BS, D)

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
        bias = _entry_bias(bbase, ks, offs_n, HAS_BIAS)
        ks1 = gl.load(KStart + base + 1, mask=n > 1, other=0)
        word1, bias1, ks2 = _entry_ahead(KStart, Word, bbase, base, n, 0, ks1, offs_n, HAS_BIAS)
        mbarrier.wait(bars.index(0), 0)
        s_t = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_t, ))
        s = _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
        m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
        p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        for e in range(1, n):
            slot = e % STAGES
            prev = (e - 1) % STAGES
            ks, word, bias, ks1 = ks1, word1, bias1, ks2  # entry e's, loaded during entry e - 1
            word1, bias1, ks2 = _entry_ahead(KStart, Word, bbase, base, n, e, ks1, offs_n, HAS_BIAS)
            mbarrier.wait(bars.index(slot), (e // STAGES) & 1)
            s_t = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_t = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_t, ))
            s = _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
            m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
            o, p_op = warpgroup_mma_wait(0, deps=(o_t, p_op))
            # entry e - 1's slot is free: refill it with entry e - 1 + STAGES
            _refill(k_desc, v_desc, bars, k_smem, v_smem, KStart, base, n, e - 1 + STAGES, ks1, ks2, row0, col,
                    STAGES)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        o_t = warpgroup_mma(p_op, v_smem.index((n - 1) % STAGES), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o_t, ))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))

    _store_forward(O, LSE, o, m_i, l_i, b, s_ob, s_ot, s_oh, s_lb, s_lh, qs, de, h, pack, offs_m, tok, G, HP, M, D,
                   o_layout)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_bwd_dq_kernel"])
def _bwd_dq_kernel_sm90(Q, DO, k_desc, v_desc, Bias, LSE, Delta, DQ, Blocks, Count, KStart, Word, n_tiles, cap, T,
                        s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale, sm_scale,
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
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    pack, h, b, kdiag, de, qs, base, n, row0, col = _query_program(Blocks, Count, n_tiles, cap, T, HKV, NP, S, QT, D)
    k_smem, v_smem, bars = _kv_ring(k_desc, v_desc, KStart, base, n, row0, col, STAGES, BS, D)
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
        bias = _entry_bias(bbase, ks, offs_n, HAS_BIAS)
        ks1 = gl.load(KStart + base + 1, mask=n > 1, other=0)
        word1, bias1, ks2 = _entry_ahead(KStart, Word, bbase, base, n, 0, ks1, offs_n, HAS_BIAS)
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
            ks, word, bias, ks1 = ks1, word1, bias1, ks2  # entry e's, loaded during entry e - 1
            word1, bias1, ks2 = _entry_ahead(KStart, Word, bbase, base, n, e, ks1, offs_n, HAS_BIAS)
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
            _refill(k_desc, v_desc, bars, k_smem, v_smem, KStart, base, n, e - 1 + STAGES, ks1, ks2, row0, col,
                    STAGES)
            ds_op = gl.convert_layout(ds.to(k_desc.dtype), ds_layout)
        dq_t = warpgroup_mma(ds_op, k_smem.index((n - 1) % STAGES), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq_t, ))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))

    _store_tile(DQ, dq * sm_scale, b, s_qb, s_qt, s_qh, qs, de, h, pack, G, HP, M, D, o_layout)


@gluon.jit
def _dkdv_producer(a, NP: gl.constexpr, HP: gl.constexpr, G: gl.constexpr, KB: gl.constexpr, BS: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr):
    """Producer warp of the warp-specialised dK/dV: the group's K / V blocks once, then per step the query
    and dO rows (one TMA box each) into the ring slot the consumers released."""
    (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_bar, QStart, it0, stop,
     bk, T, ks, h) = a
    mbarrier.expect(kv_bar, KB * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for u in gl.static_range(KB):
        tma.async_copy_global_to_shared(k_desc, [(bk * T).to(gl.int32) + ks + u * BS, h * D],
                                        kv_bar, k_smem.index(u))
        tma.async_copy_global_to_shared(v_desc, [(bk * T).to(gl.int32) + ks + u * BS, h * D],
                                        kv_bar, v_smem.index(u))
    for it in range(it0, stop):
        i = it - it0
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        qs = gl.load(QStart + it // NP)
        head = h * G + (it % NP) * HP
        bar = ready.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bk.to(gl.int32), qs, head, 0], bar, q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [bk.to(gl.int32), qs, head, 0], bar, do_smem.index(slot))


@gluon.jit
def _dkdv_consumer(a, C: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                   KB: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, NEED_DB: gl.constexpr,
                   STAGES: gl.constexpr):
    """Consumer warpgroup ``C`` of the warp-specialised dK/dV: keys ``C * BS ..`` of the group. Per step
    ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued together with the previous step's ``dV += P^T dO``
    and ``dK += dS^T Q``; the previous step's ring slot is released once those have completed. Stores its
    rows of dK, dV, db (or of the piece's partial slot)."""
    (K_SMEM, V_SMEM, q_smem, do_smem, ready, empty, kv_bar, Bias, LSE, Delta, DK, DV, DB, WDK, WDV, WDB, QStart, Word,
     it0, stop, live, slot, bk, ks, de, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh, s_lb, s_lh,
     s_db_b, s_db_t, s_db_h, qk_scale, sm_scale) = a
    NP: gl.constexpr = G // HP
    M: gl.constexpr = HP * QT
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    num_warps: gl.constexpr = gl.num_warps()
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_t: gl.constexpr = gl.SliceLayout(1, t_layout)
    row_t: gl.constexpr = gl.SliceLayout(0, t_layout)
    kc = ks + C * BS  # this warpgroup's first key
    k_smem = K_SMEM.index(C)
    v_smem = V_SMEM.index(C)

    offs_n = gl.arange(0, BS, layout=key_t)
    ktok = kc + offs_n
    kvalid = ktok < de
    if HAS_BIAS:
        bias = gl.load(Bias + bk * s_bb + ktok.to(gl.int64) * s_bt + h * s_bh, mask=kvalid,
                       other=0.0).to(gl.float32) * 1.4426950408889634
    else:
        bias = gl.zeros([BS], gl.float32, key_t)
    offs_m = gl.arange(0, M, layout=row_t)
    r = offs_m // HP  # token-major rows: token r of the query tile, head (pack * HP + m % HP)
    loff = (offs_m % HP) * s_lh + r
    lbase = LSE + bk * s_lb + (h * G) * s_lh
    dbase = Delta + bk * s_lb + (h * G) * s_lh

    t_zero = gl.zeros([BS, M], gl.float32, t_layout)
    dk = gl.zeros([BS, D], gl.float32, acc_layout)
    dv = gl.zeros([BS, D], gl.float32, acc_layout)
    db = gl.zeros([BS], gl.float32, key_t)
    mbarrier.wait(kv_bar, 0)
    if stop > it0:
        p_op = gl.zeros([BS, M], k_smem.dtype, op_layout)
        ds_op = gl.zeros([BS, M], k_smem.dtype, op_layout)
        for it in range(it0, stop):
            i = it - it0
            cur = i % STAGES
            prev = (i + STAGES - gl.minimum(i, 1)) % STAGES  # step it - 1's slot (its own at the first step)
            e = it // NP
            pk = it % NP
            qs = gl.load(QStart + e)
            word = gl.load(Word + e * KB + C)
            tok = qs + r
            rvalid = tok < de  # query tiles never cross their document: rows past its end are padding
            lse = gl.load(lbase + pk * HP * s_lh + qs + loff, mask=rvalid, other=float("inf"))
            delta = gl.load(dbase + pk * HP * s_lh + qs + loff, mask=rvalid, other=0.0)
            q_cur = q_smem.index(cur).reshape([M, D])
            do_cur = do_smem.index(cur).reshape([M, D])
            mbarrier.wait(ready.index(cur), (i // STAGES) & 1)
            st_t = warpgroup_mma(k_smem, q_cur.permute((1, 0)), t_zero, use_acc=False, is_async=True)
            dpt_t = warpgroup_mma(v_smem, do_cur.permute((1, 0)), t_zero, use_acc=False, is_async=True)
            # step it - 1's products (zero operands on the step's own rows at the first step)
            dv_t = warpgroup_mma(p_op, do_smem.index(prev).reshape([M, D]), dv, is_async=True)
            dk_t = warpgroup_mma(ds_op, q_smem.index(prev).reshape([M, D]), dk, is_async=True)
            st = warpgroup_mma_wait(3, deps=(st_t, ))
            pt = gl.exp2(st * qk_scale + gl.expand_dims(bias, 1) - gl.expand_dims(lse, 0))
            if (word != FULL) | (qs < kc + BS):
                bit = ((word >> r.to(word.dtype)) & 1) != 0
                allowed = gl.expand_dims(bit, 0) & (gl.expand_dims(ktok, 1) <= gl.expand_dims(tok, 0)) \
                    & gl.expand_dims(kvalid, 1)
                pt = gl.where(allowed, pt, 0.0)
            dpt = warpgroup_mma_wait(2, deps=(dpt_t, ))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            if NEED_DB:
                db += gl.sum(dst, 1)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_t, dk_t, p_op, ds_op))
            # this warpgroup is done with step it - 1's slot
            mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)
            p_op = gl.convert_layout(pt.to(k_smem.dtype), op_layout)
            ds_op = gl.convert_layout(dst.to(k_smem.dtype), op_layout)
        last = (stop - it0 - 1) % STAGES
        dv_t = warpgroup_mma(p_op, do_smem.index(last).reshape([M, D]), dv, is_async=True)
        dk_t = warpgroup_mma(ds_op, q_smem.index(last).reshape([M, D]), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv_t, dk_t))

    if live:
        offs_na = gl.arange(0, BS, layout=gl.SliceLayout(1, acc_layout))
        offs_da = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        kvalid_a = gl.expand_dims(kc + offs_na < de, 1)
        kp = gl.expand_dims((kc + offs_na).to(gl.int64), 1)
        if slot < 0:
            gl.store(DK + bk * s_kb + kp * s_kt + h * s_kh + gl.expand_dims(offs_da, 0),
                     (dk * sm_scale).to(DK.dtype.element_ty), mask=kvalid_a)
            gl.store(DV + bk * s_vb + kp * s_vt + h * s_vh + gl.expand_dims(offs_da, 0), dv.to(DV.dtype.element_ty),
                     mask=kvalid_a)
            if NEED_DB:
                gl.store(DB + bk * s_db_b + ktok.to(gl.int64) * s_db_t + h * s_db_h, db, mask=kvalid)
        else:
            N: gl.constexpr = KB * BS
            tile_off = slot.to(gl.int64) * (N * D) + gl.expand_dims(C * BS + offs_na, 1) * D \
                + gl.expand_dims(offs_da, 0)
            gl.store(WDK + tile_off, dk)
            gl.store(WDV + tile_off, dv)
            if NEED_DB:
                gl.store(WDB + slot.to(gl.int64) * N + C * BS + offs_n, db)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_bwd_dkdv_kernel"])
def _bwd_dkdv_kernel_sm90(Q, K, V, Bias, DO, LSE, Delta, DK, DV, DB, WDK, WDV, WDB, Blocks, InvPtr, QStart, Word,
                          PiecePtr, PieceList, SlotPtr, n_lists, chunk,
                          s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                          s_ob, s_ot, s_oh, s_lb, s_lh, s_db_b, s_db_t, s_db_h, qk_scale, sm_scale,
                          k_desc, v_desc, q_desc, do_desc, T,
                          HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr, BS: gl.constexpr,
                          KB: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, NEED_DB: gl.constexpr,
                          STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV, db, warp-specialised: the Triton kernel's programs (pieces of inverse lists of
    ``KB * BS``-key groups), partial slots and outputs. One producer warp loads the group's K / V once
    and each step's query and dO rows (list entry x head pack: a ``[QT, HP, D]`` TMA box each) into a
    ring of ``STAGES`` slots; ``KB`` consumer warpgroups (this program's warps and ``KB - 1`` workers)
    each own ``BS`` keys and run their steps without waiting for each other: a slot is refilled when
    every consumer has released it."""
    NP: gl.constexpr = G // HP
    live, e0, e1, slot, h, bk, ks, de = _dkdv_piece(Blocks, InvPtr, PiecePtr, PieceList, SlotPtr, n_lists, chunk, HKV)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KB, BS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [KB, BS, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=KB)
    mbarrier.init(kv_bar, count=1)
    it0 = e0 * NP
    stop = e1 * NP
    cons = (k_smem, v_smem, q_smem, do_smem, ready, empty, kv_bar, Bias, LSE, Delta, DK, DV, DB, WDK, WDV, WDB,
            QStart, Word, it0, stop, live, slot, bk, ks, de, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
            s_lb, s_lh, s_db_b, s_db_t, s_db_h, qk_scale, sm_scale)
    prod = (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ready, empty, kv_bar, QStart, it0, stop,
            bk, T, ks, h)
    if KB == 2:
        gl.warp_specialize([(_dkdv_consumer, (cons, 0, G, HP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_consumer, (cons, 1, G, HP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_producer, (prod, NP, HP, G, KB, BS, D, STAGES))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_dkdv_consumer, (cons, 0, G, HP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_producer, (prod, NP, HP, G, KB, BS, D, STAGES))], [1], [24])


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


def launch_forward(q, k, v, bias, o, lse, idx, grid: int, hp: int, qk_scale: float, stages: int,
                   in_regs: bool, maxnreg: int | None = None) -> None:
    """Launch ``_fwd_kernel_sm90`` over ``grid`` programs (as the Triton forward's grid); ``bias``:
    ``key_major_bias``'s or ``None``; ``maxnreg``: registers per thread at most (None: the compiler's
    choice; e.g. 168 lets three programs of two ring slots share an SM)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    Bias, s_bb, s_bh = _bias_args(q, bias)
    _fwd_kernel_sm90[(grid,)](
        q, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), Bias, o, lse,
        idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
        *q.stride()[:3], s_bb, s_bh, *o.stride()[:3], lse.stride(0), lse.stride(1), qk_scale,
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None, STAGES=stages,
        IN_REGS=in_regs, num_warps=warps_for(hp * idx.qt), maxnreg=maxnreg)


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
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None, STAGES=stages,
        IN_REGS=in_regs, num_warps=warps_for(hp * idx.qt))


def rows_descriptor(x: torch.Tensor, qt: int, hp: int) -> TensorDescriptor:
    """TMA descriptor over q or dO ``[B, T, Hq, D]`` (any strides with a unit last one), one
    ``[1, qt, hp, D]`` box: the ``qt x hp`` rows of a dK/dV step, token-major."""
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
        *args, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), rows_descriptor(q, idx.qt, hp),
        rows_descriptor(do, idx.qt, hp), T,
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, KB=kb, D=D, HAS_BIAS=has_bias,
        NEED_DB=need_db, STAGES=stages, num_warps=4, maxnreg=dkdv_maxnreg(kb))


def dkdv_maxnreg(kb: int) -> int:
    """Registers per thread at the launch of the warp-specialised dK/dV (the pool its warpgroups share:
    ``kb`` consumer warpgroups + the producer's, 64K registers per SM): one program per SM at two blocks,
    two at one."""
    return 168 if kb == 2 else 128
