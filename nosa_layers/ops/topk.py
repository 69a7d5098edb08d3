"""Fused exact top-k of the NOSA selection: both stages in one Triton kernel.

Input per document (positions 0..L-1, ``qb = t // block_size``, ``nb`` blocks):

- ``b_qa`` fp32 ``[B, Hkv, L, nb]``: query-aware block scores (``block_scores_triton``: forced
  blocks +inf, future blocks -inf);
- ``static`` fp32 ``[B, Hkv, nb]``: pooled eviction scores per block, or ``None`` (no eviction
  head: the whole budget is query-aware);
- ``prev_part`` fp32 ``[B, Hkv, L]``: pooled eviction score of block ``qb - 1`` restricted to the
  windows visible to row ``t`` (-inf when none or ``qb == 0``); it replaces ``static[qb - 1]``.

Per row only the columns ``m <= qb`` are ranked. Stage 1 takes the top
``min(query_aware_blocks, qb + 1)`` of ``b_qa``; stage 2 ranks ``+inf`` for forced blocks and the
stage-1 picks, else the eviction score, and keeps the top ``min(topk, qb + 1)``. Ties go to the
LOWER block index (the reference's stable descending sort), exactly.

Kernel: fp32 -> uint32 keys whose unsigned order is the float order (-0.0 == +0.0); the k-th
largest key ``tau`` of a row is found bit by bit (32 counting passes over a ``[BR, NBP]`` register
tile, no sort); the picks are ``key > tau`` plus the first ``k - #(key > tau)`` columns with
``key == tau``. ``select_from_block_scores_torch`` is the plain-PyTorch reference (two exact
``torch.topk`` on int64 keys), also the fallback for ``nb > MAX_BLOCKS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nosa_layers.config import NOSAConfig

MAX_BLOCKS = 8192  # widest row the kernel keeps in registers; wider rows use the torch path
TILE = 1024  # rows x padded blocks per program (H200: 1024..4096 within 5% at T=16K..32K)


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
    kz = tl.where(valid, key, tl.zeros_like(key))
    tau = tl.zeros_like(k).to(tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):
        cand = tau | bit
        cnt = tl.sum((kz >= cand[:, None]).to(tl.int32), axis=1)
        tau = tl.where(cnt >= k, cand, tau)
        bit = bit >> 1
    gt = valid & (key > tau[:, None])
    eq = valid & (key == tau[:, None])
    need = k - tl.sum(gt.to(tl.int32), axis=1)
    return gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=1) <= need[:, None]))


@triton.jit
def _select_kernel(BQA, STATIC, PREV, Out, L, nb, K1, K2,
                   s_ab, s_ah, s_at, s_sb, s_sh, s_pb, s_ph, s_ob, s_oh, s_ot,
                   HKV: tl.constexpr, BR: tl.constexpr, NBP: tl.constexpr, BS: tl.constexpr,
                   INIT: tl.constexpr, LOCAL: tl.constexpr, EVICT: tl.constexpr):
    t = tl.program_id(0) * BR + tl.arange(0, BR)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = (bh % HKV).to(tl.int64)
    m = tl.arange(0, NBP)
    row_ok = t < L
    qb = t // BS
    valid = (m[None, :] <= qb[:, None]) & row_ok[:, None]  # qb < nb for every real row
    t64 = t[:, None].to(tl.int64)
    x = tl.load(BQA + b * s_ab + h * s_ah + t64 * s_at + m[None, :], mask=valid, other=0.0)
    n_valid = qb + 1
    if EVICT:
        sel = _topk_rows(_orderable(x), valid, tl.minimum(n_valid, K1))
        st = tl.load(STATIC + b * s_sb + h * s_sh + m, mask=m < nb, other=0.0)
        pp = tl.load(PREV + b * s_pb + h * s_ph + t, mask=row_ok, other=0.0)
        agn = tl.where(m[None, :] == qb[:, None] - 1, pp[:, None], st[None, :])
        forced = (m[None, :] < INIT) | ((m[None, :] >= qb[:, None] - LOCAL) & (m[None, :] <= qb[:, None]))
        agn = tl.where(forced | sel, float("inf"), agn)
        sel = _topk_rows(_orderable(agn), valid, tl.minimum(n_valid, K2))
    else:
        sel = _topk_rows(_orderable(x), valid, tl.minimum(n_valid, K2))
    tl.store(Out + b * s_ob + h * s_oh + t64 * s_ot + m[None, :], sel.to(tl.uint8),
             mask=row_ok[:, None] & (m < nb)[None, :])


def select_from_block_scores(b_qa: Tensor, static: Tensor | None, prev_part: Tensor | None,
                             cfg: NOSAConfig) -> Tensor:
    """Both top-k stages fused (see the module docstring): bool ``[B, Hkv, L, nb]``."""
    B, Hkv, L, nb = b_qa.shape
    assert nb >= cfg.num_blocks(L), f"b_qa has {nb} blocks for {L} rows"
    if nb > MAX_BLOCKS:
        return select_from_block_scores_torch(b_qa, static, prev_part, cfg)
    out = torch.empty(B, Hkv, L, nb, dtype=torch.bool, device=b_qa.device)
    if out.numel() == 0:
        return out
    b_qa = b_qa.float()
    if b_qa.stride(-1) != 1:
        b_qa = b_qa.contiguous()
    evict = static is not None
    if evict:
        static, prev_part = static.float(), prev_part.float()
    else:
        static = prev_part = b_qa.new_empty(1, 1, 1)  # unused
    # Few compiled variants: documents of any length up to 64 blocks share one (packed training
    # batches bring a new length with almost every document; each new variant is a compile).
    NBP = max(triton.next_power_of_2(nb), 64)
    BR = max(1, TILE // NBP)
    _select_kernel[(triton.cdiv(L, BR), B * Hkv)](
        b_qa, static, prev_part, out.view(torch.uint8), L, nb, cfg.query_aware_blocks, cfg.topk,
        *b_qa.stride()[:3], *static.stride()[:2], *prev_part.stride()[:2], *out.stride()[:3],
        HKV=Hkv, BR=BR, NBP=NBP, BS=cfg.block_size, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks,
        EVICT=evict, num_warps=max(2, min(16, BR * NBP // 512)))
    return out


# --- plain-PyTorch reference -------------------------------------------------------------------

def _order_keys(x: Tensor, nb: int) -> Tensor:
    """Unique int64 keys, descending order of which == stable descending order of ``x`` (fp32)."""
    x = x.float() + 0.0  # -0.0 -> +0.0
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg = u >= 0x80000000
    u = torch.where(neg, (~u) & 0xFFFFFFFF, u | 0x80000000)
    idx = torch.arange(nb, device=x.device, dtype=torch.int64)
    return (u << 21) | (nb - 1 - idx)


def _topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` largest entries along the last dim, ties to the lower index."""
    nb = scores.shape[-1]
    assert nb < (1 << 21)
    top = torch.topk(_order_keys(scores, nb), k, dim=-1, sorted=False).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, True)


