"""Hopper (sm90) forward with two consumer warpgroups taking turns at the tensor cores (ping-pong).

FlashAttention-3's inter-warpgroup schedule on top of ``attention_sm90._fwd_kernel_sm90``: a program
runs two work items of the default forward (items ``2 * pid`` and ``2 * pid + 1``: the same query tile
of two head packs or KV heads, so lists of similar length), one per warpgroup. Each warpgroup keeps the
default kernel's intra-warpgroup overlap (entry ``e``'s ``Q K_e^T`` in flight with entry ``e - 1``'s
``P V``) and its own TMA ring of K / V slots, refilled by itself; the new part is a pair of mbarriers
(``turn``) passed back and forth, so that one warpgroup issues its products only after the other
issued its own: while one warpgroup's products run, the other computes its softmax, instead of both
warpgroups' exponentials and products colliding as two independent programs do.

Turn ``t`` of a warpgroup issues entry ``t``'s scores and entry ``t - 1``'s ``P V`` (entry 0: scores
only; the turn after the last entry: the last ``P V`` only). Both warpgroups take
``max(n0, n1) + 1`` turns (the one with the shorter list passes its last turns with nothing to issue),
so neither waits for a turn that never comes. Same inputs, lists, outputs and arithmetic (bit for
bit) as the default Hopper forward; opt-in (``CONFIG["sm90"]["fwd"]["pingpong"]``) until measured.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._common import UNSPECIALIZED
from .attention_kernels import _query_tile_at
from .attention_sm90 import (_bias_args, _entry_ahead, _entry_bias, _entry_scores, _kv_ring, _online_softmax,
                             _refill, _store_tile, _tile_operand, kv_descriptor)

# registers per thread of each consumer warpgroup (two warpgroups, 64K registers per SM, one program per SM)
CONSUMER_REGS = 240


@gluon.jit
def _pingpong_item(Blocks, Count, n_tiles, cap, T, n_items, item, HKV: gl.constexpr, NP: gl.constexpr,
                   S: gl.constexpr, QT: gl.constexpr, D: gl.constexpr):
    """Work item ``item`` of the default forward (``attention_sm90._query_program``'s values) and whether
    it exists (the last program's second item may not: then its list is empty and nothing is stored)."""
    live = item < n_items
    pack, h, w, b, kdiag, de, qs = _query_tile_at(gl.minimum(item, n_items - 1), Blocks, n_tiles, HKV, NP, S, QT)
    n = gl.where(live, gl.minimum(gl.load(Count + w), cap), 0)
    return (pack, h, b, kdiag, de, qs, w * cap, n, (b * T).to(gl.int32), h * D, live)


@gluon.jit
def _take_turn(turn, C: gl.constexpr, t):
    """Wait until warpgroup ``C`` may issue its turn ``t``: warpgroup 0 after warpgroup 1's turn t - 1
    (its turn 0 at once: the parity of the phase before the first), warpgroup 1 after warpgroup 0's turn t."""
    if C == 0:
        mbarrier.wait(turn.index(0), (t + 1) & 1)
    else:
        mbarrier.wait(turn.index(1), t & 1)


@gluon.jit
def _pass_turn(turn, C: gl.constexpr):
    """Warpgroup ``C`` has issued its products: the other warpgroup's turn."""
    mbarrier.arrive(turn.index(1 - C), count=1)


@gluon.jit
def _pingpong_consumer(args, work, ring, C: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr,
                       BS: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup ``C``: the default forward's loop over its item's list, each issue of products inside a
    turn; stores its item's rows of o and the LSE."""
    (Q, k_desc, v_desc, Bias, O, LSE, KStart, Word, turn, turns, s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh,
     s_lb, s_lh, qk_scale) = args
    pack, h, b, kdiag, de, qs, base, n, row0, col, live = work
    k_smem, v_smem, bars = ring
    M: gl.constexpr = HP * QT
    FULL: gl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    num_warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_op = _tile_operand(Q, b, s_qb, s_qt, s_qh, qs, de, h, pack, k_desc, G, HP, M, D, a_layout, True, num_warps)
    offs_m = gl.arange(0, M, layout=row_s)
    r = offs_m // HP
    tok = qs + r
    offs_n = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    bbase = Bias + b * s_bb + h * s_bh
    s_zero = gl.zeros([M, BS], gl.float32, s_layout)
    m_i = gl.full([M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M], gl.float32, row_s)
    o = gl.zeros([M, D], gl.float32, o_layout)
    t0 = gl.where(n > 0, n + 1, 0)  # the turns this warpgroup issues products in
    if n > 0:
        ks = gl.load(KStart + base)
        word = gl.load(Word + base)
        bias = _entry_bias(bbase, ks, offs_n, HAS_BIAS)
        ks1 = gl.load(KStart + base + 1, mask=n > 1, other=0)
        word1, bias1, ks2 = _entry_ahead(KStart, Word, bbase, base, n, 0, ks1, offs_n, HAS_BIAS)
        mbarrier.wait(bars.index(0), 0)
        _take_turn(turn, C, 0)
        s_t = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _pass_turn(turn, C)
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
            _take_turn(turn, C, e)
            s_t = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_t = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
            _pass_turn(turn, C)
            s = warpgroup_mma_wait(1, deps=(s_t, ))
            s = _entry_scores(s, ks, word, bias, kdiag, de, tok, r, offs_n, qk_scale, FULL, HAS_BIAS)
            m_i, l_i, p, alpha = _online_softmax(s, m_i, l_i)
            o, p_op = warpgroup_mma_wait(0, deps=(o_t, p_op))
            _refill(k_desc, v_desc, bars, k_smem, v_smem, KStart, base, n, e - 1 + STAGES, ks1, ks2, row0, col,
                    STAGES)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(k_desc.dtype), p_layout)
        _take_turn(turn, C, n)
        o_t = warpgroup_mma(p_op, v_smem.index((n - 1) % STAGES), o, is_async=True)
        _pass_turn(turn, C)
        o = warpgroup_mma_wait(0, deps=(o_t, ))
    for t in range(t0, turns):  # the other warpgroup's list is longer: pass the remaining turns
        _take_turn(turn, C, t)
        _pass_turn(turn, C)

    if live:
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        _store_tile(O, o / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1), b, s_ob, s_ot, s_oh, qs, de, h, pack,
                    G, HP, M, D, o_layout)
        head = h * G + pack * HP + offs_m % HP
        lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(l_safe))
        gl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=tok < de)


