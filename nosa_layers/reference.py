"""Dense-masked attention over selected blocks: the numerical ground truth of every fast path.

``out[t, i] = sum_j softmax_j(q[t,i] . k[j,h] * scale + bias[j,h]) v[j,h]`` over the keys ``j <= t``
whose block is selected for (t, h), with ``h = i // G``. The bias is added at full scale (after
the softmax scaling), as the reference's two-call ``exp(bias)`` formulation computes. Memory is
O(B * Hq * T^2): for tests and short sequences only.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, selected: Tensor, block_size: int,
                           bias: Tensor | None = None, softmax_scale: float | None = None,
                           q_offset: int = 0) -> Tensor:
    """Causal attention restricted to selected KV blocks.

    q ``[B, Tq, Hq, D]`` for absolute positions ``q_offset .. q_offset+Tq-1``; k, v ``[B, L, Hkv, D]``;
    selected bool ``[B, Hkv, Tq, >= ceil(L/block_size)]``; bias ``[B, L, Hkv]`` or None.
    Returns ``[B, Tq, Hq, D]`` in q's dtype; the softmax runs in at least fp32.
    """
    B, Tq, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5

    key_block = torch.arange(L, device=q.device) // block_size
    rows = torch.arange(Tq, device=q.device) + q_offset
    causal = torch.arange(L, device=q.device)[None, :] <= rows[:, None]  # [Tq, L]
    allowed = selected[..., key_block] & causal  # [B, Hkv, Tq, L]

    logits = torch.einsum("bthgd,bshd->bhgts", q.to(dtype).view(B, Tq, Hkv, G, D), k.to(dtype)) * scale
    if bias is not None:
        logits = logits + bias.to(dtype).permute(0, 2, 1)[:, :, None, None, :]
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgts,bshd->bthgd", probs, v.to(dtype))
    return out.reshape(B, Tq, Hq, D).to(q.dtype)
