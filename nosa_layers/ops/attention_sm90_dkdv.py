"""Hopper (sm90) dK/dV of the block-sparse NOSA attention, warp-specialised in Gluon (FlashAttention-3's
producer / consumer split).

Same programs, pieces, masks and outputs as ``attention_kernels._bwd_dkdv_kernel`` (the portable Triton
kernel): one producer warp loads each step's query and dO rows by TMA into a ring, one consumer
warpgroup per 64-key block computes, and the consumers never wait for each other (a slot is refilled
once every consumer released it), so one warpgroup's exponentials overlap the other's (or the other
program's) tensor-core products. Launched by ``attention_sm90.launch_dkdv`` (inputs and outputs there).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ._common import UNSPECIALIZED
from .attention_kernels import _dkdv_piece  # the dK/dV work item, shared with the Triton kernel
from .attention_sm90_fwd_dq import _row_valid


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
def _dkdv_consumer(a, C: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr, QT: gl.constexpr,
                   BS: gl.constexpr, KB: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr, NEED_DB: gl.constexpr,
                   STAGES: gl.constexpr):
    """Consumer warpgroup ``C`` of the warp-specialised dK/dV: keys ``C * BS ..`` of the group. Per step
    ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued together with the previous step's ``dV += P^T dO``
    and ``dK += dS^T Q``; the previous step's ring slot is released once those have completed. Stores its
    rows of dK, dV, db (or of the piece's partial slot)."""
    (K_SMEM, V_SMEM, q_smem, do_smem, ready, empty, kv_bar, Bias, LSE, Delta, DK, DV, DB, WDK, WDV, WDB, QStart, Word,
     it0, stop, live, slot, bk, ks, de, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh, s_lb, s_lh,
     s_db_b, s_db_t, s_db_h, qk_scale, sm_scale) = a
    NP: gl.constexpr = G // HP
    M: gl.constexpr = HPP * QT
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
    r = offs_m // HPP  # token-major rows: token r of the query tile, head (pack * HP + m % HPP)
    hh = offs_m % HPP  # padding heads (hh >= HP): other heads' rows or zeros in the box, LSE +inf so P = 0
    loff = hh * s_lh + r
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
            rvalid = _row_valid(tok, de, hh, HP, HPP)  # query tiles never cross their document: rows past its end pad
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
                          HKV: gl.constexpr, G: gl.constexpr, HP: gl.constexpr, HPP: gl.constexpr, QT: gl.constexpr,
                          BS: gl.constexpr, KB: gl.constexpr, D: gl.constexpr, HAS_BIAS: gl.constexpr,
                          NEED_DB: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV, db, warp-specialised: the Triton kernel's programs (pieces of inverse lists of
    ``KB * BS``-key groups), partial slots and outputs. One producer warp loads the group's K / V once
    and each step's query and dO rows (list entry x head pack: a ``[QT, HPP, D]`` TMA box each; ``HPP``:
    ``HP`` rounded up to a power of two, the extra heads' rows masked) into a
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
        gl.warp_specialize([(_dkdv_consumer, (cons, 0, G, HP, HPP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_consumer, (cons, 1, G, HP, HPP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_producer, (prod, NP, HP, G, KB, BS, D, STAGES))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_dkdv_consumer, (cons, 0, G, HP, HPP, QT, BS, KB, D, HAS_BIAS, NEED_DB, STAGES)),
                            (_dkdv_producer, (prod, NP, HP, G, KB, BS, D, STAGES))], [1], [24])