@gluon.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"] + ("n_items", ))
def _fwd_kernel_sm90_pingpong(Q, k_desc, v_desc, Bias, O, LSE, Blocks, Count, KStart, Word, n_tiles, cap, T,
                              s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale, n_items,
                              HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr,
                              BS: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                              REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per two work items of the default forward (``n_items`` in all), one warpgroup each."""
    S: gl.constexpr = BS // QT
    NP: gl.constexpr = G // HP
    pid = gl.program_id(0)
    w0 = _pingpong_item(Blocks, Count, n_tiles, cap, T, n_items, 2 * pid, HKV, NP, S, QT, D)
    w1 = _pingpong_item(Blocks, Count, n_tiles, cap, T, n_items, 2 * pid + 1, HKV, NP, S, QT, D)
    ring0 = _kv_ring(k_desc, v_desc, KStart, w0[6], w0[7], w0[8], w0[9], STAGES, BS, D)
    ring1 = _kv_ring(k_desc, v_desc, KStart, w1[6], w1[7], w1[8], w1[9], STAGES, BS, D)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    turns = gl.maximum(w0[7], w1[7]) + 1
    args = (Q, k_desc, v_desc, Bias, O, LSE, KStart, Word, turn, turns, s_qb, s_qt, s_qh, s_bb, s_bh, s_ob, s_ot,
            s_oh, s_lb, s_lh, qk_scale)
    gl.warp_specialize([(_pingpong_consumer, (args, w0, ring0, 0, G, HP, QT, BS, D, HAS_BIAS, STAGES)),
                        (_pingpong_consumer, (args, w1, ring1, 1, G, HP, QT, BS, D, HAS_BIAS, STAGES))],
                       [4], [REGS])


def launch_forward(q, k, v, bias, o, lse, idx, n_items: int, hp: int, qk_scale: float, stages: int) -> None:
    """Launch ``_fwd_kernel_sm90_pingpong`` over ``ceil(n_items / 2)`` programs; ``n_items``: the default
    forward's grid; ``bias``: ``attention_sm90.key_major_bias``'s or ``None``."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    Bias, s_bb, s_bh = _bias_args(q, bias)
    _fwd_kernel_sm90_pingpong[((n_items + 1) // 2,)](
        q, kv_descriptor(k, idx.block), kv_descriptor(v, idx.block), Bias, o, lse,
        idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word, idx.n_tiles, idx.cap, T,
        *q.stride()[:3], s_bb, s_bh, *o.stride()[:3], lse.stride(0), lse.stride(1), qk_scale, n_items,
        HKV=Hkv, G=Hq // Hkv, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None, STAGES=stages,
        REGS=CONSUMER_REGS, num_warps=4, maxnreg=CONSUMER_REGS)
