"""Hopper (sm90) forward that takes two list entries (128 keys) per online-softmax step: the default
forward on Hopper for 64-row query tiles.

Same programs, lists, masks and outputs as ``attention_sm90_fwd_dq._fwd_kernel_sm90`` (one list entry, 64
keys, per step, which stays for 128-row tiles and as ``keys_per_step = 64``); what changes is the step.
The two K blocks of a pair of entries ``(2j, 2j + 1)`` arrive by TMA side by side in shared memory, so
the pair's scores are one ``[M, 128]`` product ``Q K^T`` and its ``P V`` one product over 128 keys, the
shape of a dense kernel's step (FlashAttention-3 takes 128-176 keys per step at head dim 128), with one
row max, one rescale of the output accumulator and one row sum per pair. Measured on the H200
(``python -m bench.attention --fwd-sweep``): 6% faster than one entry per step at 32K/32 on the P1 lists, 3-5%
on real selections; two 64-key products per pair instead of one 128-key product gained nothing, so the
width of the product, not the softmax's per-step work, is what pays.

The K and V pairs come into separate buffers: one pair's K, refilled with the next pair's as soon as
its scores are done, and two pairs' V (the previous pair's read by its ``P V`` while this pair's
arrive), refilled once that product is done: 96 KB at head dim 128, two programs per SM as the default
forward. An odd list's last pair has a second entry with no keys (key start 0, a valid block, and mask
word 0: every score -inf, probability 0).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ._common import UNSPECIALIZED
from .attention_sm90_fwd_dq import _online_softmax, _query_program, _store_forward, _tile_operand


@gluon.jit
def _issue_pair(desc, bar, smem, ksa, ksb, row0, col, BS: gl.constexpr, ok):
    """TMA loads of two K or V blocks (keys from ``ksa`` and ``ksb``) into the halves of ``smem``
    ``[2 * BS, D]``, one barrier for both (skipped unless ``ok``)."""
    mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [row0 + ksa, col], bar, smem.slice(0, BS), pred=ok)
    tma.async_copy_global_to_shared(desc, [row0 + ksb, col], bar, smem.slice(BS, BS), pred=ok)


@gluon.jit
def _pair_keys(ksa, ksb, offs_n, BS: gl.constexpr):
    """Key positions ``[2 * BS]`` of a pair: entry a's block, then entry b's."""
    return gl.where(offs_n < BS, ksa + offs_n, ksb + offs_n - BS)


@gluon.jit
def _pair_bias(bbase, ksa, ksb, offs_n, BS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The bias ``[2 * BS]`` of a pair's keys (zero without a bias), as ``attention_sm90_fwd_dq._entry_bias``."""
    if HAS_BIAS:
        return gl.load(bbase + _pair_keys(ksa, ksb, offs_n, BS))
    else:
        return offs_n.to(gl.float32) * 0.0


