"""Triton kernels of the block-sparse NOSA attention (forward, dQ, dK/dV/db) and index packing.

All kernels work on ``[B, T, H, D]`` tensors (any strides with a contiguous D), one query tile of
``BT = block_size`` tokens per KV block. ``HP`` query heads of one GQA group are packed into the M
dimension of every tile (M = HP * BT). Softmax runs in the log2 domain: ``s2 = log2(e) * (scale *
q.k + b)``; the saved LSE is ``log2(sum exp2(s2))`` per (row, query head), fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _pack_words_kernel(Sel, Tiles, Words, nb, s_sb, s_sh, s_st, HKV: tl.constexpr, BT: tl.constexpr,
                       NBC: tl.constexpr):
    """Words[tile, h, blk] = OR_r (Sel[b, h, q_start + r, blk] << r)."""
    pid = tl.program_id(0)
    tile = pid // HKV
    h = pid % HKV
    b = tl.load(Tiles + tile * 8 + 0)
    qs = tl.load(Tiles + tile * 8 + 1)
    qe = tl.load(Tiles + tile * 8 + 2)
    r = tl.arange(0, BT)
    rmask = (qs + r) < qe
    for c0 in range(0, nb, NBC):
        cols = c0 + tl.arange(0, NBC)
        cm = cols < nb
        ptr = Sel + b.to(tl.int64) * s_sb + h * s_sh + (qs + r)[:, None].to(tl.int64) * s_st + cols[None, :]
        s = tl.load(ptr, mask=rmask[:, None] & cm[None, :], other=0)
        bits = (s != 0).to(tl.int64) << r[:, None].to(tl.int64)
        w = tl.sum(bits, axis=0)  # disjoint bits: sum == OR (wraps correctly at bit 63)
        tl.store(Words + (tile * HKV + h).to(tl.int64) * nb + cols, w, mask=cm)


def pack_words(selected: torch.Tensor, tiles: torch.Tensor, block: int) -> torch.Tensor:
    B, Hkv, T, nb = selected.shape
    sel = selected.contiguous().view(torch.uint8)
    n_tiles = tiles.shape[0]
    words = torch.empty(n_tiles, Hkv, nb, dtype=torch.int64, device=selected.device)
    if n_tiles == 0 or nb == 0:
        return words
    _pack_words_kernel[(n_tiles * Hkv,)](sel, tiles, words, nb, sel.stride(0), sel.stride(1), sel.stride(2),
                                        HKV=Hkv, BT=block, NBC=64)  # one variant for every nb
    return words


@triton.jit
def _query_program(Order, Tiles, HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr):
    """Work item of a query-tile program (forward and dQ).

    Returns its (tile, KV head) entry ``w``, KV head ``h``, batch ``b`` (int64), first query head of
    its pack ``head0``, and per row of the ``[HP*BT]`` tile (token-major: row ``m`` is token
    ``m // HP`` of the tile, head ``head0 + m % HP``): head, token, validity, token-in-tile ``r``;
    plus the tile's first token ``qs`` and its document end ``de``."""
    NP: tl.constexpr = G // HP
    pid = tl.program_id(0)
    pack = pid % NP
    w = tl.load(Order + pid // NP)
    h = w % HKV
    tile = w // HKV
    b = tl.load(Tiles + tile * 8 + 0).to(tl.int64)
    qs = tl.load(Tiles + tile * 8 + 1)
    qe = tl.load(Tiles + tile * 8 + 2)
    de = tl.load(Tiles + tile * 8 + 4)
    offs = tl.arange(0, HP * BT)
    r = offs // HP
    head0 = h * G + pack * HP
    tok = qs + r
    return w, h, b, head0, head0 + offs % HP, tok, tok < qe, qs, de, r


@triton.jit
def _row_mask(word, r, ktok, tok, kvalid):
    """[M, BT] allowed (row, key): the row's bit in the tile's token word, causal, inside the document."""
    bit = ((word >> r.to(tl.int64)) & 1) != 0
    return bit[:, None] & (ktok[None, :] <= tok[:, None]) & kvalid[None, :]


@triton.jit
def _fwd_key_block(q, e, has, KStart, Word, KD, VD, kbase, vbase, koff, voff, bbase, s_kt, s_vt, s_bt, b, h, T_rows,
                   qs, de, tok, r, qk_scale, BT: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                   TMA: tl.constexpr):
    """Forward scores (log2 domain, masked) ``[M, BT]`` and V tile ``[BT, D]`` of list entry ``e``;
    every score is -inf when ``has`` is false (past the end of the list)."""
    FULL: tl.constexpr = -1 if BT == 64 else (1 << BT) - 1
    offs_n = tl.arange(0, BT)
    ks = tl.load(KStart + e, mask=has, other=0)
    word = tl.load(Word + e, mask=has, other=0)
    ktok = ks + offs_n
    kvalid = ktok < de
    if TMA:
        row = (b * T_rows + ks).to(tl.int32)
        k = KD.load([row, h * D])
        v = VD.load([row, h * D])
    else:
        k = tl.load(kbase + ks.to(tl.int64) * s_kt + koff, mask=kvalid[:, None], other=0.0)
        v = tl.load(vbase + ks.to(tl.int64) * s_vt + voff, mask=kvalid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_BIAS:
        bias = tl.load(bbase + ktok.to(tl.int64) * s_bt, mask=kvalid, other=0.0).to(tl.float32)
        s += bias[None, :] * 1.4426950408889634
    if (word != FULL) | (ks == qs):  # partial token word, the diagonal (the only tile past the doc end), or no entry
        s = tl.where(_row_mask(word, r, ktok, tok, kvalid), s, float("-inf"))
        if TMA:
            v = tl.where(kvalid[:, None], v, 0.0)
    return s, v


@triton.jit
def _fwd_kernel(Q, K, V, KD, VD, Bias, O, LSE, Tiles, RowPtr, KStart, Word, Order, T_rows,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                s_ob, s_ot, s_oh, s_lb, s_lh,
                qk_scale,
                HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                HAS_BIAS: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr):
    """One program per (query tile, KV head, pack of HP heads): online softmax over the tile's list
    (``PAIR``: two list entries per step). ``KD``/``VD``: TMA descriptors of K/V as ``[B*T, Hkv*D]``
    (block ``[BT, D]``) when ``TMA``."""
    M: tl.constexpr = HP * BT
    w, h, b, head0, head, tok, rvalid, qs, de, r = _query_program(Order, Tiles, HKV, G, HP, BT)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BT)
    q = tl.load(Q + b * s_qb + tok[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=rvalid[:, None], other=0.0)
    kbase = K + b * s_kb + h * s_kh
    vbase = V + b * s_vb + h * s_vh
    koff = offs_n[:, None] * s_kt + offs_d[None, :]
    voff = offs_n[:, None] * s_vt + offs_d[None, :]
    bbase = Bias + b * s_bb + h * s_bh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    e0 = tl.load(RowPtr + w)
    e1 = tl.load(RowPtr + w + 1)
    STEP: tl.constexpr = 2 if PAIR else 1
    for e in range(e0, e1, STEP):
        s, v = _fwd_key_block(q, e, e < e1, KStart, Word, KD, VD, kbase, vbase, koff, voff, bbase, s_kt, s_vt, s_bt,
                              b, h, T_rows, qs, de, tok, r, qk_scale, BT, D, HAS_BIAS, TMA)
        if PAIR:  # two key blocks per online-softmax step: half the rescales of the accumulator
            s2, v2 = _fwd_key_block(q, e + 1, e + 1 < e1, KStart, Word, KD, VD, kbase, vbase, koff, voff, bbase,
                                    s_kt, s_vt, s_bt, b, h, T_rows, qs, de, tok, r, qk_scale, BT, D, HAS_BIAS, TMA)
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s, 1), tl.max(s2, 1)))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if PAIR:
            p2 = tl.math.exp2(s2 - m_safe[:, None])
            l_i += tl.sum(p2, 1)
            acc += tl.dot(p2.to(v2.dtype), v2)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(O + b * s_ob + tok[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rvalid[:, None])
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=rvalid)


