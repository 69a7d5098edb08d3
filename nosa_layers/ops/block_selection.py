"""NOSA block selection on GPU: Triton scoring kernels + one fused exact (tie-aware) top-k kernel.

Pipeline (``select_blocks`` semantics, see ``nosa_layers/selection.py``), every kernel one program
per KV block of the batch's block table (``layout.py``), so a packed batch of any number of
documents takes one launch per kernel and no host synchronisation:

1. ``_compress_kernel``: the ``R = block / stride`` windows that start in each block: mean-pooled
   keys ``kc [n_blocks * R, Hkv, D]`` (inputs' dtype) and eviction scores ``ws [n_blocks * R, Hkv]``
   (fp32). Window ``w`` of a document sits at row ``first_block * R + w``.
2. ``_sel_lse_kernel``: per (token, query head) log2-sum-exp2 of the causal scores against the
   visible compressed keys (flash-style, nothing materialised).
3. ``_sel_block_kernel``: per (block of query rows, KV head) recomputes the scores for the G heads
   of the group, sums the probabilities over heads and max-pools them straight into block scores
   (own windows of a block + the ``E`` trailing windows of the block before; with ``E = 1``, the
   default geometry, that window is the previous block's last own window, taken from the same
   products), forced blocks +inf:
   ``[B, Hkv, T, nb]`` fp32 for the blocks ``m <= qb`` of each row (later columns are not written).
4. ``topk.select_from_block_scores``: the eviction scores pooled per block (and, for block
   ``qb - 1``, over the windows each row sees) and both top-k stages (query-aware, then eviction
   fill) in one kernel; writes the bool mask, ties to the LOWER block index exactly as the
   reference's stable sort.

The probabilities come from tensor-core dot products in the inputs' dtype (fp32 accumulate), so
block scores can differ from the fp32 reference by rounding; selections then differ only where two
block scores are within that rounding (near ties).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.selection import check_inputs

from ._common import LOG2E, UNSPECIALIZED, check_device
from .launch import SEL_CONFIG
from .layout import BlockLayout, block_layout
from .query_layout import QueryLayout, _query_rows, no_rows, query_layout
from .topk import select_from_block_scores


@triton.jit
def _block_row(Blocks, c, BS: tl.constexpr):
    """Block ``c`` of the table: batch row (int64), first token, document start / end, index in its
    document, and the table index of the document's first block."""
    b = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    ks = tl.load(Blocks + c * 4 + 1)
    ds = tl.load(Blocks + c * 4 + 2)
    de = tl.load(Blocks + c * 4 + 3)
    j = (ks - ds) // BS
    return b, ks, ds, de, j, c - j