@gluon.jit
def _pair_scores(s, ksa, ksb, wa, wb, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL: gl.constexpr,
                 BS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Scores ``[M, 2 * BS]`` of a pair in the log2 domain: ``attention_sm90_fwd_dq._entry_scores`` with each
    half's mask word and key positions."""
    if HAS_BIAS:
        s = s * qk_scale + gl.expand_dims(bias, 0)
    else:
        s = s * qk_scale
    if (wa != FULL) | (wb != FULL) | (ksa == kdiag) | (ksb == kdiag):
        ktok = _pair_keys(ksa, ksb, offs_n, BS)
        word = gl.where(offs_n < BS, wa, wb)
        bit = ((gl.expand_dims(word, 0) >> gl.expand_dims(r.to(word.dtype), 1)) & 1) != 0
        allowed = bit & (gl.expand_dims(ktok, 0) <= gl.expand_dims(tok, 1)) & gl.expand_dims(ktok < de, 0)
        s = gl.where(allowed, s, float("-inf"))
    return s


@gluon.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"])
def _fwd_kernel_sm90_pairs(Q, k_desc, v_desc, Bias, O, LSE, Blocks, Count, KStart, Word, n_tiles, cap, T,
                           s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale,
                           HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr,
                           QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr,
                           num_warps: gl.constexpr):
    """One program per (query tile, KV head, pack of HP heads), as the default Hopper forward; per step
    a pair of list entries: one ``[M, 2 * BS]`` score product and one ``P V`` product over its keys."""
    M: gl.constexpr = HPP * QT
    S: gl.constexpr = BS // QT
    NP: gl.constexpr = G // HP
    W: gl.constexpr = 2 * BS
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, W, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pack, h, b, kdiag, de, qs, base, n, row0, col = _query_program(Blocks, Count, n_tiles, cap, T, HKV, NP, S, QT, D)
    npairs = (n + 1) // 2
    n2 = 2 * npairs
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [W, D], k_desc.layout)  # one pair's K
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, W, D], v_desc.layout)  # two pairs' V
    kbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kbar, count=1)
    mbarrier.init(vbar.index(0), count=1)
    mbarrier.init(vbar.index(1), count=1)
    ks0 = gl.load(KStart + base)
    ks1 = gl.load(KStart + base + 1, mask=1 < n, other=0)
    ksa1 = gl.load(KStart + base + 2, mask=2 < n, other=0)
    ksb1 = gl.load(KStart + base + 3, mask=3 < n, other=0)
    _issue_pair(k_desc, kbar, k_smem, ks0, ks1, row0, col, BS, n > 0)
    _issue_pair(v_desc, vbar.index(0), v_smem.index(0), ks0, ks1, row0, col, BS, n > 0)
    _issue_pair(v_desc, vbar.index(1), v_smem.index(1), ksa1, ksb1, row0, col, BS, 2 < n2)

    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, HPP, M, D, a_layout, True,
                         num_warps)
    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HPP
    tok = qs + r
    offs_n = gl.arange(0, W, layout=gl.SliceLayout(0, s_layout))
    bbase = Bias + b * s_bb + h * s_bh
    s_zero = gl.zeros([M, W], gl.float32, s_layout)
    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M], gl.float32, row_s)
    o = gl.zeros([M, D], gl.float32, o_layout)
    if n > 0:
        ksa = ks0
        ksb = ks1
        wa = gl.load(Word + base)
        wb = gl.load(Word + base + 1, mask=1 < n, other=0)
        bias = _pair_bias(bbase, ksa, ksb, offs_n, BS, HAS_BIAS)
        mbarrier.wait(kbar, 0)
        s_t = warpgroup_mma(q_op, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_t, ))
        _issue_pair(k_desc, kbar, k_smem, ksa1, ksb1, row0, col, BS, 2 < n2)  # pair 1's K
        s = _pair_scores(s, ksa, ksb, wa, wb, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, BS, HAS_BIAS)
        m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
        p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        for j in range(1, npairs):
            a = 2 * j
            ksa, ksb = ksa1, ksb1  # pair j's, loaded during pair j - 1
            wa = gl.load(Word + base + a)
            wb = gl.load(Word + base + a + 1, mask=a + 1 < n, other=0)
            bias = _pair_bias(bbase, ksa, ksb, offs_n, BS, HAS_BIAS)
            ksa1 = gl.load(KStart + base + a + 2, mask=a + 2 < n, other=0)
            ksb1 = gl.load(KStart + base + a + 3, mask=a + 3 < n, other=0)
            vp = (j - 1) % 2  # pair j - 1's V buffer
            mbarrier.wait(kbar, j & 1)
            mbarrier.wait(vbar.index(vp), ((j - 1) // 2) & 1)
            s_t = warpgroup_mma(q_op, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_t = warpgroup_mma(p_op, v_smem.index(vp), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_t, ))
            _issue_pair(k_desc, kbar, k_smem, ksa1, ksb1, row0, col, BS, a + 2 < n2)  # pair j + 1's K
            s = _pair_scores(s, ksa, ksb, wa, wb, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, BS, HAS_BIAS)
            m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
            o, p_op = warpgroup_mma_wait(0, deps=(o_t, p_op))
            _issue_pair(v_desc, vbar.index(vp), v_smem.index(vp), ksa1, ksb1, row0, col, BS, a + 2 < n2)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        last = npairs - 1
        mbarrier.wait(vbar.index(last % 2), (last // 2) & 1)
        o_t = warpgroup_mma(p_op, v_smem.index(last % 2), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o_t, ))
    mbarrier.invalidate(kbar)
    mbarrier.invalidate(vbar.index(0))
    mbarrier.invalidate(vbar.index(1))

    _store_forward(O, LSE, o, m_i, l_i, b, s_ob, s_ot, s_oh, s_lb, s_lh, qs, de, h, pack, offs_m, tok, G, HP, HPP, M, D,
                   o_layout)
