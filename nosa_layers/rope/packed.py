"""Positions of packed documents, computed on the device (pure PyTorch, no host sync)."""

from __future__ import annotations

import torch
from torch import Tensor


def document_positions(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """Position of every packed token within its document, ``[num_tokens]`` int64, on the device.

    ``cu_seqlens [n+1]`` (int) starts at 0 and ends at ``num_tokens``; zero-length documents are
    allowed. No host sync: ``pos[t] = t - cu_seqlens[doc(t)]`` with ``doc`` from ``searchsorted``.
    """
    t = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, t, right=True) - 1
    return (t - cu_seqlens[doc]).long()
