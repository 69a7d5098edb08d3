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
                                        HKV=Hkv, BT=block, NBC=min(64, triton.next_power_of_2(nb)))
    return words


@triton.jit
def _key_tile(Blk, Word, e, e1, ds, de, jq, r, BT: tl.constexpr, PAIR: tl.constexpr):
    """Keys of list entry ``e`` (and ``e + 1`` when PAIR): token ids, validity, whether the
    tile needs masking, and the per-(row, key) selection bit (only meaningful when masked)."""
    FULL: tl.constexpr = -1 if BT == 64 else (1 << BT) - 1
    BN: tl.constexpr = BT * 2 if PAIR else BT
    offs_n = tl.arange(0, BN)
    j = tl.load(Blk + e)
    word = tl.load(Word + e)
    if PAIR:
        has2 = (e + 1) < e1
        j2 = tl.load(Blk + e + 1, mask=has2, other=0)
        w2 = tl.load(Word + e + 1, mask=has2, other=0)
        second = offs_n >= BT
        ktok = ds + tl.where(second, j2, j) * BT + (offs_n % BT)
        kvalid = (ktok < de) & (has2 | (offs_n < BT))
        need = (word != FULL) | (j == jq) | (w2 != FULL) | (j2 == jq) | (e + 1 >= e1)
        wsel = tl.where(second, w2, word)
        bit = ((wsel[None, :] >> r[:, None].to(tl.int64)) & 1) != 0
    else:
        ktok = ds + j * BT + offs_n
        kvalid = ktok < de
        need = (word != FULL) | (j == jq)
        bit = (((word >> r.to(tl.int64)) & 1) != 0)[:, None] & (offs_n >= 0)[None, :]
    return ktok, kvalid, need, bit


@triton.jit
def _tile_rows(Tiles, tile, BT: tl.constexpr, HP: tl.constexpr):
    b = tl.load(Tiles + tile * 8 + 0)
    qs = tl.load(Tiles + tile * 8 + 1)
    qe = tl.load(Tiles + tile * 8 + 2)
    ds = tl.load(Tiles + tile * 8 + 3)
    de = tl.load(Tiles + tile * 8 + 4)
    jq = tl.load(Tiles + tile * 8 + 5)
    offs = tl.arange(0, HP * BT)
    r = offs % BT
    hh = offs // BT
    return b, qs, qe, ds, de, jq, r, hh


