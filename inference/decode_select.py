"""Batched decode math of the block KV cache: the reference selection and attention of one new token
per sequence, for all sequences of a batch at once (pure PyTorch).

Shapes: ``B`` sequences, ``Hkv`` KV heads, ``G`` query heads per KV head, head dim ``D``; ``NW``
windows (compressed keys) and ``NB`` blocks of capacity per sequence; ``pos [B]`` is each new token's
position (tokens), so sequence ``b`` has ``pos[b] + 1`` valid tokens and ``pos[b] // block_size + 1``
valid blocks. Selection scores and the attention softmax run in at least fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.selection import pool_to_blocks, two_stage_blocks

NEG_INF = float("-inf")
POS_INF = float("inf")


def decode_masks(pos: Tensor, cfg: NOSAConfig, NB: int, NW: int) -> dict:
    """What the batched selection derives from the positions alone (shared by all layers of a step):
    ``hidden [B, 1, NW]`` (windows not complete yet), ``forced`` / ``future [B, 1, NB]``, ``qb [B, 1]``;
    ``pinned [B, 1, NB]`` (forced or future) and ``pin_value`` (``-inf`` future, ``+inf`` forced)."""
    dev = pos.device
    n = pos + 1
    nw = torch.where(n >= cfg.kernel_size,
                     torch.div(n - cfg.kernel_size, cfg.kernel_stride, rounding_mode="floor") + 1, 0)
    hidden = (torch.arange(NW, device=dev)[None, :] >= nw[:, None])[:, None]
    blk = torch.arange(NB, device=dev)[None, :]
    qb = torch.div(pos, cfg.block_size, rounding_mode="floor")[:, None]
    forced = ((blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb)))[:, None]
    future = (blk > qb)[:, None]
    # folded for select_decode_fast: the blocks whose score is pinned, and the value they get
    # (future -inf wins over forced +inf, as in the reference's two masked_fills)
    pinned = forced | future
    pin_value = torch.where(future, NEG_INF, POS_INF)
    return {"hidden": hidden, "forced": forced, "future": future, "qb": qb, "pinned": pinned, "pin_value": pin_value}


@torch.no_grad()
def select_decode_batched(q: Tensor, kc: Tensor, wsc: Tensor | None, pos: Tensor, cfg: NOSAConfig,
                          index: Tensor, softmax_scale: float, masks: dict | None = None) -> tuple[Tensor, Tensor]:
    """The reference selection (``select_rows``) of one new token per sequence, batched.

    q ``[B, Hkv, G, D]`` post-RoPE; ``kc [B, Hkv, NW, D]`` compressed keys and ``wsc [B, Hkv, NW]``
    window score means of capacity ``NW`` windows, of which the first ``num_windows(pos + 1)`` are
    valid per sequence; ``pos [B]`` the token positions; ``index`` = ``block_window_index(cfg, NB, NW)``.
    Returns ``(blocks [B, Hkv, K] long, ok [B, Hkv, K] bool)`` with ``K = min(topk, NB)``: the
    selected block indices (``ok`` False on padding entries of sequences with fewer blocks).
    """
    NW, NB = kc.shape[2], index.shape[0]
    m = masks if masks is not None else decode_masks(pos, cfg, NB, NW)
    hidden, forced, future, qb = m["hidden"], m["forced"], m["future"], m["qb"]
    dt = torch.promote_types(kc.dtype, torch.float32)  # kc may be stored in bf16 / fp16: scores in fp32
    logits = torch.matmul(q.to(dt), kc.to(dt).transpose(-1, -2)) * softmax_scale  # [B, Hkv, G, NW]
    logits = logits.masked_fill(hidden[:, :, None], NEG_INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    s_qa = probs.sum(dim=2).masked_fill(hidden, NEG_INF)
    b_qa = pool_to_blocks(s_qa, index).masked_fill(forced, POS_INF)  # [B, Hkv, NB]
    b_qg = None if wsc is None else pool_to_blocks(wsc.masked_fill(hidden, NEG_INF), index)
    blocks = two_stage_blocks(b_qa, b_qg, forced, future, cfg)
    return blocks, blocks <= qb[:, :, None]


@torch.no_grad()
def select_decode_fast(q: Tensor, kc: Tensor, wsc: Tensor | None, cfg: NOSAConfig, index: Tensor,
                       softmax_scale: float, masks: dict) -> tuple[Tensor, Tensor]:
    """:func:`select_decode_batched` with fewer operations per layer (same selection; tested against it).

    ``kc [B, Hkv, NW + 1, D]`` and ``wsc [B, Hkv, NW + 1]`` carry one column past the ``NW`` windows (the
    cache's sink column, any finite values) and ``masks = decode_masks(pos, cfg, NB, NW + 1)``: that column
    is always hidden, so it is the ``-inf`` padding that ``index`` points at (no padded copies), and the
    softmax of a row with no complete window (all ``NaN``) is overwritten by the hidden mask (no
    ``nan_to_num``); forced and future blocks are pinned by one ``where`` (``masks["pinned"]``); the
    query-agnostic stage pins the query-aware blocks and the forced / future ones in two; masks are applied
    by ``where`` (out-of-place ``masked_fill`` is a copy and a fill). Returns
    ``(blocks [B, Hkv, K] long, ok [B, Hkv, K] bool)``."""
    hidden, qb = masks["hidden"], masks["qb"]
    pinned, pin_value = masks["pinned"], masks["pin_value"]
    NB = index.shape[0]
    dt = torch.promote_types(kc.dtype, torch.float32)
    logits = torch.matmul(q.to(dt), kc.to(dt).transpose(-1, -2)) * softmax_scale  # [B, Hkv, G, NW + 1]
    probs = torch.softmax(torch.where(hidden[:, :, None], NEG_INF, logits), dim=-1)
    s_qa = torch.where(hidden, NEG_INF, probs.sum(dim=2))
    ranked = torch.where(pinned, pin_value, s_qa[..., index].amax(dim=-1))  # [B, Hkv, NB]
    if wsc is not None:
        b_qg = torch.where(hidden, NEG_INF, wsc)[..., index].amax(dim=-1)
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :min(cfg.query_aware_blocks, NB)]
        query_aware = torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, order, True)
        ranked = torch.where(pinned, pin_value, torch.where(query_aware, POS_INF, b_qg))
    blocks = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :min(cfg.topk, NB)]
    return blocks, blocks <= qb[:, :, None]


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, ok: Tensor, scale: float) -> Tensor:
    """One query row per (sequence, query head): ``q [B, Hkv, G, D]``, ``k, v [B, Hkv, S, D]``,
    ``bias [B, Hkv, S]`` or None, ``ok [B, Hkv, S]`` bool (key allowed). The softmax runs in at least
    fp32; returns ``[B, Hkv, G, D]`` in that dtype."""
    dt = torch.promote_types(q.dtype, torch.float32)
    logits = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias[:, :, None, :]
    logits = logits.masked_fill(~ok[:, :, None, :], NEG_INF)
    return torch.matmul(torch.softmax(logits, dim=-1), v.to(dt))