@triton.jit
def _compress_kernel(K, S, Blocks, KC, WS, s_kb, s_kt, s_kh, s_sb, s_st, s_sh, s_cw, s_ch, s_ww,
                     HAS_SCORE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KS: tl.constexpr,
                     ST: tl.constexpr, R: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    b, ks, ds, de, j, c0 = _block_row(Blocks, c, BS)
    offs_t = tl.arange(0, KS)
    offs_d = tl.arange(0, D)
    nw = tl.where(de - ds >= KS, (de - ds - KS) // ST + 1, 0)
    for r in tl.static_range(R):
        w = j * R + r
        ok = w < nw
        t = (ds + w * ST + offs_t).to(tl.int64)
        x = tl.load(K + b * s_kb + t[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=ok, other=0.0)
        kc = tl.sum(x.to(tl.float32), axis=0) / KS
        row = (c * R + r).to(tl.int64)
        tl.store(KC + row * s_cw + h * s_ch + offs_d, kc.to(KC.dtype.element_ty))
        if HAS_SCORE:
            sc = tl.load(S + b * s_sb + t * s_st + h * s_sh, mask=ok, other=0.0)
            tl.store(WS + row * s_ww + h, tl.sum(sc.to(tl.float32), axis=0) / KS)


@triton.jit
def _lse_step(s, m_i, l_i):
    """One online log2-sum-exp2 step over the scores ``s [rows, windows]`` (masked ones ``-inf``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(s - m_safe[:, None]), 1)
    return m_new, l_i


@triton.jit
def _sel_lse_kernel(Q, KC, Blocks, LSE, QRow, Live, s_qb, s_qt, s_qh, s_cw, s_ch, s_lb, s_lh, qk_scale, covered,
                    G: tl.constexpr, HP: tl.constexpr, BW: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    KS: tl.constexpr, ST: tl.constexpr, R: tl.constexpr, SUBSET: tl.constexpr):
    """LSE of each (token, query head) of block ``c`` over the visible compressed keys, for ``HP``
    query heads of one KV group (``HP * BS`` rows, head-major: one compressed-key tile feeds them
    all); nothing for blocks ``j < covered`` (the budget takes every block their rows see: no score
    is read). ``SUBSET``: the queries are the rows ``QRow`` maps tokens to (``query_layout``); blocks
    without one (``Live``) return at once."""
    c = tl.num_programs(0) - 1 - tl.program_id(0)  # later blocks (longer rows) first: no long tail
    head0 = tl.program_id(1) * HP
    h = head0 // G
    b, ks, ds, de, j, c0 = _block_row(Blocks, c, BS)
    if j < covered:
        return
    if SUBSET:
        if tl.load(Live + c) == 0:
            return
    offs_m = tl.arange(0, HP * BS)
    head = head0 + offs_m // BS
    t = ks + offs_m % BS
    tvalid, trow = _query_rows(QRow, t, t < de, SUBSET)
    p = t - ds
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + trow[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=tvalid[:, None], other=0.0)
    m_i = tl.full([HP * BS], float("-inf"), tl.float32)
    l_i = tl.zeros([HP * BS], tl.float32)
    p_last = tl.minimum(ks + BS, de) - 1 - ds
    n_vis = (p_last - KS + 1 + ST) // ST  # windows visible to the last row (may be <= 0)
    # chunks of windows every row sees (the block's first row sees ``n_all``) need no mask
    n_all = tl.maximum((ks - ds - KS + 1 + ST) // ST, 0)
    n_full = (n_all // BW) * BW
    kbase = KC + (c0 * R).to(tl.int64) * s_cw + h * s_ch
    for w0 in range(0, n_full, BW):
        w = w0 + tl.arange(0, BW)
        kc = tl.load(kbase + w[:, None].to(tl.int64) * s_cw + offs_d[None, :])
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        m_i, l_i = _lse_step(s, m_i, l_i)
    for w0 in range(n_full, n_vis, BW):
        w = w0 + tl.arange(0, BW)
        kc = tl.load(kbase + w[:, None].to(tl.int64) * s_cw + offs_d[None, :], mask=(w < n_vis)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        s = tl.where((w[None, :] * ST + KS - 1) <= p[:, None], s, float("-inf"))
        m_i, l_i = _lse_step(s, m_i, l_i)
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(LSE + b * s_lb + head * s_lh + trow, lse, mask=tvalid)


@triton.jit
def _block_chunk(Q, kbase, LSE, Out, m0, carry, b, h, trow, tvalid, p, p_last, j, s_qb, s_qt, s_qh, s_cw, s_lb, s_lh,
                 s_ob, s_oh, s_ot, qk_scale, G: tl.constexpr, NBC: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 KS: tl.constexpr, ST: tl.constexpr, R: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                 INIT: tl.constexpr, LOCAL: tl.constexpr):
    """Block scores of the ``NBC`` blocks from ``m0`` for the ``BS`` rows ``trow`` (all in block ``j``) of
    KV head ``h``, stored; returns the carry (the chunk's last own window, summed over the heads)."""
    offs_d = tl.arange(0, D)
    NW: tl.constexpr = NBC * R
    NE: tl.constexpr = NBC * EP
    # E == 1 (default geometry): block m's trailing window is block m - 1's last own window, whose
    # probability this chunk already has (shifted one block over; the chunk's first block takes the
    # previous chunk's last, ``carry``); other E recompute the trailing windows with their own products
    SHIFT: tl.constexpr = E == 1
    i_blk = tl.arange(0, NBC)
    m = m0 + i_blk  # blocks of this chunk
    w = m0 * R + tl.arange(0, NW)  # own windows of the chunk's blocks
    kc = tl.load(kbase + w[:, None].to(tl.int64) * s_cw + offs_d[None, :],
                 mask=(w * ST + KS - 1 <= p_last)[:, None], other=0.0)
    vis = (w[None, :] * ST + KS - 1) <= p[:, None]
    acc = tl.zeros([BS, NW], tl.float32)
    if SHIFT:
        we1 = m * R - 1
        vis_e1 = (we1[None, :] >= 0) & ((we1[None, :] * ST + KS - 1) <= p[:, None])
    elif E > 0:
        se = tl.arange(0, NE)
        we = (m0 + se // EP) * R - E + se % EP  # trailing windows of the previous block
        ok_e = (se % EP < E) & (we >= 0)
        kce = tl.load(kbase + we[:, None].to(tl.int64) * s_cw + offs_d[None, :],
                      mask=(ok_e & (we * ST + KS - 1 <= p_last))[:, None], other=0.0)
        vis_e = ok_e[None, :] & ((we[None, :] * ST + KS - 1) <= p[:, None])
        acc_e = tl.zeros([BS, NE], tl.float32)
    for g in range(G):
        head = h * G + g
        q = tl.load(Q + b * s_qb + trow[:, None].to(tl.int64) * s_qt + head * s_qh + offs_d[None, :],
                    mask=tvalid[:, None], other=0.0)
        lse = tl.load(LSE + b * s_lb + head * s_lh + trow, mask=tvalid, other=float("inf"))
        # no mask per head: an invisible window's term is finite or +inf (its key is not in the
        # row's LSE), never NaN, and the window is set to -inf after the heads' sum below
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        acc += tl.math.exp2(s - lse[:, None])
        if not SHIFT and E > 0:
            se_ = tl.dot(q, tl.trans(kce)) * qk_scale
            acc_e += tl.math.exp2(se_ - lse[:, None])
    if SHIFT:
        own = tl.reshape(acc, [BS, NBC, R])
        last = tl.sum(tl.where((tl.arange(0, R) == R - 1)[None, None, :], own, 0.0), axis=2)  # [BS, NBC]
        prev = tl.gather(last, tl.zeros([BS, NBC], tl.int32) + tl.maximum(i_blk - 1, 0)[None, :], axis=1)
        prev = tl.where(i_blk[None, :] == 0, carry[:, None], prev)
        carry = tl.sum(tl.where(i_blk[None, :] == NBC - 1, last, 0.0), axis=1)
    acc = tl.where(vis, acc, float("-inf"))
    val = tl.max(tl.reshape(acc, [BS, NBC, R]), axis=2)
    if SHIFT:
        val = tl.maximum(val, tl.where(vis_e1, prev, float("-inf")))
    elif E > 0:
        acc_e = tl.where(vis_e, acc_e, float("-inf"))
        val = tl.maximum(val, tl.max(tl.reshape(acc_e, [BS, NBC, EP]), axis=2))
    forced = (m[None, :] < INIT) | ((m[None, :] >= j - LOCAL) & (m[None, :] <= j))
    val = tl.where(forced, float("inf"), val)
    val = tl.where(m[None, :] > j, float("-inf"), val)
    tl.store(Out + b * s_ob + h * s_oh + trow[:, None].to(tl.int64) * s_ot + m[None, :], val,
             mask=tvalid[:, None] & (m <= j)[None, :])
    return carry


@triton.jit(do_not_specialize=UNSPECIALIZED["_sel_block_kernel"])
def _sel_block_kernel(Q, KC, Blocks, LSE, Out, QRow, Live, s_qb, s_qt, s_qh, s_cw, s_ch, s_lb, s_lh, s_ob, s_oh, s_ot,
                      qk_scale, covered, G: tl.constexpr, NBC: tl.constexpr, NBT: tl.constexpr,
                      D: tl.constexpr, BS: tl.constexpr, KS: tl.constexpr, ST: tl.constexpr, R: tl.constexpr,
                      E: tl.constexpr, EP: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                      SUBSET: tl.constexpr):
    """Chunks of ``NBC`` blocks while a whole chunk is seen, then chunks of ``NBT`` (a divisor of NBC)
    for the rest of the row's ``j + 1`` blocks (less work past the last block than one wide chunk)."""
    c = tl.num_programs(0) - 1 - tl.program_id(0)  # later blocks (longer rows) first: no long tail
    h = tl.program_id(1)
    b, ks, ds, de, j, c0 = _block_row(Blocks, c, BS)  # every row of this program is in block qb = j
    if j < covered:  # the budget takes every block these rows see: their scores are never read
        return
    if SUBSET:
        if tl.load(Live + c) == 0:
            return
    t = ks + tl.arange(0, BS)
    tvalid, trow = _query_rows(QRow, t, t < de, SUBSET)
    p = t - ds
    p_last = tl.minimum(ks + BS, de) - 1 - ds
    kbase = KC + (c0 * R).to(tl.int64) * s_cw + h * s_ch
    carry = tl.zeros([BS], tl.float32)  # the previous chunk's last own window (none before block 0)
    n_wide = ((j + 1) // NBC) * NBC
    for m0 in range(0, n_wide, NBC):
        carry = _block_chunk(Q, kbase, LSE, Out, m0, carry, b, h, trow, tvalid, p, p_last, j, s_qb, s_qt, s_qh, s_cw,
                             s_lb, s_lh, s_ob, s_oh, s_ot, qk_scale, G, NBC, D, BS, KS, ST, R, E, EP, INIT, LOCAL)
    for m0 in range(n_wide, j + 1, NBT):
        carry = _block_chunk(Q, kbase, LSE, Out, m0, carry, b, h, trow, tvalid, p, p_last, j, s_qb, s_qt, s_qh, s_cw,
                             s_lb, s_lh, s_ob, s_oh, s_ot, qk_scale, G, NBT, D, BS, KS, ST, R, E, EP, INIT, LOCAL)


def block_chunks(launch: dict, R: int, E: int, EP: int, on_gpu: bool) -> tuple[int, int]:
    """Blocks per step of the block-score kernel: ``(NBC, NBT)``, the wide chunks (``launch["NW"]``
    windows) and the tail chunks (``launch["NT"]``) of a row's last blocks; every product is at least
    16 windows wide (``tl.dot``), also the trailing-window one (``EP`` per block) when ``E > 1``. The
    interpreter (CPU tests) takes 16-block chunks and the narrowest tails, so its tests run both loops."""
    low = max(16 // R, 1 if E <= 1 else triton.cdiv(16, EP))
    wide = max(launch["NW"] // R if on_gpu else 16, low)
    return wide, min(wide, max(launch["NT"] // R if on_gpu else 1, low))


def lse_heads_per_program(G: int) -> int:
    """Query heads per program of the LSE kernel: the largest power of two dividing G, up to ``SEL_CONFIG``'s
    HP (a program's ``HP * BS`` rows are one Triton tile, a power of two; G = 3 or 9 takes one head)."""
    return max(d for d in range(1, min(G, SEL_CONFIG["lse"]["HP"]) + 1) if G % d == 0 and d & (d - 1) == 0)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports_selection(cfg: NOSAConfig, head_dim: int) -> bool:
    """Whether the kernels cover this geometry (else ``nosa_layers.dispatch`` uses the reference)."""
    R = cfg.block_size // cfg.kernel_stride
    return head_dim in (16, 32, 64, 128, 256) and _pow2(R) and _pow2(cfg.kernel_size) and _pow2(cfg.block_size)


def compress(k: Tensor, score: Tensor | None, layout: BlockLayout, cfg: NOSAConfig, dtype: torch.dtype):
    """Window means of the keys ``kc [n_blocks * R, Hkv, D]`` (``dtype``) and of the eviction score
    ``ws [n_blocks * R, Hkv]`` fp32 (``None`` without a score); rows past a document's last full
    window hold unspecified values and are never read."""
    B, T, Hkv, D = k.shape
    R = cfg.block_size // cfg.kernel_stride
    n = max(layout.n_blocks, 1) * R
    kc = torch.empty(n, Hkv, D, dtype=dtype, device=k.device)
    ws = torch.empty(n, Hkv, dtype=torch.float32, device=k.device) if score is not None else None
    if layout.n_blocks:
        s_arg = k if score is None else score
        s_str = (0, 0, 0) if score is None else score.stride()
        _compress_kernel[(layout.n_blocks, Hkv)](
            k, s_arg, layout.blocks, kc, kc if ws is None else ws, *k.stride()[:3], *s_str, *kc.stride()[:2],
            0 if ws is None else ws.stride(0), HAS_SCORE=score is not None, D=D, BS=cfg.block_size,
            KS=cfg.kernel_size, ST=cfg.kernel_stride, R=R)
    return kc, ws


def block_scores_triton(q: Tensor, kc: Tensor, layout: BlockLayout, cfg: NOSAConfig,
                        softmax_scale: float | None = None, covered: int = 0, ql: QueryLayout | None = None) -> Tensor:
    """Query-aware block scores (forced blocks +inf) fp32 ``[B, Hkv, T, nb]``; row ``t`` holds the
    blocks ``m <= qb(t)`` of its document, later columns are unspecified; rows of the first
    ``covered`` blocks of each document are not scored (unspecified). ``ql``: q holds only those query
    rows (``[B, Tq, Hq, D]``, scores ``[B, Hkv, Tq, nb]``)."""
    B, T, Hq, D = q.shape
    Hkv = kc.shape[1]
    G = Hq // Hkv
    bs, ks, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    R = bs // st
    E = -(-ks // st) - 1
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hkv, T, layout.max_doc_blocks, dtype=torch.float32, device=q.device)
    if not layout.n_blocks:
        return out
    c = SEL_CONFIG["lse"]
    hp = lse_heads_per_program(G)
    rows, live = (ql.rows, ql.live) if ql is not None else (no_rows(str(q.device)),) * 2
    _sel_lse_kernel[(layout.n_blocks, Hq // hp)](
        q, kc, layout.blocks, lse, rows, live, *q.stride()[:3], *kc.stride()[:2], lse.stride(0), lse.stride(1),
        scale * LOG2E, covered, G=G, HP=hp, BW=c["BW"], D=D, BS=bs, KS=ks, ST=st, R=R, SUBSET=ql is not None,
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    c = SEL_CONFIG["block"]
    EP = triton.next_power_of_2(max(E, 1))
    NBC, NBT = block_chunks(c, R, E, EP, q.is_cuda)
    _sel_block_kernel[(layout.n_blocks, Hkv)](
        q, kc, layout.blocks, lse, out, rows, live, *q.stride()[:3], *kc.stride()[:2], lse.stride(0), lse.stride(1),
        *out.stride()[:3], scale * LOG2E, covered,
        G=G, NBC=NBC, NBT=NBT, D=D, BS=bs, KS=ks, ST=st, R=R, E=E, EP=EP,
        INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, SUBSET=ql is not None, num_warps=c["num_warps"],
        num_stages=c["num_stages"])
    return out


@torch.no_grad()
def select_blocks_triton(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                         cu_seqlens: Tensor | None = None, softmax_scale: float | None = None,
                         q_chunks=None) -> Tensor:
    """GPU ``select_blocks``: bool ``[B, Hkv, T, nb]``, reference semantics and tie-breaking
    (geometries with ``supports_selection``); a packed batch runs in one launch per kernel. ``q_chunks``:
    q holds only those query rows of the key row (``[B, Tq, Hq, D]`` -> ``[B, Hkv, Tq, nb]``)."""
    check_device(q, k, evict_score)
    check_inputs(q, k, evict_score, cu_seqlens, q_chunks)
    if not supports_selection(cfg, q.shape[-1]):
        raise ValueError(f"nosa_layers.ops: no selection kernel for head dim {q.shape[-1]} and block/stride/kernel "
                         f"{cfg.block_size}/{cfg.kernel_stride}/{cfg.kernel_size}; use the reference selection")
    B, Tq = q.shape[:2]
    layout = block_layout(B, k.shape[1], cu_seqlens, cfg.block_size, q.device)
    ql = query_layout(layout, q_chunks)
    # Rows that see at most ``topk`` blocks select all of them: their blocks are not scored, and a
    # batch whose documents all fit the budget (short packed documents) needs no scoring at all.
    if layout.max_doc_blocks <= cfg.topk:  # (unread stand-ins keep the top-k kernel's compiled variant)
        Hkv = k.shape[2]
        b_qa = torch.empty(B, Hkv, Tq, layout.max_doc_blocks, dtype=torch.float32, device=q.device)
        ws = None if evict_score is None else torch.empty(1, Hkv, dtype=torch.float32, device=q.device)
        return select_from_block_scores(b_qa, ws, layout, cfg, ql)
    dt = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32
    q = q.to(dt)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    kc, ws = compress(k, evict_score, layout, cfg, dt)
    b_qa = block_scores_triton(q, kc, layout, cfg, softmax_scale, covered=cfg.topk, ql=ql)
    return select_from_block_scores(b_qa, ws, layout, cfg, ql)