@triton.jit
def _bwd_dq_kernel(Q, K, V, KD, VD, Bias, DO, LSE, Delta, DQ, Tiles, RowPtr, KStart, Word, Order, T_rows,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                   s_ob, s_ot, s_oh, s_lb, s_lh,
                   qk_scale, sm_scale,
                   HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                   HAS_BIAS: tl.constexpr, TMA: tl.constexpr):
    """dQ: same programs and lists as the forward; P recomputed from the saved LSE."""
    M: tl.constexpr = HP * BT
    FULL: tl.constexpr = -1 if BT == 64 else (1 << BT) - 1
    w, h, b, head0, head, tok, rvalid, qs, de, r = _query_program(Order, Tiles, HKV, G, HP, BT)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BT)
    row_off = tok[:, None].to(tl.int64)
    q = tl.load(Q + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=rvalid[:, None], other=0.0)
    do = tl.load(DO + b * s_ob + row_off * s_ot + head[:, None] * s_oh + offs_d[None, :], mask=rvalid[:, None], other=0.0)
    lse = tl.load(LSE + b * s_lb + head * s_lh + tok, mask=rvalid, other=float("inf"))
    delta = tl.load(Delta + b * s_lb + head * s_lh + tok, mask=rvalid, other=0.0)
    kbase = K + b * s_kb + h * s_kh
    vbase = V + b * s_vb + h * s_vh
    koff = offs_n[:, None] * s_kt + offs_d[None, :]
    voff = offs_n[:, None] * s_vt + offs_d[None, :]
    bbase = Bias + b * s_bb + h * s_bh
    dq = tl.zeros([M, D], tl.float32)
    e0 = tl.load(RowPtr + w)
    e1 = tl.load(RowPtr + w + 1)
    for e in range(e0, e1):
        ks = tl.load(KStart + e)
        word = tl.load(Word + e)
        ktok = ks + offs_n
        kvalid = ktok < de
        if TMA:
            row = (b * T_rows + ks).to(tl.int32)
            k = KD.load([row, h * D])
            v = VD.load([row, h * D])
        else:
            k = tl.load(kbase + ks.to(tl.int64) * s_kt + koff, mask=kvalid[:, None], other=0.0)
            v = tl.load(vbase + ks.to(tl.int64) * s_vt + voff, mask=kvalid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_BIAS:
            bias = tl.load(bbase + ktok.to(tl.int64) * s_bt, mask=kvalid, other=0.0).to(tl.float32)
            s += bias[None, :] * 1.4426950408889634
        p = tl.math.exp2(s - lse[:, None])
        if (word != FULL) | (ks == qs):
            p = tl.where(_row_mask(word, r, ktok, tok, kvalid), p, 0.0)
            if TMA:
                k = tl.where(kvalid[:, None], k, 0.0)
                v = tl.where(kvalid[:, None], v, 0.0)
        dp = tl.dot(do, tl.trans(v))
        dsc = p * (dp - delta[:, None])
        dq += tl.dot(dsc.to(k.dtype), k)
    dq = dq * sm_scale
    tl.store(DQ + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rvalid[:, None])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, QD, DOD, Bias, DO, LSE, Delta, DK, DV, DB, WDK, WDV, WDB, Tiles, Items, QStart, Word,
                     Order, T_rows,
                     s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                     s_ob, s_ot, s_oh, s_lb, s_lh, s_db_b, s_db_t, s_db_h,
                     qk_scale, sm_scale,
                     HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                     HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, TMA: tl.constexpr):
    """dK, dV, db: one program per work item (a piece of the inverse list of one (KV block, KV head))
    walks its entries x head packs with K, V, b and fp32 accumulators resident; db is the row sum of
    dS^T (no atomics). A piece of a split list writes fp32 partials ``WDK/WDV [slot, BT, D]``,
    ``WDB [slot, BT]`` (unscaled) for ``_dkdv_reduce_kernel``. ``QD``/``DOD``: TMA descriptors of
    Q/dO as ``[B*T, Hq, D]`` (block ``[BT, HP, D]``) when ``TMA``."""
    NP: tl.constexpr = G // HP
    M: tl.constexpr = HP * BT
    FULL: tl.constexpr = -1 if BT == 64 else (1 << BT) - 1
    item = tl.load(Order + tl.program_id(0))
    w = tl.load(Items + item * 4 + 0)
    e0 = tl.load(Items + item * 4 + 1)
    e1 = tl.load(Items + item * 4 + 2)
    slot = tl.load(Items + item * 4 + 3)
    ktile = w // HKV
    h = w % HKV
    offs_m = tl.arange(0, M)
    r = offs_m // HP  # token-major rows: token r of the query tile, head (pack * HP + m % HP)
    hh = offs_m % HP
    bk = tl.load(Tiles + ktile * 8 + 0).to(tl.int64)
    ks = tl.load(Tiles + ktile * 8 + 1)
    de = tl.load(Tiles + ktile * 8 + 4)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BT)
    ktok = ks + offs_n
    kvalid = ktok < de
    kp = ktok.to(tl.int64)
    k = tl.load(K + bk * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    v = tl.load(V + bk * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(Bias + bk * s_bb + kp * s_bt + h * s_bh, mask=kvalid, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        bias = tl.zeros([BT], tl.float32)
    qbase = Q + bk * s_qb + (h * G) * s_qh
    qoff = offs_d[:, None] + (r * s_qt + hh * s_qh)[None, :]  # [D, M]
    dobase = DO + bk * s_ob + (h * G) * s_oh
    dooff = (r * s_ot + hh * s_oh)[:, None] + offs_d[None, :]  # [M, D]
    lbase = LSE + bk * s_lb + (h * G) * s_lh
    dbase = Delta + bk * s_lb + (h * G) * s_lh
    loff = hh * s_lh + r
    dk = tl.zeros([BT, D], tl.float32)
    dv = tl.zeros([BT, D], tl.float32)
    db = tl.zeros([BT], tl.float32)
    for it in range(e0 * NP, e1 * NP):
        e = it // NP
        pk = it % NP
        qs = tl.load(QStart + e)
        word = tl.load(Word + e)
        tok = qs + r
        rvalid = tok < de  # query tiles never cross their document: rows past its end are padding
        if TMA:
            row = (bk * T_rows + qs).to(tl.int32)
            qT = tl.trans(tl.reshape(QD.load([row, h * G + pk * HP, 0]), [M, D]))
            do = tl.reshape(DOD.load([row, h * G + pk * HP, 0]), [M, D])
        else:
            qT = tl.load(qbase + (qs.to(tl.int64) * s_qt + pk * HP * s_qh) + qoff, mask=rvalid[None, :], other=0.0)
            do = tl.load(dobase + (qs.to(tl.int64) * s_ot + pk * HP * s_oh) + dooff, mask=rvalid[:, None], other=0.0)
        lo = pk * HP * s_lh + qs
        lse = tl.load(lbase + lo + loff, mask=rvalid, other=float("inf"))
        delta = tl.load(dbase + lo + loff, mask=rvalid, other=0.0)
        sT = tl.dot(k, qT) * qk_scale + bias[:, None]
        pT = tl.math.exp2(sT - lse[None, :])
        if (word != FULL) | (qs == ks):
            bit = ((word >> r.to(tl.int64)) & 1) != 0
            allowed = bit[None, :] & (ktok[:, None] <= tok[None, :]) & kvalid[:, None]
            pT = tl.where(allowed, pT, 0.0)
            if TMA:
                qT = tl.where(rvalid[None, :], qT, 0.0)
                do = tl.where(rvalid[:, None], do, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
        if NEED_DB:
            db += tl.sum(dsT, 1)
    if slot < 0:
        _store_dkdv(DK, DV, DB, dk * sm_scale, dv, db, bk, h, kp, kvalid, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                    s_db_b, s_db_t, s_db_h, D, NEED_DB)
    else:
        tile_off = slot.to(tl.int64) * (BT * D) + offs_n[:, None] * D + offs_d[None, :]
        tl.store(WDK + tile_off, dk)
        tl.store(WDV + tile_off, dv)
        if NEED_DB:
            tl.store(WDB + slot.to(tl.int64) * BT + offs_n, db)


@triton.jit
def _store_dkdv(DK, DV, DB, dk, dv, db, bk, h, kp, kvalid, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_db_b, s_db_t, s_db_h,
                D: tl.constexpr, NEED_DB: tl.constexpr):
    offs_d = tl.arange(0, D)
    tl.store(DK + bk * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kvalid[:, None])
    tl.store(DV + bk * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kvalid[:, None])
    if NEED_DB:
        tl.store(DB + bk * s_db_b + kp * s_db_t + h * s_db_h, db, mask=kvalid)


@triton.jit
def _dkdv_reduce_kernel(WDK, WDV, WDB, DK, DV, DB, Tiles, Red, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_db_b, s_db_t,
                        s_db_h, sm_scale, HKV: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, NEED_DB: tl.constexpr):
    """dK, dV, db of a split inverse list: the sum of its pieces' fp32 partials, in slot order."""
    i = tl.program_id(0)
    w = tl.load(Red + i * 3 + 0)
    s0 = tl.load(Red + i * 3 + 1)
    n = tl.load(Red + i * 3 + 2)
    ktile = w // HKV
    h = w % HKV
    bk = tl.load(Tiles + ktile * 8 + 0).to(tl.int64)
    ks = tl.load(Tiles + ktile * 8 + 1)
    de = tl.load(Tiles + ktile * 8 + 4)
    offs_n = tl.arange(0, BT)
    offs_d = tl.arange(0, D)
    ktok = ks + offs_n
    tile_off = offs_n[:, None] * D + offs_d[None, :]
    dk = tl.zeros([BT, D], tl.float32)
    dv = tl.zeros([BT, D], tl.float32)
    db = tl.zeros([BT], tl.float32)
    wdk = WDK + s0.to(tl.int64) * (BT * D) + tile_off
    wdv = WDV + s0.to(tl.int64) * (BT * D) + tile_off
    wdb = WDB + s0.to(tl.int64) * BT + offs_n
    for i in range(0, n):
        dk += tl.load(wdk + i * (BT * D))
        dv += tl.load(wdv + i * (BT * D))
        if NEED_DB:
            db += tl.load(wdb + i * BT)
    _store_dkdv(DK, DV, DB, dk * sm_scale, dv, db, bk, h, ktok.to(tl.int64), ktok < de, s_kb, s_kt, s_kh,
                s_vb, s_vt, s_vh, s_db_b, s_db_t, s_db_h, D, NEED_DB)


@triton.jit
def _bwd_delta_kernel(O, DO, Delta, T, H, s_ob, s_ot, s_oh, s_db, s_dt, s_dh, s_lb, s_lh,
                      BM: tl.constexpr, D: tl.constexpr):
    """Delta[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d] in fp32."""
    t = tl.program_id(0) * BM + tl.arange(0, BM)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_d = tl.arange(0, D)
    tm = t < T
    o = tl.load(O + b * s_ob + t[:, None].to(tl.int64) * s_ot + h * s_oh + offs_d[None, :], mask=tm[:, None], other=0.0)
    do = tl.load(DO + b * s_db + t[:, None].to(tl.int64) * s_dt + h * s_dh + offs_d[None, :], mask=tm[:, None], other=0.0)
    tl.store(Delta + b * s_lb + h * s_lh + t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=tm)
