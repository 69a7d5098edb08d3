"""Placeholder (replaced below)."""
from __future__ import annotations
import torch
from nosa_layers.selection import select_blocks


def select_blocks_triton(q, k, evict_score, cfg, cu_seqlens=None, softmax_scale=None):
    from .attention import check_device
    check_device(q, k, evict_score)
    return select_blocks(q, k, evict_score, cfg, cu_seqlens, softmax_scale)
