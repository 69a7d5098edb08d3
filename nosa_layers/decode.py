"""Decode step: one new token per sequence against its KV cache (reference semantics).

State lives in explicit caches passed by the caller (no module state), so batch > 1 with
different lengths, chunked prefill and re-running a step all work. The selection of step ``t``
equals row ``t`` of the parallel path on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nosa_layers.config import BIAS_FROM_SCORE, NOSAConfig
from nosa_layers.reference import block_sparse_attention
from nosa_layers.selection import select_rows


@dataclass
class DecodeOutput:
    out: Tensor  # [B, 1, Hq, D]
    selected: Tensor  # [B, Hkv, nb] bool, nb = ceil(max cache length / block_size)


@torch.no_grad()
def select_decode(q: Tensor, k_cache: Tensor, score_cache: Tensor | None, cfg: NOSAConfig,
                  cache_seqlens: Tensor | None = None, softmax_scale: float | None = None) -> Tensor:
    """Blocks selected for the newest token of each sequence -> bool ``[B, Hkv, nb]``.

    q ``[B, 1, Hq, D]`` is the token at position ``cache_seqlens[b] - 1``; the caches
    ``k_cache [B, Lmax, Hkv, D]`` / ``score_cache [B, Lmax, Hkv]`` already hold it.
    """
    B, Lmax, Hkv, _ = k_cache.shape
    lens = _lengths(cache_seqlens, B, Lmax)
    out = torch.zeros(B, Hkv, cfg.num_blocks(Lmax), dtype=torch.bool, device=q.device)
    for b, L in enumerate(lens):
        pos = torch.tensor([L - 1], device=q.device)
        score = None if score_cache is None else score_cache[b:b + 1, :L]
        rows = select_rows(q[b:b + 1], k_cache[b:b + 1, :L], score, pos, cfg, softmax_scale)
        out[b, :, :rows.shape[-1]] = rows[0, :, 0]
    return out


def nosa_decode_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, score_cache: Tensor | None,
                     cfg: NOSAConfig, cache_seqlens: Tensor | None = None,
                     bias_cache: Tensor | None | str = BIAS_FROM_SCORE,
                     softmax_scale: float | None = None) -> DecodeOutput:
    """Attention of one new token per sequence over its selected cached blocks.

    q ``[B, 1, Hq, D]`` (post-RoPE), caches ``[B, Lmax, Hkv, D]`` including the new token,
    ``score_cache [B, Lmax, Hkv]`` (or None: query-aware only), ``cache_seqlens [B]`` valid
    lengths (default: all ``Lmax``), ``bias_cache`` defaults to ``score_cache``.
    """
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"decode expects q of shape [B, 1, Hq, D], got {tuple(q.shape)}")
    bias = score_cache if isinstance(bias_cache, str) and bias_cache == BIAS_FROM_SCORE else bias_cache
    selected = select_decode(q, k_cache, score_cache, cfg, cache_seqlens, softmax_scale)
    lens = _lengths(cache_seqlens, q.shape[0], k_cache.shape[1])
    outs = []
    for b, L in enumerate(lens):
        outs.append(block_sparse_attention(
            q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L], selected[b:b + 1, :, None],
            cfg.block_size, bias=None if bias is None else bias[b:b + 1, :L],
            softmax_scale=softmax_scale, q_offset=L - 1))
    return DecodeOutput(out=torch.cat(outs, dim=0), selected=selected)


def _lengths(cache_seqlens: Tensor | None, batch: int, max_len: int) -> list[int]:
    if cache_seqlens is None:
        return [max_len] * batch
    lens = [int(x) for x in cache_seqlens.tolist()]
    if len(lens) != batch or min(lens) < 1 or max(lens) > max_len:
        raise ValueError(f"cache_seqlens must hold {batch} lengths in [1, {max_len}], got {lens}")
    return lens
