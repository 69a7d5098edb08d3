"""Triton kernels of the block-sparse NOSA attention: forward, dQ, dK/dV/db and the ordered
reduction of split dK/dV lists.

All kernels work on ``[B, T, H, D]`` tensors (any strides with a contiguous D) and a
``SparseIndex`` (``sparse_index.py``). A query-side program takes one query tile of ``QT`` tokens
with ``HP`` query heads of one KV group: ``M = QT * HPP`` rows, token-major (row ``m`` is token
``m // HPP`` of the tile, head ``m % HPP`` of the pack), where ``HPP`` is ``HP`` rounded up to a power
of two (Triton's tiles are powers of two): the rows of the ``HPP - HP`` padding heads are masked like
rows past a document's end, so any group size runs (G = 3, 5, 6, 7, 9, ...). Key-side steps are KV blocks of ``BS``
tokens. Softmax runs in the log2 domain: ``s2 = log2(e) * (scale * q.k + b)``; the saved LSE is
``log2(sum exp2(s2))`` per (row, query head), fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import UNSPECIALIZED
from .query_layout import _query_rows


@triton.jit
def _query_tile(Blocks, n_tiles, HKV: tl.constexpr, NP: tl.constexpr, S: tl.constexpr, QT: tl.constexpr):
    """Scalar work item of a query-side program (forward and dQ; also the Hopper kernels'), later
    tiles first (longer lists): head pack, KV head ``h``, its (tile, KV head) list ``w`` (int64), batch
    row ``b`` (int64), the first token of the tile's own KV block ``kdiag``, the document end ``de``
    and the tile's first token ``qs``."""
    pid = tl.program_id(0)
    pack = pid % NP
    rest = pid // NP
    h = rest % HKV
    i = n_tiles - 1 - rest // HKV
    c = i // S
    b = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    kdiag = tl.load(Blocks + c * 4 + 1)
    de = tl.load(Blocks + c * 4 + 3)
    return pack, h, (i * HKV + h).to(tl.int64), b, kdiag, de, kdiag + (i % S) * QT


@triton.jit
def _query_tile_subset(Blocks, QTiles, n_tiles, HKV: tl.constexpr, NP: tl.constexpr, S: tl.constexpr,
                       QT: tl.constexpr):
    """``_query_tile`` of a call with query chunks (``query_layout``): programs walk the ``n_tiles`` tiles
    that hold query rows, ``QTiles`` (their global index in the block table's tiles); the list ``w`` is
    that of the program's tile in this compacted order."""
    pid = tl.program_id(0)
    pack = pid % NP
    rest = pid // NP
    h = rest % HKV
    i = n_tiles - 1 - rest // HKV
    gi = tl.load(QTiles + i)
    c = gi // S
    b = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    kdiag = tl.load(Blocks + c * 4 + 1)
    de = tl.load(Blocks + c * 4 + 3)
    return pack, h, (i * HKV + h).to(tl.int64), b, kdiag, de, kdiag + (gi % S) * QT


@triton.jit
def _query_program(Blocks, QTiles, QRow, n_tiles, HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr,
                   HPP: tl.constexpr, QT: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, SUBSET: tl.constexpr):
    """Work item of a query-side program (``_query_tile``; ``_query_tile_subset`` with ``SUBSET``) with its rows.

    Returns its (tile, KV head) list ``w`` (int64), KV head ``h``, batch row ``b`` (int64), per row of
    the ``[HPP*QT]`` tile: query head, token, its query row (the token itself without ``SUBSET``),
    validity (false on padding heads), token-in-tile ``r``; plus the first token of the tile's own KV block
    ``kdiag`` and the document end ``de``."""
    if SUBSET:
        pack, h, w, b, kdiag, de, qs = _query_tile_subset(Blocks, QTiles, n_tiles, HKV, G // HP, S, QT)
    else:
        pack, h, w, b, kdiag, de, qs = _query_tile(Blocks, n_tiles, HKV, G // HP, S, QT)
    offs = tl.arange(0, HPP * QT)
    r = offs // HPP
    hh = offs % HPP
    head = h * G + pack * HP + hh
    tok = qs + r
    rvalid, trow = _query_rows(QRow, tok, tok < de, SUBSET)
    if HPP != HP:
        rvalid = rvalid & (hh < HP)
    return w, h, b, head, tok, trow, rvalid, kdiag, de, r


@triton.jit
def _dkdv_piece(Blocks, InvPtr, PiecePtr, PieceList, SlotPtr, n_lists, chunk, HKV: tl.constexpr):
    """Scalar work item of a dK/dV program (also the Hopper kernel's): one piece of the inverse list of
    a (key group, KV head). Returns whether it is live (programs past the last piece idle), its list
    entries ``[e0, e1)`` (empty when idle), its fp32 partial slot (-1: the list is whole, write dK/dV),
    the KV head ``h``, batch row ``bk`` (int64), the group's first key ``ks`` and the document end ``de``."""
    pid = tl.program_id(0)
    live = pid < tl.load(PiecePtr + n_lists)
    lst = tl.load(PieceList + pid, mask=live, other=0)
    piece = pid - tl.load(PiecePtr + lst)
    slot0 = tl.load(SlotPtr + lst)
    lo = tl.load(InvPtr + lst)
    hi = tl.load(InvPtr + lst + 1)
    e0 = tl.where(slot0 >= 0, lo + piece * chunk, lo)
    e1 = tl.where(slot0 >= 0, tl.minimum(e0 + chunk, hi), hi)
    e1 = tl.where(live, e1, e0)
    c = lst // HKV
    bk = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    return (live, e0, e1, tl.where(slot0 >= 0, slot0 + piece, -1), lst % HKV, bk, tl.load(Blocks + c * 4 + 1),
            tl.load(Blocks + c * 4 + 3))


@triton.jit
def _row_mask(word, r, ktok, tok, kvalid):
    """[M, BS] allowed (row, key): the row's bit in the tile's word, causal, inside the document."""
    bit = ((word >> r.to(word.dtype)) & 1) != 0
    return bit[:, None] & (ktok[None, :] <= tok[:, None]) & kvalid[None, :]


@triton.jit
def _key_side(K, V, Bias, b, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bh, N: tl.constexpr, D: tl.constexpr):
    """Bases of KV head ``h`` of batch row ``b`` in K, V and the bias, and the ``[N, D]`` tile
    offsets of K and V (a list entry's keys are then one scalar offset away)."""
    offs_n = tl.arange(0, N)
    offs_d = tl.arange(0, D)
    return (K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, offs_n[:, None] * s_kt + offs_d[None, :],
            offs_n[:, None] * s_vt + offs_d[None, :], Bias + b * s_bb + h * s_bh)


@triton.jit
def _key_block(q, e, KStart, Word, kbase, vbase, koff, voff, bbase, s_kt, s_vt, s_bt, kdiag, de, tok, r,
               qk_scale, FULL: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """List entry ``e`` of a query-side program (one KV block of ``BS`` keys): masked scores (log2
    domain) ``[M, BS]`` and the K and V tiles ``[BS, D]``."""
    offs_n = tl.arange(0, BS)
    ks = tl.load(KStart + e)
    word = tl.load(Word + e)
    ktok = ks + offs_n
    kvalid = ktok < de
    k = tl.load(kbase + ks.to(tl.int64) * s_kt + koff, mask=kvalid[:, None], other=0.0)
    v = tl.load(vbase + ks.to(tl.int64) * s_vt + voff, mask=kvalid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_BIAS:
        bias = tl.load(bbase + ktok.to(tl.int64) * s_bt, mask=kvalid, other=0.0).to(tl.float32)
        s += bias[None, :] * 1.4426950408889634
    # partial token word, or the tile's own block (the only one that can reach past the doc end)
    if (word != FULL) | (ks == kdiag):
        s = tl.where(_row_mask(word, r, ktok, tok, kvalid), s, float("-inf"))
    return s, k, v


@triton.jit(do_not_specialize=UNSPECIALIZED["_fwd_kernel"])
def _fwd_kernel(Q, K, V, Bias, O, LSE, Blocks, Count, KStart, Word, QTiles, QRow, n_tiles, cap,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale,
                HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, HPP: tl.constexpr, QT: tl.constexpr,
                BS: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, SUBSET: tl.constexpr):
    """One program per (query tile, KV head, pack of HP heads): online softmax over the tile's list
    (one KV block per entry). ``SUBSET``: the queries, outputs and LSE are the rows of the query chunks
    (``query_layout``), the tiles those holding them."""
    S: tl.constexpr = BS // QT
    M: tl.constexpr = HPP * QT
    FULL: tl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    w, h, b, head, tok, trow, rvalid, kdiag, de, r = _query_program(Blocks, QTiles, QRow, n_tiles, HKV, G, HP,
                                                                    HPP, QT, S, BS, SUBSET)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + trow[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=rvalid[:, None], other=0.0)
    kbase, vbase, koff, voff, bbase = _key_side(K, V, Bias, b, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bh,
                                                BS, D)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    n = tl.minimum(tl.load(Count + w), cap)
    for e in range(0, n):
        s, k, v = _key_block(q, w * cap + e, KStart, Word, kbase, vbase, koff, voff, bbase, s_kt, s_vt, s_bt,
                             kdiag, de, tok, r, qk_scale, FULL, BS, HAS_BIAS)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(O + b * s_ob + trow[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rvalid[:, None])
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + b * s_lb + head * s_lh + trow, lse, mask=rvalid)


@triton.jit(do_not_specialize=UNSPECIALIZED["_bwd_dq_kernel"])
def _bwd_dq_kernel(Q, K, V, Bias, DO, LSE, Delta, DQ, Blocks, Count, KStart, Word, QTiles, QRow, n_tiles, cap,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                   s_ob, s_ot, s_oh, s_lb, s_lh, qk_scale, sm_scale,
                   HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, HPP: tl.constexpr, QT: tl.constexpr,
                   BS: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, SUBSET: tl.constexpr):
    """dQ: same programs and lists as the forward; P recomputed from the saved LSE."""
    S: tl.constexpr = BS // QT
    M: tl.constexpr = HPP * QT
    FULL: tl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    w, h, b, head, tok, trow, rvalid, kdiag, de, r = _query_program(Blocks, QTiles, QRow, n_tiles, HKV, G, HP,
                                                                    HPP, QT, S, BS, SUBSET)
    offs_d = tl.arange(0, D)
    row_off = trow[:, None].to(tl.int64)
    q = tl.load(Q + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=rvalid[:, None],
                other=0.0)
    do = tl.load(DO + b * s_ob + row_off * s_ot + head[:, None] * s_oh + offs_d[None, :], mask=rvalid[:, None],
                 other=0.0)
    lse = tl.load(LSE + b * s_lb + head * s_lh + trow, mask=rvalid, other=float("inf"))
    delta = tl.load(Delta + b * s_lb + head * s_lh + trow, mask=rvalid, other=0.0)
    kbase, vbase, koff, voff, bbase = _key_side(K, V, Bias, b, h, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bh,
                                                BS, D)
    dq = tl.zeros([M, D], tl.float32)
    n = tl.minimum(tl.load(Count + w), cap)
    for e in range(0, n):
        s, k, v = _key_block(q, w * cap + e, KStart, Word, kbase, vbase, koff, voff, bbase, s_kt, s_vt, s_bt,
                             kdiag, de, tok, r, qk_scale, FULL, BS, HAS_BIAS)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        dsc = p * (dp - delta[:, None])
        dq += tl.dot(dsc.to(k.dtype), k)
    dq = dq * sm_scale
    tl.store(DQ + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rvalid[:, None])


@triton.jit(do_not_specialize=UNSPECIALIZED["_bwd_dkdv_kernel"])
def _bwd_dkdv_kernel(Q, K, V, Bias, DO, LSE, Delta, DK, DV, DB, WDK, WDV, WDB, Blocks, InvPtr, QStart, Word,
                     PiecePtr, PieceList, SlotPtr, n_lists, chunk,
                     s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                     s_ob, s_ot, s_oh, s_lb, s_lh, s_db_b, s_db_t, s_db_h, qk_scale, sm_scale, QRow,
                     HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, HPP: tl.constexpr, QT: tl.constexpr,
                     BS: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                     NEED_DB: tl.constexpr, SUBSET: tl.constexpr):
    """dK, dV, db: one program per piece of the inverse list of one (key group of ``KB`` KV blocks,
    KV head); it walks its entries x head packs with the group's ``N = KB * BS`` keys, their values,
    bias and fp32 accumulators resident; db is the row sum of dS^T (no atomics). A piece of a split
    list writes fp32 partials ``WDK/WDV [slot, N, D]``, ``WDB [slot, N]`` (unscaled) for
    ``_dkdv_reduce_kernel``; programs past the last piece idle. ``SUBSET``: the list entries' tokens are
    read at their query rows (``QRow``, ``query_layout``)."""
    NP: tl.constexpr = G // HP
    M: tl.constexpr = HPP * QT
    N: tl.constexpr = KB * BS
    FULL: tl.constexpr = -1 if QT >= 32 else (1 << QT) - 1
    live, e0, e1, slot, h, bk, ks, de = _dkdv_piece(Blocks, InvPtr, PiecePtr, PieceList, SlotPtr, n_lists, chunk, HKV)
    offs_m = tl.arange(0, M)
    r = offs_m // HPP  # token-major rows: token r of the query tile, head (pack * HP + m % HPP)
    hh = offs_m % HPP  # padding heads (hh >= HP) are masked rows
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, N)
    ktok = ks + offs_n
    kvalid = ktok < de  # the group's last blocks may lie past its document's end
    kp = ktok.to(tl.int64)
    k = tl.load(K + bk * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    v = tl.load(V + bk * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(Bias + bk * s_bb + kp * s_bt + h * s_bh, mask=kvalid,
                       other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        bias = tl.zeros([N], tl.float32)
    qbase = Q + bk * s_qb + (h * G) * s_qh
    qoff = offs_d[:, None] + (r * s_qt + hh * s_qh)[None, :]  # [D, M]
    dobase = DO + bk * s_ob + (h * G) * s_oh
    dooff = (r * s_ot + hh * s_oh)[:, None] + offs_d[None, :]  # [M, D]
    lbase = LSE + bk * s_lb + (h * G) * s_lh
    dbase = Delta + bk * s_lb + (h * G) * s_lh
    loff = hh * s_lh + r
    dk = tl.zeros([N, D], tl.float32)
    dv = tl.zeros([N, D], tl.float32)
    db = tl.zeros([N], tl.float32)
    for it in range(e0 * NP, e1 * NP):
        e = it // NP
        pk = it % NP
        qs = tl.load(QStart + e)
        word = tl.load(Word + e * KB)  # key n takes the word of block n // BS of the group
        full = word == FULL
        wkey = tl.full([N], 0, word.dtype) + word
        for u in tl.static_range(1, KB):
            wu = tl.load(Word + e * KB + u)
            full &= wu == FULL
            wkey = tl.where(offs_n >= u * BS, wu, wkey)
        tok = qs + r
        # query tiles never cross their document: rows past its end are padding
        rvalid, trow = _query_rows(QRow, tok, tok < de, SUBSET)
        if HPP != HP:
            rvalid = rvalid & (hh < HP)
        if SUBSET:  # rows are the tokens' query rows, one by one
            t64 = trow.to(tl.int64)
            qT = tl.load(qbase + pk * HP * s_qh + offs_d[:, None] + (t64 * s_qt + hh * s_qh)[None, :],
                         mask=rvalid[None, :], other=0.0)
            do = tl.load(dobase + pk * HP * s_oh + (t64 * s_ot + hh * s_oh)[:, None] + offs_d[None, :],
                         mask=rvalid[:, None], other=0.0)
            lo_ = pk * HP * s_lh + hh * s_lh + trow
            lse = tl.load(lbase + lo_, mask=rvalid, other=float("inf"))
            delta = tl.load(dbase + lo_, mask=rvalid, other=0.0)
        else:
            qT = tl.load(qbase + (qs.to(tl.int64) * s_qt + pk * HP * s_qh) + qoff, mask=rvalid[None, :], other=0.0)
            do = tl.load(dobase + (qs.to(tl.int64) * s_ot + pk * HP * s_oh) + dooff, mask=rvalid[:, None],
                         other=0.0)
            lo_ = pk * HP * s_lh + qs
            lse = tl.load(lbase + lo_ + loff, mask=rvalid, other=float("inf"))
            delta = tl.load(dbase + lo_ + loff, mask=rvalid, other=0.0)
        sT = tl.dot(k, qT) * qk_scale + bias[:, None]
        pT = tl.math.exp2(sT - lse[None, :])
        if (full == 0) | (qs < ks + N):
            bit = ((wkey[:, None] >> r[None, :].to(wkey.dtype)) & 1) != 0
            allowed = bit & (ktok[:, None] <= tok[None, :]) & kvalid[:, None]
            pT = tl.where(allowed, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
        if NEED_DB:
            db += tl.sum(dsT, 1)
    if live:
        if slot < 0:
            _store_dkdv(DK, DV, DB, dk * sm_scale, dv, db, bk, h, kp, kvalid, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                        s_db_b, s_db_t, s_db_h, D, NEED_DB)
        else:
            tile_off = slot.to(tl.int64) * (N * D) + offs_n[:, None] * D + offs_d[None, :]
            tl.store(WDK + tile_off, dk)
            tl.store(WDV + tile_off, dv)
            if NEED_DB:
                tl.store(WDB + slot.to(tl.int64) * N + offs_n, db)


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
def _dkdv_reduce_kernel(WDK, WDV, WDB, DK, DV, DB, Blocks, PiecePtr, SlotPtr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                        s_db_b, s_db_t, s_db_h, sm_scale, HKV: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                        NEED_DB: tl.constexpr):
    """dK, dV, db of a split inverse list (``N`` keys of a key group): the sum of its pieces' fp32
    partials, in slot order."""
    lst = tl.program_id(0)
    s0 = tl.load(SlotPtr + lst)
    if s0 >= 0:
        n = tl.load(PiecePtr + lst + 1) - tl.load(PiecePtr + lst)
        c = lst // HKV
        h = lst % HKV
        bk = tl.load(Blocks + c * 4 + 0).to(tl.int64)
        ks = tl.load(Blocks + c * 4 + 1)
        de = tl.load(Blocks + c * 4 + 3)
        offs_n = tl.arange(0, N)
        offs_d = tl.arange(0, D)
        ktok = ks + offs_n
        tile_off = offs_n[:, None] * D + offs_d[None, :]
        dk = tl.zeros([N, D], tl.float32)
        dv = tl.zeros([N, D], tl.float32)
        db = tl.zeros([N], tl.float32)
        wdk = WDK + s0.to(tl.int64) * (N * D) + tile_off
        wdv = WDV + s0.to(tl.int64) * (N * D) + tile_off
        wdb = WDB + s0.to(tl.int64) * N + offs_n
        for i in range(0, n):
            dk += tl.load(wdk + i * (N * D))
            dv += tl.load(wdv + i * (N * D))
            if NEED_DB:
                db += tl.load(wdb + i * N)
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
    do = tl.load(DO + b * s_db + t[:, None].to(tl.int64) * s_dt + h * s_dh + offs_d[None, :], mask=tm[:, None],
                 other=0.0)
    tl.store(Delta + b * s_lb + h * s_lh + t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=tm)
