"""Eviction heads: the query-agnostic per-token score of NOSA and its ablation variants.

Every head maps one layer's projections to

* ``score [B, T, Hkv]`` (fp32): what the query-agnostic selection ranks (mean-pooled over the
  compressed windows, then max-pooled to blocks), or ``None`` for query-aware-only selection;
* ``bias  [B, T, Hkv]`` (fp32): an additive attention-logit bias applied at full scale (after the
  ``1/sqrt(D)`` scaling) to every selected key of that KV head, or ``None``.

Heads are registered by name; ``NOSAConfig.eviction_head`` picks one. Parameter names and shapes
of ``ed_dma`` match the public NOSA checkpoints (``A [Hkv]``, ``delta.weight [Hkv, Hkv*D]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EVICTION_HEADS: dict[str, type["EvictionHead"]] = {}


def register_eviction_head(name: str) -> Callable[[type["EvictionHead"]], type["EvictionHead"]]:
    def wrap(cls: type["EvictionHead"]) -> type["EvictionHead"]:
        if name in EVICTION_HEADS:
            raise ValueError(f"eviction head {name!r} is already registered")
        cls.name = name
        EVICTION_HEADS[name] = cls
        return cls

    return wrap


def build_eviction_head(name: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        bias: bool = False, detach_value: bool = False, **kwargs) -> "EvictionHead":
    """Instantiate the eviction head registered as ``name``."""
    if name not in EVICTION_HEADS:
        raise ValueError(f"unknown eviction head {name!r}; choose one of {sorted(EVICTION_HEADS)}")
    return EVICTION_HEADS[name](num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, bias=bias, detach_value=detach_value, **kwargs)


@dataclass
class EvictionOutput:
    score: Tensor | None  # [B, T, Hkv] fp32, ranked by the query-agnostic selection
    bias: Tensor | None  # [B, T, Hkv] fp32, additive attention-logit bias (full scale)


class EvictionHead(nn.Module):
    """Base class. ``forward(q, k, v)`` with q ``[B,T,Hq,D]``, k/v ``[B,T,Hkv,D]`` (pre-RoPE)."""

    name: str = ""
    has_score: bool = True
    reads_qk: bool = False  # True if forward() reads q and k (callers may skip gathering them otherwise)

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 detach_value: bool = False) -> None:
        super().__init__()
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.detach_value = detach_value

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        raise NotImplementedError


def value_gated_score(v: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor) -> Tensor:
    """The value-gated score ``A * softplus(v.flatten(-2) @ weight.T + bias)`` in fp32 (the reference):
    ``v [B, T, Hkv, D]``, ``weight [Hkv, Hkv * D]``, ``bias [Hkv]`` or ``None``, ``A [Hkv]`` -> ``[B, T, Hkv]``."""
    z = F.linear(v.flatten(-2).float(), weight.float(), None if bias is None else bias.float())
    return A.float() * F.softplus(z)


class ValueGatedHead(EvictionHead):
    """Shared by ED-DMA, DMA and S-DMA: ``s = A * softplus(delta(concat_h v_h))``.

    ``delta`` reads the whole value row (all KV heads, head-major), so the score of one KV head
    depends on the values of every KV head (the reference's coupling). ``A`` starts at zero, so
    at initialisation only ``A`` receives gradient and the ranking is decided by tie-breaking.
    ``score_op`` computes ``s``: the reference :func:`value_gated_score`, or a fused kernel of the
    same signature and semantics (the megatron layer spec passes one under ``train.fusions``).
    """

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 detach_value: bool = False, score_op: Callable[..., Tensor] = value_gated_score) -> None:
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         bias=bias, detach_value=detach_value)
        self.A = nn.Parameter(torch.zeros(num_kv_heads))
        self.delta = nn.Linear(num_kv_heads * head_dim, num_kv_heads, bias=bias)
        self.score_op = score_op

    def gated_score(self, v: Tensor) -> Tensor:
        """``A * softplus(delta(v))`` in fp32, ``[B, T, Hkv]``, by ``score_op``."""
        if self.detach_value:
            v = v.detach()
        return self.score_op(v, self.delta.weight, self.delta.bias, self.A)


@register_eviction_head("ed_dma")
class EDDMAHead(ValueGatedHead):
    """NOSA: rank on ``s`` and add ``s`` to the logits (probabilities scaled by ``exp(s)``)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        s = self.gated_score(v)
        return EvictionOutput(score=s, bias=s)


@register_eviction_head("dma")
class DMAHead(ValueGatedHead):
    """Doge's dynamic mask attention: rank on ``exp(s)`` and add ``exp(s)`` to the logits."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        e = torch.exp(self.gated_score(v))
        return EvictionOutput(score=e, bias=e)


@register_eviction_head("s_dma")
class StraightThroughDMAHead(ValueGatedHead):
    """Straight-through: rank on ``s``; the forward adds 0 to the logits, the backward treats
    ``s`` as an additive bias (``bias = s - stopgrad(s)``), so the head learns as in ED-DMA
    without changing the attention output."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        s = self.gated_score(v)
        return EvictionOutput(score=s, bias=s - s.detach())


@register_eviction_head("locret")
class LocretHead(EvictionHead):
    """Locret-style MLP on the token's own ``[q; k; v]`` (all heads, pre-RoPE):
    ``fc2(act(fc1(.)))`` with ``fc1: (Hq+2Hkv)*D -> hidden``, ``fc2: hidden -> Hkv``, no biases.

    Training choice (not published by the NOSA authors): the score is also added as a full-scale
    logit bias, i.e. the head is trained end to end through the attention exactly like ED-DMA.
    Locret's own regression loss needs the full attention map (O(T^2)) that the sparse kernels
    never build.
    """

    reads_qk = True

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 detach_value: bool = False, hidden_size: int = 1024, act: str = "silu") -> None:
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         bias=bias, detach_value=detach_value)
        self.fc1 = nn.Linear((num_q_heads + 2 * num_kv_heads) * head_dim, hidden_size, bias=False)
        self.fc2 = nn.Linear(hidden_size, num_kv_heads, bias=False)
        self.act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[act]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        x = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        if self.detach_value:
            x = x.detach()
        s = self.fc2(self.act(self.fc1(x.to(self.fc1.weight.dtype)))).float()
        return EvictionOutput(score=s, bias=s)


@register_eviction_head("none")
class NoEvictionHead(EvictionHead):
    """InfLLM-V2: no query-agnostic score, no bias; every dynamic block is query-aware."""

    has_score = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        return EvictionOutput(score=None, bias=None)
