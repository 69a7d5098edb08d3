"""Block selection of the NOSA reference (pure PyTorch, no grad).

For every query token and KV head the selection picks KV blocks of ``cfg.block_size`` tokens:

1. forced: the ``init_blocks`` sink blocks, the query's own block and the ``local_blocks`` before it;
2. query-aware: blocks ranked by the group-summed softmax of the query against mean-pooled
   compressed keys (windows of ``kernel_size`` tokens every ``kernel_stride``), max-pooled to
   blocks; ``init + local + select`` blocks (forced ones included) are taken;
3. query-agnostic fill: the remaining budget up to ``topk`` is taken from the eviction score,
   mean-pooled over the same windows and max-pooled to blocks.

Shapes: ``q [B, Tq, Hq, D]``, ``k [B, L, Hkv, D]``, ``score [B, L, Hkv]``; the result is a bool
mask ``[B, Hkv, Tq, ceil(L / block_size)]``. Ties are broken towards the LOWER block index
(stable descending sort), identically in the parallel and the decode paths.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.query_chunks import QueryChunks, full_chunks

NEG_INF = float("-inf")
POS_INF = float("inf")


def block_window_index(cfg: NOSAConfig, num_blocks: int, num_windows: int, device=None) -> Tensor:
    """``[num_blocks, W]`` indices of the full windows overlapping each block's tokens.

    Window ``w`` covers tokens ``[w*stride, w*stride + kernel)``; block ``m`` covers
    ``[m*bs, (m+1)*bs)``. Padding entries point at ``num_windows`` (a ``-inf`` column). For
    64/32/16 block ``m`` pools windows ``4m-1 .. 4m+3``.
    """
    bs, ks, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    m = torch.arange(num_blocks, device=device)
    lo = torch.div(m * bs - ks, st, rounding_mode="floor") + 1
    hi = torch.div((m + 1) * bs + st - 1, st, rounding_mode="floor") - 1  # ceil((m+1)bs/st) - 1
    lo = lo.clamp(min=0)
    hi = hi.clamp(max=num_windows - 1)
    width = math.ceil((bs + ks) / st)
    idx = lo[:, None] + torch.arange(width, device=device)
    return idx.masked_fill(idx > hi[:, None], num_windows)


def pool_to_blocks(x: Tensor, index: Tensor) -> Tensor:
    """Max-pool window scores ``[..., nw]`` to block scores ``[..., nb]`` (``-inf`` if no window)."""
    pad = x.new_full((*x.shape[:-1], 1), NEG_INF)
    return torch.cat([x, pad], dim=-1)[..., index].amax(dim=-1)


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` largest entries along the last dim; ties go to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)


def two_stage_blocks(b_qa: Tensor, b_qg: Tensor | None, forced: Tensor, future: Tensor, cfg: NOSAConfig) -> Tensor:
    """The selection's two stages on pooled block scores: each row's ``K = min(topk, nb)`` blocks, best first.

    ``b_qa [..., nb]``: query-aware block scores, the forced blocks at +inf (as the scoring writes them);
    ``b_qg [..., nb]``: query-agnostic ones (pooled eviction score), or None (InfLLM-V2: the whole budget is
    query-aware); ``forced`` / ``future`` bool, broadcastable: the sink and window blocks, and the blocks past
    the row's own. Stage 1 takes ``min(query_aware_blocks, nb)`` blocks by ``b_qa``; stage 2 ranks the forced
    and stage-1 blocks first, then the others by ``b_qg``. Ties go to the lower block index (stable sort).
    Returns long ``[..., K]``; a row with fewer than ``K`` blocks up to its own is padded with future blocks
    (mask them with ``future``)."""
    nb = b_qa.shape[-1]
    ranked = b_qa.masked_fill(future, NEG_INF)
    if b_qg is not None:
        query_aware = topk_mask(ranked, min(cfg.query_aware_blocks, nb))
        ranked = b_qg.masked_fill(forced | query_aware, POS_INF).masked_fill(future, NEG_INF)
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :min(cfg.topk, nb)]


def blocks_mask(blocks: Tensor, nb: int) -> Tensor:
    """Bool ``[..., nb]`` with the block indices ``blocks [..., K]`` set."""
    return torch.zeros(*blocks.shape[:-1], nb, dtype=torch.bool, device=blocks.device).scatter_(-1, blocks, True)


def compressed_keys(k: Tensor, cfg: NOSAConfig) -> Tensor:
    """Mean of ``k [B, L, Hkv, D]`` over each full window -> ``[B, nw, Hkv, D]``."""
    return k.unfold(1, cfg.kernel_size, cfg.kernel_stride).mean(dim=-1)


def window_scores(score: Tensor, cfg: NOSAConfig) -> Tensor:
    """Mean of ``score [B, L, Hkv]`` over each full window -> ``[B, Hkv, nw]``."""
    return score.unfold(1, cfg.kernel_size, cfg.kernel_stride).mean(dim=-1).transpose(1, 2)


@torch.no_grad()
def select_rows(q: Tensor, k: Tensor, score: Tensor | None, pos: Tensor, cfg: NOSAConfig,
                softmax_scale: float | None = None) -> Tensor:
    """Selection for query rows at absolute positions ``pos [Tq]`` against keys ``k [B, L, ...]``.

    Rows only see windows and blocks at or before their own position, so the result for a row is
    a function of the prefix ``[0, pos]`` alone. Returns bool ``[B, Hkv, Tq, ceil(L/bs)]``.
    """
    B, Tq, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    nb, nw = cfg.num_blocks(L), cfg.num_windows(L)
    index = block_window_index(cfg, nb, nw, device=q.device)

    w = torch.arange(nw, device=q.device)
    visible = (w * cfg.kernel_stride + cfg.kernel_size - 1)[None, :] <= pos[:, None]  # [Tq, nw]

    if nw > 0:
        kc = compressed_keys(k.to(dtype), cfg)  # [B, nw, Hkv, D]
        logits = torch.einsum("bthgd,bwhd->bhgtw", q.to(dtype).view(B, Tq, Hkv, G, D), kc) * scale
        logits = logits.masked_fill(~visible, NEG_INF)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible window -> 0
        s_qa = probs.sum(dim=2).masked_fill(~visible, NEG_INF)  # [B, Hkv, Tq, nw]
    else:
        s_qa = torch.empty(B, Hkv, Tq, 0, dtype=dtype, device=q.device)
    b_qa = pool_to_blocks(s_qa, index)  # [B, Hkv, Tq, nb]

    blk = torch.arange(nb, device=q.device)
    qb = torch.div(pos, cfg.block_size, rounding_mode="floor")[:, None]
    forced = (blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb))  # [Tq, nb]
    future = blk > qb
    b_qa = b_qa.masked_fill(forced, POS_INF)

    b_qg = None  # InfLLM-V2 (no score): the whole budget is query-aware
    if score is not None:
        if nw > 0:
            s_qg = window_scores(score.to(dtype), cfg)[:, :, None, :].expand(B, Hkv, Tq, nw)
            s_qg = s_qg.masked_fill(~visible, NEG_INF)  # causal per row (matters only without a window)
        else:
            s_qg = torch.empty(B, Hkv, Tq, 0, dtype=dtype, device=q.device)
        b_qg = pool_to_blocks(s_qg, index)
    return blocks_mask(two_stage_blocks(b_qa, b_qg, forced, future, cfg), nb) & ~future


def check_inputs(q: Tensor, k: Tensor, score: Tensor | None, cu_seqlens: Tensor | None,
                 q_chunks: QueryChunks | None = None) -> None:
    """One-line ``ValueError`` unless q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]``, score ``[B, T, Hkv]`` and
    ``cu_seqlens`` (B = 1, rising from 0 to T) fit together; with ``q_chunks`` q holds only the chunks'
    ``Tq`` rows of the ``T``-token row."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Tq, Hq, D = q.shape
    T = k.shape[1]
    if q_chunks is not None:
        q_chunks.check(Tq, T)
    elif Tq != T:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in T (pass q_chunks for a query "
                         f"subset)")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B or D")
    if Hq % k.shape[2]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({k.shape[2]})")
    if score is not None and tuple(score.shape) != (B, T, k.shape[2]):
        raise ValueError(f"evict_score must be [B, T, Hkv] = {(B, T, k.shape[2])}, got {tuple(score.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 offsets, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type != "cpu":
            return  # no host sync per call: the values are checked where they are read on the host
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")


def document_spans(cu_seqlens: Tensor | None, seq_len: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each non-empty document; one span for unpacked input."""
    if cu_seqlens is None:
        return [(0, seq_len)]
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != seq_len or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={seq_len}, got {cu}")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


@torch.no_grad()
def select_blocks_reference(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                            cu_seqlens: Tensor | None = None, softmax_scale: float | None = None,
                            chunk_size: int = 1024, q_chunks: QueryChunks | None = None) -> Tensor:
    """Causal NOSA block selection for every query token (parallel / training path), pure PyTorch.

    q ``[B, T, Hq, D]`` and k ``[B, T, Hkv, D]`` post-RoPE, evict_score ``[B, T, Hkv]`` or ``None``
    (query-aware only, InfLLM-V2). With ``cu_seqlens`` (B = 1) block indices restart at every
    document. Returns bool ``[B, Hkv, T, nb]`` with ``nb = ceil(longest document / block_size)``;
    ``True`` means the KV block is selected for that query token. ``q_chunks``: q holds only the
    chunks' ``Tq`` query rows (global positions from the chunks), the result is ``[B, Hkv, Tq, nb]``.
    Query rows are processed in pieces of ``chunk_size`` to bound memory (O(chunk * T / kernel_stride)).
    """
    check_inputs(q, k, evict_score, cu_seqlens, q_chunks)
    B, Tq = q.shape[:2]
    T = k.shape[1]
    spans = document_spans(cu_seqlens, T)
    nb_max = max((cfg.num_blocks(e - s) for s, e in spans), default=0)
    out = torch.zeros(B, k.shape[2], Tq, nb_max, dtype=torch.bool, device=q.device)
    for s, e, lo, hi, row in (q_chunks or full_chunks(T)).pieces(spans):
        kd = k[:, s:e]
        sd = None if evict_score is None else evict_score[:, s:e]
        nb = cfg.num_blocks(e - s)
        for c in range(lo, hi, chunk_size):
            n = min(chunk_size, hi - c)
            pos = torch.arange(c - s, c - s + n, device=q.device)
            r = row + c - lo
            out[:, :, r:r + n, :nb] = select_rows(q[:, r:r + n], kd, sd, pos, cfg, softmax_scale)
    return out
