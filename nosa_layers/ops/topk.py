"""Fused exact top-k of the NOSA selection: both stages in one Triton kernel.

One program per (KV block of query rows, KV head) of the batch's block table (``layout.py``); all
its rows are in block ``qb``. Inputs:

- ``b_qa`` fp32 ``[B, Hkv, T, nb]``: query-aware block scores (``block_scores_triton``: forced
  blocks +inf; columns past ``qb`` are not read);
- ``ws`` fp32 ``[n_blocks * R, Hkv]``: window means of the eviction score (``compress``), or
  ``None`` (no eviction head: the whole budget is query-aware). The kernel pools them per block
  (max over the windows overlapping the block) and, for block ``qb - 1``, over the windows each
  row sees (only that block can hold windows invisible to a row of block ``qb``).

Per row only the columns ``m <= qb`` are ranked. Stage 1 takes the top
``min(query_aware_blocks, qb + 1)`` of ``b_qa``; stage 2 ranks ``+inf`` for forced blocks and the
stage-1 picks, else the eviction score, and keeps the top ``min(topk, qb + 1)``. Ties go to the
LOWER block index (the reference's stable descending sort), exactly.

Kernel: fp32 -> uint32 keys whose unsigned order is the float order (-0.0 == +0.0); the k-th
largest key ``tau`` of a row is found bit by bit (at most 32 counting passes over a ``[BR, W]``
register tile, no sort; the search stops once every row's count at ``tau`` is exactly ``k``); the
picks are ``key > tau`` plus the first ``k - #(key > tau)`` columns with ``key == tau``. A row of
block ``qb`` ranks only a width ``W`` class that holds its ``qb + 1`` blocks (``NBP, NBP / 2, ...``).
``select_from_block_scores_torch`` is the plain-PyTorch reference (the reference selection's
``two_stage_blocks``), also the fallback for ``nb > MAX_BLOCKS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.selection import block_window_index, blocks_mask, pool_to_blocks, two_stage_blocks

from ._common import UNSPECIALIZED
from .launch import TOPK_CONFIG
from .layout import BlockLayout
from .query_layout import QueryLayout, _query_rows, no_rows

MAX_BLOCKS = 8192  # widest row the kernel keeps in registers; wider rows use the torch path


@triton.jit
def _orderable(x):
    """fp32 -> uint32 key, unsigned key order == float order; -0.0 and +0.0 get the same key."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _topk_rows(key, valid, k):
    """Bool ``[BR, NBP]``: the ``k [BR]`` largest ``key`` among ``valid`` columns of each row,
    ties to the lower column (needs ``k <= #valid``)."""
    # tau: largest value with count(valid key >= tau) >= k, built bit by bit. Every candidate is
    # >= 1, so invalid columns set to key 0 are never counted (nor are valid keys 0, correctly).
    # Early exit: once every row's count at its tau is exactly k, {key >= tau} is already its top k
    # (the k-th and (k+1)-th keys differ in a bit above the ones left), so the remaining bits
    # cannot change the picks; rows of real scores separate after ~14 of the 32 bits.
    kz = tl.where(valid, key, tl.zeros_like(key))
    tau = tl.zeros_like(k).to(tl.uint32)
    at_tau = tl.zeros_like(k) + key.shape[1]  # count(kz >= 0): every column
    bit = tl.full([], 0x80000000, tl.uint32)
    n = 0
    while (n < 32) & (tl.max(at_tau - k, axis=0) > 0):
        cand = tau | bit
        cnt = tl.sum((kz >= cand[:, None]).to(tl.int32), axis=1)
        take = cnt >= k
        tau = tl.where(take, cand, tau)
        at_tau = tl.where(take, cnt, at_tau)
        bit = bit >> 1
        n += 1
    gt = valid & (key > tau[:, None])
    eq = valid & (key == tau[:, None])
    need = k - tl.sum(gt.to(tl.int32), axis=1)
    return gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=1) <= need[:, None]))


