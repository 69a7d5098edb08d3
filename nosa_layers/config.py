"""NOSA geometry and selection budget (one typed config, validated in one place)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# ``attn_bias`` / ``bias_cache`` default of the attention entry points: the bias is the eviction
# score itself (ED-DMA); pass a tensor for another bias, or ``None`` for none.
BIAS_FROM_SCORE = "score"


@dataclass
class NOSAConfig:
    """Block-sparse selection parameters of one NOSA attention layer.

    Units are tokens (``block_size``, ``kernel_size``, ``kernel_stride``) or KV blocks (the rest).
    Defaults are the released NOSA models: 64-token blocks, 32/16 compression windows, 1 sink
    block, a 16-block sliding window, 16 query-aware blocks and 64 blocks in total.

    ``topk`` is the TOTAL budget (sink, window, query-aware and query-agnostic blocks together),
    as in ``thunlp/NOSA``; note that the query's own (partial) block is forced in addition to the
    ``local_blocks`` before it, so it uses one of the ``init + local + select`` query-aware slots.
    """

    block_size: int = 64
    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    local_blocks: int = 16
    select_blocks: int = 16
    topk: int = 64
    eviction_head: str = "ed_dma"
    detach_value: bool = False  # detach v in front of the eviction head (reference: False)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], **overrides: Any) -> "NOSAConfig":
        """The config from a mapping that holds every field (e.g. the ``nosa_config`` block of an
        export's ``config.json``; other keys are ignored); ``overrides`` win. Not validated."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in values and n not in overrides]
        if missing:
            raise ValueError(f"NOSAConfig: missing {', '.join(missing)}")
        return cls(**{**{n: values[n] for n in names if n in values}, **overrides})

    @property
    def query_aware_blocks(self) -> int:
        """Blocks chosen by the query-aware stage, forced blocks included (33 by default)."""
        return self.init_blocks + self.local_blocks + self.select_blocks

    @property
    def query_agnostic_blocks(self) -> int:
        """k_e: blocks left for the eviction-score fill once the query-aware stage is full (31)."""
        return self.topk - self.query_aware_blocks

    @property
    def dense_len(self) -> int:
        """Sequences up to this many tokens attend densely (every causal block fits the budget)."""
        return self.topk * self.block_size

    def num_blocks(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def num_windows(self, seq_len: int) -> int:
        """Full compressed windows in a sequence of ``seq_len`` tokens (0 if shorter than one)."""
        if seq_len < self.kernel_size:
            return 0
        return (seq_len - self.kernel_size) // self.kernel_stride + 1

    def validate(self) -> "NOSAConfig":
        from nosa_layers.eviction import EVICTION_HEADS

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"NOSAConfig: {msg}")

        for name in ("block_size", "kernel_size", "kernel_stride", "topk"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("init_blocks", "local_blocks", "select_blocks"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
                 f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        need(self.kernel_stride <= self.kernel_size,
             f"kernel_stride ({self.kernel_stride}) must be <= kernel_size ({self.kernel_size})")
        need(self.kernel_size <= self.block_size,
             f"kernel_size ({self.kernel_size}) must be <= block_size ({self.block_size})")
        need(self.block_size % self.kernel_stride == 0,
             f"block_size ({self.block_size}) must be a multiple of kernel_stride ({self.kernel_stride})")
        need(self.select_blocks >= 1,
             "select_blocks must be >= 1: the query's own block takes one query-aware slot")
        need(self.topk >= self.query_aware_blocks,
             f"topk ({self.topk}) must be >= init_blocks + local_blocks + select_blocks "
             f"({self.query_aware_blocks}); topk is the total block budget")
        need(self.eviction_head in EVICTION_HEADS,
             f"unknown eviction_head {self.eviction_head!r}; choose one of {sorted(EVICTION_HEADS)}")
        return self


def eviction_head_name(layer_variants: Sequence[str], head: str, absent: str = "none") -> str:
    """The eviction head of a model whose layers run ``layer_variants`` (``dense`` / ``infllm_v2`` / ``nosa``)
    and whose NOSA layers run ``head``: ``head`` where a layer is NOSA, else ``absent`` (dense and InfLLM-V2
    layers run none). One layer of ``variant``: ``eviction_head_name([variant], head)``."""
    return head if "nosa" in layer_variants else absent


def tiny_geometry(**overrides) -> NOSAConfig:
    """A geometry that is really sparse at a few hundred tokens (tests, demos, the tiny recipes):
    16-token blocks and 8/4-token windows (block m pools windows 4m-1..4m+3, as 64/32/16 does),
    1 sink + 2 window + 2 query-aware blocks, 6 in total (dense up to 96 tokens). ``overrides``
    replace fields (e.g. ``eviction_head``)."""
    fields = dict(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2, select_blocks=2,
                  topk=6)
    return NOSAConfig(**{**fields, **overrides})
