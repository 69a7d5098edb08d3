"""Hopper (sm90) forward and dQ of the block-sparse NOSA attention, one list entry per step, scheduled by
hand in Gluon, and the building blocks they share with the pair forward (``attention_sm90_pairs``).

Same programs, lists, masks and outputs as ``attention_kernels._fwd_kernel`` and ``_bwd_dq_kernel`` (the
portable Triton kernels, which stay the reference fast path and the default elsewhere), with what
Triton's own scheduling does not give on Hopper:

- K/V blocks arrive by TMA into a ring of ``STAGES`` shared-memory slots, each guarded by an
  mbarrier, refilled as soon as the product that read it has completed;
- the tensor-core products are asynchronous (wgmma) and overlapped inside the warpgroup: entry
  ``e``'s scores ``Q K_e^T`` and entry ``e - 1``'s ``P V`` are in flight together, so the softmax of
  entry ``e`` runs while the tensor cores add ``P_{e-1} V_{e-1}`` (FlashAttention-3's intra-warpgroup
  overlap). Triton places the ``P V`` product right before its use and waits for it at once. The dQ
  kernel likewise keeps ``dS_{e-1} K_{e-1}`` in flight behind ``Q K_e^T`` and ``dO V_e^T``;
- a list entry's small loads (key start, mask word, the bias of its keys) are issued one entry ahead,
  so their latency hides behind the previous entry's products, and the bias is read from a key-major
  copy in log2 units (``attention_sm90.key_major_bias``: 64 consecutive values, no mask).

Launched by ``attention_sm90.launch_forward`` / ``launch_dq`` (inputs, layouts and outputs there).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._common import UNSPECIALIZED
from .attention_kernels import _query_tile  # the query-tile work item, shared with the Triton kernels


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
def _row_valid(tok, de, hh, HP: gl.constexpr, HPP: gl.constexpr):
    """Rows that hold a query: inside the document, and of a real head of the pack (``hh < HP``; a compile-time
    no-op where the pack is a power of two, ``HPP == HP``)."""
    if HPP == HP:
        return tok < de
    else:
        return (tok < de) & (hh < HP)


@gluon.jit
def _tile_operand(X, b, s_xb, s_xt, s_xh, qs, de, h, pack, k_desc, G: gl.constexpr, HP: gl.constexpr,
                  HPP: gl.constexpr, M: gl.constexpr, D: gl.constexpr, op_layout: gl.constexpr,
                  IN_REGS: gl.constexpr, num_warps: gl.constexpr):
    """The query tile's rows of ``X`` (q or dO: row m = token m // HPP, head pack * HP + m % HPP; rows of
    the padding heads, m % HPP >= HP, are zeros) as the A operand of a wgmma: registers in ``op_layout``,
    or shared memory in the K tiles' layout."""
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, ld_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    tok = qs + offs_m // HPP
    hh = offs_m % HPP
    head = h * G + pack * HP + hh
    x = gl.load(X + b * s_xb + gl.expand_dims(tok.to(gl.int64) * s_xt + head * s_xh, 1) + gl.expand_dims(offs_d, 0),
                mask=gl.expand_dims(_row_valid(tok, de, hh, HP, HPP), 1), other=0.0)
    if IN_REGS:
        return gl.convert_layout(x, op_layout)
    else:
        out = gl.allocate_shared_memory(x.dtype, [M, D], k_desc.layout, x)
        fence_async_shared()
        return out


@gluon.jit
def _store_tile(X, x, b, s_xb, s_xt, s_xh, qs, de, h, pack, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr,
                M: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    """Store ``x`` ``[M, D]`` (in ``layout``) to the query tile's rows of ``X`` (o or dq; row m = token
    m // HPP, head pack * HP + m % HPP), rows past the document end and of padding heads skipped:
    ``_tile_operand``'s inverse."""
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    tok = qs + offs_m // HPP
    hh = offs_m % HPP
    head = h * G + pack * HP + hh
    gl.store(X + b * s_xb + gl.expand_dims(tok.to(gl.int64) * s_xt + head * s_xh, 1) + gl.expand_dims(offs_d, 0),
             x.to(X.dtype.element_ty), mask=gl.expand_dims(_row_valid(tok, de, hh, HP, HPP), 1))


@gluon.jit
def _store_forward(O, LSE, o, m_i, l_i, b, s_ob, s_ot, s_oh, s_lb, s_lh, qs, de, h, pack, offs_m, tok, G: gl.constexpr,
                   HP: gl.constexpr, HPP: gl.constexpr, M: gl.constexpr, D: gl.constexpr, o_layout: gl.constexpr):
    """A forward program's outputs: o = acc / l ``[M, D]`` (``_store_tile``) and the base-2 LSE of its rows
    (``offs_m`` / ``tok``: the rows and their tokens; ``inf`` on rows that attended to no key)."""
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    _store_tile(O, o / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1), b, s_ob, s_ot, s_oh,
                qs, de, h, pack, G, HP, HPP, M, D, o_layout)
    hh = offs_m % HPP
    head = h * G + pack * HP + hh
    lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(l_safe))
    gl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=_row_valid(tok, de, hh, HP, HPP))


@gluon.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"])
def _fwd_kernel_sm90(Q, k_desc, v_desc, Bias, O, LSE, Blocks, Count, KStart, Word, n_tiles, cap, T,
                     s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale,
                     HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr, QT: gl.constexpr,
                     BS: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                     IN_REGS: gl.constexpr,
                     num_warps: gl.constexpr):
    """One program per (query tile, KV head, pack of HP heads), later tiles first, as the Triton kernel."""
    M: gl.constexpr = HPP * QT
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

    # the query tile: row m is token m // HPP of the tile, head pack * HP + m % HPP of the KV group
    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, HPP, M, D, a_layout, IN_REGS,
                         num_warps)

    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HPP
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

    _store_forward(O, LSE, o, m_i, l_i, b, s_ob, s_ot, s_oh, s_lb, s_lh, qs, de, h, pack, offs_m, tok, G, HP, HPP, M, D,
                   o_layout)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_bwd_dq_kernel"])
def _bwd_dq_kernel_sm90(Q, DO, k_desc, v_desc, Bias, LSE, Delta, DQ, Blocks, Count, KStart, Word, n_tiles, cap, T,
                        s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale, sm_scale,
                        HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr,
                        QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr,
                        STAGES: gl.constexpr, IN_REGS: gl.constexpr,
                        num_warps: gl.constexpr):
    """dQ: the forward's programs and lists; P recomputed from the saved LSE. Per entry three products:
    ``S = Q K^T`` and ``dP = dO V^T`` (issued together), then ``dQ += dS K`` left in flight until the
    next entry's ``dS`` is ready."""
    M: gl.constexpr = HPP * QT
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
    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, HPP, M, D, a_layout, IN_REGS,
                         num_warps)
    do_op = _tile_operand(DO, b, s_ob, s_ot, s_oh, qs, de, h, pack, k_desc, G, HP, HPP, M, D, a_layout, IN_REGS,
                          num_warps)

    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HPP
    tok = qs + r
    hh = offs_m % HPP
    head = h * G + pack * HP + hh
    rvalid = _row_valid(tok, de, hh, HP, HPP)  # padding heads: LSE +inf, so their P and dS are 0
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

    _store_tile(DQ, dq * sm_scale, b, s_qb, s_qt, s_qh, qs, de, h, pack, G, HP, HPP, M, D, o_layout)