@triton.jit
def _select_rows(BQA, WS, Out, QRow, K1, K2, b, h, c, ks, ds, de, j, row0, s_ab, s_ah, s_at, s_ww, s_ob, s_oh, s_ot,
                 NBW, BR: tl.constexpr, W: tl.constexpr, RSZ: tl.constexpr, KS: tl.constexpr, ST: tl.constexpr,
                 R: tl.constexpr, E: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, EVICT: tl.constexpr,
                 SUBSET: tl.constexpr):
    """Both stages for the ``RSZ`` rows from ``row0`` of block ``j`` (``j < W``), ranking the first
    ``W`` columns in ``[BR, W]`` tiles; the columns ``W .. NBW`` of the rows are written False."""
    m = tl.arange(0, W)
    valid = m <= j
    n_valid = tl.zeros([BR], tl.int32) + j + 1  # per row (all rows of the program are in block j)
    if EVICT:
        # pooled eviction score of each block (max over its windows), and the windows of block
        # j - 1, whose visibility depends on the row
        wbase = WS + ((c - j) * R).to(tl.int64) * s_ww + h
        nw = tl.where(de - ds >= KS, (de - ds - KS) // ST + 1, 0)
        static = tl.full([W], float("-inf"), tl.float32)
        for e in tl.static_range(R + E):
            w = m * R - E + e
            ok = valid & (w >= 0) & (w < nw)
            static = tl.maximum(static, tl.load(wbase + w.to(tl.int64) * s_ww, mask=ok, other=float("-inf")))
        forced = (m < INIT) | ((m >= j - LOCAL) & (m <= j))
    for r0 in range(row0, row0 + RSZ, BR):
        t = ks + r0 + tl.arange(0, BR)
        row_ok, trow = _query_rows(QRow, t, t < de, SUBSET)
        ok2 = row_ok[:, None] & valid[None, :]
        t64 = trow[:, None].to(tl.int64)
        x = tl.load(BQA + b * s_ab + h * s_ah + t64 * s_at + m[None, :], mask=ok2, other=0.0)
        if EVICT:
            sel = _topk_rows(_orderable(x), ok2, tl.minimum(n_valid, K1))
            prev = tl.full([BR], float("-inf"), tl.float32)
            p = t - ds
            for e in tl.static_range(R + E):
                wp = (j - 1) * R - E + e
                vis = (j >= 1) & (wp >= 0) & (wp * ST + KS - 1 <= p)
                wv = tl.load(wbase + wp.to(tl.int64) * s_ww, mask=(j >= 1) & (wp >= 0) & (wp < nw), other=float("-inf"))
                prev = tl.maximum(prev, tl.where(vis, wv, float("-inf")))
            agn = tl.where(m[None, :] == j - 1, prev[:, None], static[None, :])
            agn = tl.where(forced[None, :] | sel, float("inf"), agn)
            sel = _topk_rows(_orderable(agn), ok2, tl.minimum(n_valid, K2))
        else:
            sel = _topk_rows(_orderable(x), ok2, tl.minimum(n_valid, K2))
        obase = Out + b * s_ob + h * s_oh + t64 * s_ot
        tl.store(obase + m[None, :], sel.to(tl.uint8), mask=row_ok[:, None] & (m < NBW)[None, :])
        for m0 in range(W, NBW, W):  # columns past the class width: never selected
            tl.store(obase + m0 + m[None, :], tl.zeros([BR, W], tl.uint8),
                     mask=row_ok[:, None] & (m0 + m < NBW)[None, :])


@triton.jit(do_not_specialize=UNSPECIALIZED["_select_kernel"])
def _select_kernel(BQA, WS, Blocks, Out, QRow, Live, K1, K2, s_ab, s_ah, s_at, s_ww, s_ob, s_oh, s_ot, NBW,
                   BR: tl.constexpr, NBP: tl.constexpr, NCLS: tl.constexpr, RS: tl.constexpr, BS: tl.constexpr,
                   KS: tl.constexpr, ST: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
                   INIT: tl.constexpr, LOCAL: tl.constexpr, EVICT: tl.constexpr, SUBSET: tl.constexpr):
    """One program per (KV block of query rows, KV head, ``1 / RS`` of the block's rows): every row is
    in block ``qb = j``. Rows rank only the blocks they see, in the narrowest of ``NCLS`` width classes
    ``NBP, NBP / 2, ...`` that holds them (tiles of ``BR x NBP`` elements in every class); later blocks
    (wider rows) first. ``SUBSET``: rows are the query rows ``QRow`` maps tokens to (``query_layout``)."""
    RSZ: tl.constexpr = BS // RS
    c = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.program_id(2) * RSZ
    b = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    ks = tl.load(Blocks + c * 4 + 1)
    ds = tl.load(Blocks + c * 4 + 2)
    de = tl.load(Blocks + c * 4 + 3)
    j = (ks - ds) // BS
    if SUBSET:
        if tl.load(Live + c) == 0:
            return
    if j < K2:  # every row sees at most K2 blocks: all of them are selected, no score is read
        m = tl.arange(0, NBP)
        for r0 in range(row0, row0 + RSZ, BR):
            t = ks + r0 + tl.arange(0, BR)
            row_ok, trow = _query_rows(QRow, t, t < de, SUBSET)
            tl.store(Out + b * s_ob + h * s_oh + trow[:, None].to(tl.int64) * s_ot + m[None, :],
                     (m <= j)[None, :].to(tl.uint8) + tl.zeros([BR, NBP], tl.uint8),
                     mask=row_ok[:, None] & (m < NBW)[None, :])
    else:
        for cls in tl.static_range(NCLS):
            if (j < (NBP >> cls)) & ((cls == NCLS - 1) | (j >= (NBP >> (cls + 1)))):
                _select_rows(BQA, WS, Out, QRow, K1, K2, b, h, c, ks, ds, de, j, row0, s_ab, s_ah, s_at, s_ww, s_ob,
                             s_oh, s_ot, NBW, min(RSZ, BR << cls), NBP >> cls, RSZ, KS, ST, R, E, INIT, LOCAL, EVICT,
                             SUBSET)


def width_classes(nbp: int, k2: int) -> int:
    """Width classes of the top-k kernel: ``nbp, nbp / 2, ...`` down to the narrowest that can hold
    a scored row (more than ``k2`` blocks; rows of at most ``k2`` blocks are not ranked), at least 16."""
    low = max(16, triton.next_power_of_2(k2 + 1))
    return max(1, (nbp // low).bit_length()) if nbp >= low else 1


def launch_shape(nbp: int, block: int, kind: str) -> tuple[int, int, int]:
    """Rows per register tile, programs per (KV block, KV head) and warps of the top-k kernel for
    ``nbp`` padded blocks, from ``TOPK_CONFIG[kind]`` (``cuda`` or ``interpreter``)."""
    launch = TOPK_CONFIG[kind]
    warps = launch.get("WARPS", 0)
    if any(v < 1 or v & (v - 1) for v in (launch["TILE"], launch["ROW_SPLITS"])) or warps < 0 or warps & (warps - 1):
        raise ValueError("nosa_layers.ops: TOPK_CONFIG needs powers of two for TILE and ROW_SPLITS and WARPS 0 or a "
                         f"power of two, got {launch}")
    splits = min(launch["ROW_SPLITS"], block)
    rows = min(block // splits, max(1, launch["TILE"] // nbp))
    return rows, splits, warps or max(1, min(16, rows * nbp // 512))


def select_from_block_scores(b_qa: Tensor, ws: Tensor | None, layout: BlockLayout, cfg: NOSAConfig,
                             ql: QueryLayout | None = None) -> Tensor:
    """Both top-k stages fused (see the module docstring): bool ``[B, Hkv, T, nb]``.

    ``b_qa`` fp32 ``[B, Hkv, T, nb]`` (``block_scores_triton``; columns past a row's block unread),
    ``ws`` fp32 ``[n_blocks * R, Hkv]`` window means of the eviction score (``compress``), or ``None``
    (no eviction head: the whole budget is query-aware). ``ql``: the rows are those query rows only
    (``[B, Hkv, Tq, nb]``)."""
    B, Hkv, T, nb = b_qa.shape
    if nb > MAX_BLOCKS:
        if ql is not None:
            raise ValueError(f"nosa_layers.ops: query chunks with rows wider than {MAX_BLOCKS} blocks are not "
                             f"supported; use backend='reference'")
        return select_from_block_scores_torch(b_qa, ws, layout, cfg)
    out = torch.empty(B, Hkv, T, nb, dtype=torch.bool, device=b_qa.device)
    if layout.n_blocks == 0 or nb == 0:
        return out.zero_()
    # Few compiled variants: widths up to 64 blocks share one (packed batches bring new lengths).
    NBP = max(triton.next_power_of_2(nb), 64)
    BR, RS, warps = launch_shape(NBP, cfg.block_size, "cuda" if b_qa.is_cuda else "interpreter")
    bs, ks, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    rows, live = (ql.rows, ql.live) if ql is not None else (no_rows(str(b_qa.device)),) * 2
    _select_kernel[(layout.n_blocks, Hkv, RS)](
        b_qa, b_qa if ws is None else ws, layout.blocks, out.view(torch.uint8), rows, live, cfg.query_aware_blocks,
        cfg.topk,
        *b_qa.stride()[:3], 0 if ws is None else ws.stride(0), *out.stride()[:3], nb,
        BR=BR, NBP=NBP, NCLS=width_classes(NBP, cfg.topk), RS=RS, BS=bs, KS=ks, ST=st, R=bs // st,
        E=-(-ks // st) - 1, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, EVICT=ws is not None,
        SUBSET=ql is not None, num_warps=warps)
    return out


# --- plain-PyTorch reference -------------------------------------------------------------------

def agnostic_parts(ws: Tensor, cfg: NOSAConfig, L: int) -> tuple[Tensor, Tensor]:
    """Pooled eviction scores of one document from its window means ``ws [B, Hkv, nw]``: ``static``
    fp32 ``[B, Hkv, nb]`` per block and ``prev_part`` fp32 ``[B, Hkv, L]``, block ``qb - 1`` pooled
    over the windows visible to each row (-inf when none or ``qb == 0``). Only block ``qb - 1`` can
    have windows invisible to a row of block ``qb``; earlier blocks are fully visible."""
    B, Hkv, nw = ws.shape
    nb = cfg.num_blocks(L)
    index = block_window_index(cfg, nb, nw, device=ws.device)  # [nb, W]
    static = pool_to_blocks(ws, index)  # [B, Hkv, nb]
    pos = torch.arange(L, device=ws.device)
    qb = pos // cfg.block_size
    widx = index[(qb - 1).clamp(min=0)]  # [L, W]
    vis = (widx < nw) & (widx * cfg.kernel_stride + cfg.kernel_size - 1 <= pos[:, None]) & (qb >= 1)[:, None]
    wsp = torch.cat([ws, ws.new_full((B, Hkv, 1), float("-inf"))], dim=-1)
    prev_part = wsp[:, :, widx.clamp(max=nw)].masked_fill(~vis, float("-inf")).amax(-1)  # [B, Hkv, L]
    return static, prev_part


def select_from_block_scores_torch(b_qa: Tensor, ws: Tensor | None, layout: BlockLayout, cfg: NOSAConfig) -> Tensor:
    """Reference of ``select_from_block_scores`` (and its fallback for very wide rows): per document,
    the pooled eviction scores in torch and ``stages_torch``. Bool ``[B, Hkv, T, nb]``."""
    B, Hkv, T, nb = b_qa.shape
    R = cfg.block_size // cfg.kernel_stride
    out = torch.zeros(B, Hkv, T, nb, dtype=torch.bool, device=b_qa.device)
    firsts = [(c, row) for c, row in enumerate(layout.blocks.tolist()) if row[1] == row[2]]
    for c, (b, _, s, e) in firsts:
        L = e - s
        static = prev = None
        if ws is not None:
            nw = cfg.num_windows(L)
            wd = ws[c * R:c * R + nw].T[None].float()  # [1, Hkv, nw]
            static, prev = agnostic_parts(wd, cfg, L)
        out[b:b + 1, :, s:e, :cfg.num_blocks(L)] = stages_torch(b_qa[b:b + 1, :, s:e, :cfg.num_blocks(L)],
                                                                 static, prev, cfg)
    return out


def stages_torch(b_qa: Tensor, static: Tensor | None, prev_part: Tensor | None, cfg: NOSAConfig,
                 row_chunk: int = 2048) -> Tensor:
    """Both top-k stages of one document in plain PyTorch (``selection.two_stage_blocks``) per chunk of rows,
    the chunk cut to the blocks its last row can see. ``b_qa [B, Hkv, L, nb]`` (forced +inf),
    ``static [B, Hkv, nb]``, ``prev_part [B, Hkv, L]`` (``agnostic_parts``). Bool ``[B, Hkv, L, nb]``."""
    B, Hkv, L, nb = b_qa.shape
    dev = b_qa.device
    out = torch.zeros(B, Hkv, L, nb, dtype=torch.bool, device=dev)
    for c0 in range(0, L, row_chunk):
        c1 = min(c0 + row_chunk, L)
        w = (c1 - 1) // cfg.block_size + 1  # visible blocks of the chunk
        pos = torch.arange(c0, c1, device=dev)
        blk = torch.arange(w, device=dev)
        qb = (pos // cfg.block_size)[:, None]
        future = blk[None, :] > qb
        forced = (blk[None, :] < cfg.init_blocks) | ((blk[None, :] >= qb - cfg.local_blocks) & ~future)
        agn = None
        if static is not None:
            agn = static[:, :, None, :w].expand(B, Hkv, c1 - c0, w).clone()
            rows = torch.nonzero(qb[:, 0] >= 1).squeeze(1)
            agn[:, :, rows, qb[rows, 0] - 1] = prev_part[:, :, c0:c1][:, :, rows]
        chosen = two_stage_blocks(b_qa[:, :, c0:c1, :w], agn, forced, future, cfg)
        out[:, :, c0:c1, :w] = blocks_mask(chosen, w) & ~future
    return out
