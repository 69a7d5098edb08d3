"""NOSA block selection on GPU: Triton scoring kernels + one fused exact (tie-aware) top-k kernel.

Pipeline per document (``select_blocks`` semantics, see ``nosa_layers/selection.py``):

1. ``kc``: mean-pooled compressed keys ``[B, nw, Hkv, D]`` (torch, O(T D)).
2. ``_sel_lse_kernel``: per (token, query head) log2-sum-exp2 of the causal scores against the
   visible compressed keys (flash-style, nothing materialised).
3. ``_sel_block_kernel``: per (64-token row tile, KV head) recomputes the scores for the G heads
   of the group, sums the probabilities over heads and max-pools them straight into block scores
   (own windows of a block + the ``E`` trailing windows of the block before), applies forced
   (+inf) and future (-inf) blocks and writes ``[B, Hkv, T, nb]`` fp32. O(T * nb), no T x T buffer.
4. ``agnostic_parts`` (torch, O(T W)): pooled eviction scores per block ``[B, Hkv, nb]`` and, per
   row, block ``qb - 1`` pooled over its visible windows ``[B, Hkv, T]``; then
   ``topk.select_from_block_scores`` runs both top-k stages (query-aware, then eviction fill) in one
   Triton kernel (per-row k-th largest key by bit-wise counting, no sort) and writes the bool mask;
   ties go to the LOWER block index exactly as the reference's stable sort.
   ``select_rows_triton(..., topk=select_from_block_scores_torch)``: the stages in plain torch (reference).

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

from .topk import select_from_block_scores

LOG2E = 1.4426950408889634


@triton.jit
def _sel_lse_kernel(Q, KC, LSE, L, s_qb, s_qt, s_qh, s_cb, s_cw, s_ch, s_lb, s_lh, qk_scale,
                    HKV: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, D: tl.constexpr,
                    KS: tl.constexpr, ST: tl.constexpr):
    t0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = (bh // (HKV * G)).to(tl.int64)
    head = bh % (HKV * G)
    h = head // G
    t = t0 + tl.arange(0, BM)
    tvalid = t < L
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + t[:, None].to(tl.int64) * s_qt + head * s_qh + offs_d[None, :],
                mask=tvalid[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    t_last = tl.minimum(t0 + BM, L) - 1
    n_vis = (t_last - KS + 1 + ST) // ST  # windows visible to the last row (may be <= 0)
    for w0 in range(0, n_vis, BW):
        w = w0 + tl.arange(0, BW)
        kc = tl.load(KC + b * s_cb + w[:, None].to(tl.int64) * s_cw + h * s_ch + offs_d[None, :],
                     mask=(w < n_vis)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        vis = (w[None, :] * ST + KS - 1) <= t[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(LSE + b * s_lb + head * s_lh + t, lse, mask=tvalid)


@triton.jit
def _sel_block_kernel(Q, KC, LSE, Out, L, nb, s_qb, s_qt, s_qh, s_cb, s_cw, s_ch, s_lb, s_lh,
                      s_ob, s_oh, s_ot, qk_scale,
                      HKV: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, NBC: tl.constexpr, D: tl.constexpr,
                      BS: tl.constexpr, KS: tl.constexpr, ST: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
                      EP: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr):
    t0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = bh % HKV
    t = t0 + tl.arange(0, BM)
    tvalid = t < L
    qb = t // BS
    t_last = tl.minimum(t0 + BM, L) - 1
    qb_last = t_last // BS
    offs_d = tl.arange(0, D)
    NW: tl.constexpr = NBC * R
    NE: tl.constexpr = NBC * EP
    for c0 in range(0, nb, NBC):
        m = c0 + tl.arange(0, NBC)  # blocks of this chunk
        if c0 <= qb_last:
            w = c0 * R + tl.arange(0, NW)  # own windows of the chunk's blocks
            kc = tl.load(KC + b * s_cb + w[:, None].to(tl.int64) * s_cw + h * s_ch + offs_d[None, :],
                         mask=(w * ST + KS - 1 <= t_last)[:, None], other=0.0)
            vis = (w[None, :] * ST + KS - 1) <= t[:, None]
            acc = tl.zeros([BM, NW], tl.float32)
            if E > 0:
                se = tl.arange(0, NE)
                we = (c0 + se // EP) * R - E + se % EP  # trailing windows of the previous block
                ok_e = (se % EP < E) & (we >= 0)
                kce = tl.load(KC + b * s_cb + we[:, None].to(tl.int64) * s_cw + h * s_ch + offs_d[None, :],
                              mask=(ok_e & (we * ST + KS - 1 <= t_last))[:, None], other=0.0)
                vis_e = ok_e[None, :] & ((we[None, :] * ST + KS - 1) <= t[:, None])
                acc_e = tl.zeros([BM, NE], tl.float32)
            for g in range(G):
                head = h * G + g
                q = tl.load(Q + b * s_qb + t[:, None].to(tl.int64) * s_qt + head * s_qh + offs_d[None, :],
                            mask=tvalid[:, None], other=0.0)
                lse = tl.load(LSE + b * s_lb + head * s_lh + t, mask=tvalid, other=float("inf"))
                s = tl.dot(q, tl.trans(kc)) * qk_scale
                acc += tl.where(vis, tl.math.exp2(s - lse[:, None]), 0.0)
                if E > 0:
                    se_ = tl.dot(q, tl.trans(kce)) * qk_scale
                    acc_e += tl.where(vis_e, tl.math.exp2(se_ - lse[:, None]), 0.0)
            acc = tl.where(vis, acc, float("-inf"))
            val = tl.max(tl.reshape(acc, [BM, NBC, R]), axis=2)
            if E > 0:
                acc_e = tl.where(vis_e, acc_e, float("-inf"))
                val = tl.maximum(val, tl.max(tl.reshape(acc_e, [BM, NBC, EP]), axis=2))
        else:
            val = tl.full([BM, NBC], float("-inf"), tl.float32)
        forced = (m[None, :] < INIT) | ((m[None, :] >= qb[:, None] - LOCAL) & (m[None, :] <= qb[:, None]))
        val = tl.where(forced, float("inf"), val)
        val = tl.where(m[None, :] > qb[:, None], float("-inf"), val)
        tl.store(Out + b * s_ob + h * s_oh + t[:, None].to(tl.int64) * s_ot + m[None, :], val,
                 mask=tvalid[:, None] & (m < nb)[None, :])


# Launch parameters of the scoring kernels (rows per program ``BM``; LSE: compressed keys per step
# ``BW``; block scores: windows per step ``NW``, i.e. NW / (block / stride) blocks). Tuned on one
# H200 for block 64, D 128 (bench/attention.py --sweep); override for experiments.
SEL_CONFIG = {
    "lse": dict(BM=128, BW=64, num_warps=4, num_stages=2),
    "block": dict(BM=64, NW=256, num_warps=8, num_stages=2),
}


def block_scores_triton(q: Tensor, k: Tensor, cfg: NOSAConfig, softmax_scale: float | None = None) -> Tensor:
    """Query-aware block scores with forced (+inf) / future (-inf) blocks: fp32 ``[B, Hkv, L, nb]``."""
    from nosa_layers.selection import compressed_keys

    B, L, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs, ks, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    R = bs // st
    E = -(-ks // st) - 1
    nb, nw = cfg.num_blocks(L), cfg.num_windows(L)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    dt = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32
    q = q.to(dt)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if nw > 0:
        kc = compressed_keys(k.float(), cfg).to(dt)  # [B, nw, Hkv, D]
    else:
        kc = torch.zeros(B, 1, Hkv, D, dtype=dt, device=q.device)
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hkv, L, nb, dtype=torch.float32, device=q.device)
    c = SEL_CONFIG["lse"]
    _sel_lse_kernel[(triton.cdiv(L, c["BM"]), B * Hq)](
        q, kc, lse, L, *q.stride()[:3], *kc.stride()[:3], lse.stride(0), lse.stride(1), scale * LOG2E,
        HKV=Hkv, G=G, BM=c["BM"], BW=c["BW"], D=D, KS=ks, ST=st, num_warps=c["num_warps"], num_stages=c["num_stages"])
    c = SEL_CONFIG["block"]
    NBC = max(16 // R, c["NW"] // R) if q.is_cuda else max(16 // R, 4)
    EP = triton.next_power_of_2(max(E, 1))
    NBC = max(NBC, triton.cdiv(16, EP))
    _sel_block_kernel[(triton.cdiv(L, c["BM"]), B * Hkv)](
        q, kc, lse, out, L, nb, *q.stride()[:3], *kc.stride()[:3], lse.stride(0), lse.stride(1),
        *out.stride()[:3], scale * LOG2E,
        HKV=Hkv, G=G, BM=c["BM"], NBC=NBC, D=D, BS=bs, KS=ks, ST=st, R=R, E=E, EP=EP,
        INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


def agnostic_parts(score: Tensor, cfg: NOSAConfig, L: int) -> tuple[Tensor, Tensor]:
    """Pooled eviction scores of one document: ``static`` fp32 ``[B, Hkv, nb]`` per block and
    ``prev_part`` fp32 ``[B, Hkv, L]``, block ``qb - 1`` pooled over the windows visible to each
    row (-inf when none or ``qb == 0``). Only block ``qb - 1`` can have windows invisible to a row
    of block ``qb``; earlier blocks are fully visible, later blocks are future. O(L * W)."""
    from nosa_layers.selection import block_window_index, pool_to_blocks, window_scores

    B, _, Hkv = score.shape
    nb, nw = cfg.num_blocks(L), cfg.num_windows(L)
    dev = score.device
    ws = window_scores(score.float(), cfg) if nw > 0 else score.new_zeros(B, Hkv, 0, dtype=torch.float32)
    index = block_window_index(cfg, nb, nw, device=dev)  # [nb, W]
    static = pool_to_blocks(ws, index)  # [B, Hkv, nb]
    pos = torch.arange(L, device=dev)
    qb = pos // cfg.block_size
    widx = index[(qb - 1).clamp(min=0)]  # [L, W]
    vis = (widx < nw) & (widx * cfg.kernel_stride + cfg.kernel_size - 1 <= pos[:, None]) & (qb >= 1)[:, None]
    wsp = torch.cat([ws, ws.new_full((B, Hkv, 1), float("-inf"))], dim=-1)
    prev_part = wsp[:, :, widx.clamp(max=nw)].masked_fill(~vis, float("-inf")).amax(-1)  # [B, Hkv, L]
    return static, prev_part


def select_rows_triton(q: Tensor, k: Tensor, score: Tensor | None, cfg: NOSAConfig,
                       softmax_scale: float | None = None, topk=select_from_block_scores) -> Tensor:
    """Selection for one document (positions 0..L-1): bool ``[B, Hkv, L, nb]``.

    Triton block scores, then both top-k stages in the fused kernel of ``topk.py`` (``topk=
    select_from_block_scores_torch``: the plain-PyTorch stages, the kernel's reference)."""
    b_qa = block_scores_triton(q, k, cfg, softmax_scale)
    static, prev_part = (None, None) if score is None else agnostic_parts(score, cfg, q.shape[1])
    return topk(b_qa, static, prev_part, cfg)


def _supported(cfg: NOSAConfig, D: int) -> bool:
    R = cfg.block_size // cfg.kernel_stride
    return D in (16, 32, 64, 128, 256) and R & (R - 1) == 0


@torch.no_grad()
def select_blocks_triton(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                         cu_seqlens: Tensor | None = None, softmax_scale: float | None = None) -> Tensor:
    """GPU ``select_blocks``: bool ``[B, Hkv, T, nb]``, reference semantics and tie-breaking."""
    from nosa_layers.selection import _check, document_spans, select_blocks

    from .attention import check_device

    check_device(q, k, evict_score)
    _check(q, k, evict_score, cu_seqlens)
    if not _supported(cfg, q.shape[-1]):  # geometry the kernel does not cover: exact torch path
        return select_blocks(q, k, evict_score, cfg, cu_seqlens, softmax_scale)
    B, T = q.shape[:2]
    spans = document_spans(cu_seqlens, T)
    nb_max = max((cfg.num_blocks(e - s) for s, e in spans), default=0)
    out = torch.zeros(B, k.shape[2], T, nb_max, dtype=torch.bool, device=q.device)
    for s, e in spans:
        sd = None if evict_score is None else evict_score[:, s:e]
        out[:, :, s:e, :cfg.num_blocks(e - s)] = select_rows_triton(q[:, s:e], k[:, s:e], sd, cfg, softmax_scale)
    return out