@triton.jit
def _query_program(Order, Tiles, HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr):
    """Work item of a query-tile program (forward and dQ): its (tile, KV head) entry ``w``, KV head
    ``h``, batch ``b`` (int64), the ``[HP*BT]`` query heads / tokens / validity of its rows, and the
    tile's document span and row layout for ``_key_tile``."""
    NP: tl.constexpr = G // HP
    pid = tl.program_id(0)
    pack = pid % NP
    w = tl.load(Order + pid // NP)
    h = w % HKV
    b, qs, qe, ds, de, jq, r, hh = _tile_rows(Tiles, w // HKV, BT, HP)
    tok = qs + r
    return w, h, b.to(tl.int64), h * G + pack * HP + hh, tok, tok < qe, ds, de, jq, r


@triton.jit
def _fwd_kernel(Q, K, V, Bias, O, LSE, Tiles, RowPtr, Blk, Word, Order,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                s_ob, s_ot, s_oh, s_lb, s_lh,
                qk_scale,
                HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                HAS_BIAS: tl.constexpr, PAIR: tl.constexpr):
    M: tl.constexpr = HP * BT
    w, h, b, head, tok, rvalid, ds, de, jq, r = _query_program(Order, Tiles, HKV, G, HP, BT)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + tok[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=rvalid[:, None], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    STEP: tl.constexpr = 2 if PAIR else 1
    e0 = tl.load(RowPtr + w)
    e1 = tl.load(RowPtr + w + 1)
    for e in range(e0, e1, STEP):
        ktok, kvalid, need, bit = _key_tile(Blk, Word, e, e1, ds, de, jq, r, BT, PAIR)
        kp = ktok.to(tl.int64)
        k = tl.load(K + b * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        v = tl.load(V + b * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_BIAS:
            bias = tl.load(Bias + b * s_bb + kp * s_bt + h * s_bh, mask=kvalid, other=0.0).to(tl.float32)
            s += bias[None, :] * 1.4426950408889634
        if need:
            allowed = bit & (ktok[None, :] <= tok[:, None]) & kvalid[None, :]
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(O + b * s_ob + tok[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rvalid[:, None])
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + b * s_lb + head * s_lh + tok, lse, mask=rvalid)


@triton.jit
def _bwd_dq_kernel(Q, K, V, Bias, DO, LSE, Delta, DQ, Tiles, RowPtr, Blk, Word, Order,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                   s_ob, s_ot, s_oh, s_lb, s_lh,
                   qk_scale, sm_scale,
                   HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PAIR: tl.constexpr):
    M: tl.constexpr = HP * BT
    w, h, b, head, tok, rvalid, ds, de, jq, r = _query_program(Order, Tiles, HKV, G, HP, BT)
    offs_d = tl.arange(0, D)
    row_off = tok[:, None].to(tl.int64)
    q = tl.load(Q + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=rvalid[:, None], other=0.0)
    do = tl.load(DO + b * s_ob + row_off * s_ot + head[:, None] * s_oh + offs_d[None, :], mask=rvalid[:, None], other=0.0)
    lse = tl.load(LSE + b * s_lb + head * s_lh + tok, mask=rvalid, other=float("inf"))
    delta = tl.load(Delta + b * s_lb + head * s_lh + tok, mask=rvalid, other=0.0)
    dq = tl.zeros([M, D], tl.float32)
    STEP: tl.constexpr = 2 if PAIR else 1
    e0 = tl.load(RowPtr + w)
    e1 = tl.load(RowPtr + w + 1)
    for e in range(e0, e1, STEP):
        ktok, kvalid, need, bit = _key_tile(Blk, Word, e, e1, ds, de, jq, r, BT, PAIR)
        kp = ktok.to(tl.int64)
        k = tl.load(K + b * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        v = tl.load(V + b * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_BIAS:
            bias = tl.load(Bias + b * s_bb + kp * s_bt + h * s_bh, mask=kvalid, other=0.0).to(tl.float32)
            s += bias[None, :] * 1.4426950408889634
        p = tl.math.exp2(s - lse[:, None])
        if need:
            allowed = bit & (ktok[None, :] <= tok[:, None]) & kvalid[None, :]
            p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        dsc = p * (dp - delta[:, None])
        dq += tl.dot(dsc.to(k.dtype), k)
    dq = dq * sm_scale
    tl.store(DQ + b * s_qb + row_off * s_qt + head[:, None] * s_qh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rvalid[:, None])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, Bias, DO, LSE, Delta, DK, DV, DB, Tiles, ColPtr, QTile, Word, Order,
                     s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
                     s_ob, s_ot, s_oh, s_lb, s_lh, s_db_b, s_db_t, s_db_h,
                     qk_scale, sm_scale,
                     HKV: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                     HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr):
    NP: tl.constexpr = G // HP
    M: tl.constexpr = HP * BT
    pid = tl.program_id(0)
    w = tl.load(Order + pid)
    ktile = w // HKV
    h = w % HKV
    offs_m = tl.arange(0, M)
    r = offs_m % BT
    hh = offs_m // BT
    bk = tl.load(Tiles + ktile * 8 + 0).to(tl.int64)
    ks = tl.load(Tiles + ktile * 8 + 1)
    ke = tl.load(Tiles + ktile * 8 + 2)
    jk = tl.load(Tiles + ktile * 8 + 5)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BT)
    ktok = ks + offs_n
    kvalid = ktok < ke
    kp = ktok.to(tl.int64)
    k = tl.load(K + bk * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    v = tl.load(V + bk * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(Bias + bk * s_bb + kp * s_bt + h * s_bh, mask=kvalid, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        bias = tl.zeros([BT], tl.float32)
    dk = tl.zeros([BT, D], tl.float32)
    dv = tl.zeros([BT, D], tl.float32)
    db = tl.zeros([BT], tl.float32)
    FULL: tl.constexpr = -1 if BT == 64 else (1 << BT) - 1
    e0 = tl.load(ColPtr + w)
    e1 = tl.load(ColPtr + w + 1)
    for it in range(e0 * NP, e1 * NP):
        e = it // NP
        pk = it % NP
        qt = tl.load(QTile + e)
        word = tl.load(Word + e)
        qs = tl.load(Tiles + qt * 8 + 1)
        qe = tl.load(Tiles + qt * 8 + 2)
        jq = tl.load(Tiles + qt * 8 + 5)
        tok = qs + r
        rvalid = tok < qe
        row_off = tok[None, :].to(tl.int64)
        head = h * G + pk * HP + hh
        qT = tl.load(Q + bk * s_qb + row_off * s_qt + head[None, :] * s_qh + offs_d[:, None],
                     mask=rvalid[None, :], other=0.0)  # [D, M]
        do = tl.load(DO + bk * s_ob + tok[:, None].to(tl.int64) * s_ot + head[:, None] * s_oh + offs_d[None, :],
                     mask=rvalid[:, None], other=0.0)  # [M, D]
        lse = tl.load(LSE + bk * s_lb + head * s_lh + tok, mask=rvalid, other=float("inf"))
        delta = tl.load(Delta + bk * s_lb + head * s_lh + tok, mask=rvalid, other=0.0)
        sT = tl.dot(k, qT) * qk_scale + bias[:, None]
        pT = tl.math.exp2(sT - lse[None, :])
        if (word != FULL) | (jq == jk):
            bit = ((word >> r.to(tl.int64)) & 1) != 0
            allowed = bit[None, :] & (ktok[:, None] <= tok[None, :]) & kvalid[:, None]
            pT = tl.where(allowed, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
        if NEED_DB:
            db += tl.sum(dsT, 1)
    dk = dk * sm_scale
    tl.store(DK + bk * s_kb + kp[:, None] * s_kt + h * s_kh + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kvalid[:, None])
    tl.store(DV + bk * s_vb + kp[:, None] * s_vt + h * s_vh + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kvalid[:, None])
    if NEED_DB:
        tl.store(DB + bk * s_db_b + kp * s_db_t + h * s_db_h, db, mask=kvalid)


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