def select_from_block_scores_torch(b_qa: Tensor, static: Tensor | None, prev_part: Tensor | None,
                                   cfg: NOSAConfig, row_chunk: int = 2048) -> Tensor:
    """Reference of ``select_from_block_scores``: two exact ``torch.topk`` per chunk of rows, the
    chunk cut to the blocks its last row can see. Bool ``[B, Hkv, L, nb]``."""
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
        bq = b_qa[:, :, c0:c1, :w].masked_fill(future, float("-inf"))
        if static is None:
            out[:, :, c0:c1, :w] = _topk_mask(bq, min(cfg.topk, w)) & ~future
            continue
        qa = _topk_mask(bq, min(cfg.query_aware_blocks, w))
        forced = (blk[None, :] < cfg.init_blocks) | ((blk[None, :] >= qb - cfg.local_blocks) & ~future)
        agn = static[:, :, None, :w].expand(B, Hkv, c1 - c0, w).clone()
        rows = torch.nonzero(qb[:, 0] >= 1).squeeze(1)
        agn[:, :, rows, qb[rows, 0] - 1] = prev_part[:, :, c0:c1][:, :, rows]
        agn = agn.masked_fill(forced | qa, float("inf")).masked_fill(future, float("-inf"))
        out[:, :, c0:c1, :w] = _topk_mask(agn, min(cfg.topk, w)) & ~future
    return out
