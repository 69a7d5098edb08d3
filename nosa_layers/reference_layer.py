"""The single-device reference NOSA self-attention layer, in plain PyTorch (projections, RoPE,
eviction head, sparse attention).

Framework-free: used by tests, the locality demo and as the model of record for the Hugging
Face export; the megatron layer (``nosa_layers.megatron.NOSAMegatronSelfAttention``, used for
parallel training) is tested equal to it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nosa_layers.config import NOSAConfig
from nosa_layers.dispatch import nosa_attention
from nosa_layers.eviction import EvictionOutput, build_eviction_head


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float = 10000.0,
                 dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Llama-style rotary tables ``[T, D]`` for integer ``positions [T]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, D]`` with tables ``[T, D]`` (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def positions_from_cu_seqlens(cu_seqlens: Tensor | None, seq_len: int, device=None) -> Tensor:
    """Token positions ``[T]`` restarting at 0 at every document boundary."""
    pos = torch.arange(seq_len, device=device)
    if cu_seqlens is None:
        return pos
    starts = torch.zeros(seq_len, dtype=torch.long, device=device)
    for s in cu_seqlens[:-1].tolist():
        if s < seq_len:
            starts[s:] = s
    return pos - starts


class NOSAReferenceSelfAttention(nn.Module):
    """``[B, T, hidden] -> [B, T, hidden]``; parameter names follow the HF Llama layout."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, cfg: NOSAConfig,
                 head_dim: int | None = None, rope_theta: float = 10000.0,
                 attention_bias: bool = False, backend: str = "reference") -> None:
        super().__init__()
        self.cfg = cfg.validate()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.rope_theta, self.backend = rope_theta, backend
        d = self.head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * d, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=False)
        self.eviction = build_eviction_head(cfg.eviction_head, num_q_heads=num_heads,
                                            num_kv_heads=num_kv_heads, head_dim=d,
                                            bias=attention_bias, detach_value=cfg.detach_value)

    def project(self, x: Tensor, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, EvictionOutput]:
        """q (RoPE) ``[B,T,Hq,D]``, k (RoPE) and v ``[B,T,Hkv,D]``, eviction outputs."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        ev = self.eviction(q, k, v)
        cos, sin = rope_cos_sin(positions_from_cu_seqlens(cu_seqlens, T, x.device), self.head_dim,
                                self.rope_theta, dtype=x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, ev

    def forward(self, x: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        q, k, v, ev = self.project(x, cu_seqlens)
        out = nosa_attention(q, k, v, ev.score, self.cfg, cu_seqlens=cu_seqlens,
                             backend=self.backend, attn_bias=ev.bias)
        return self.o_proj(out.flatten(-2))
