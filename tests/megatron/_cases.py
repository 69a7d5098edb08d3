"""Parity cases shared by the distributed worker and the pytest assertions (no megatron import)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from nosa_layers.config import tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig
from nosa_layers.rope.longrope import LongRoPEConfig
from tests.recipes import model_recipe

SEQ = 256  # 16 blocks of 16 tokens; the 6-block budget makes NOSA really sparse


def tiny() -> ModelConfig:
    """``recipes/model/tiny.yaml`` (4 layers, hidden 64, 4 / 2 heads of 16) with a 256-token vocabulary."""
    return model_recipe("tiny", vocab_size=256, max_position_embeddings=1024)


def tiny_minicpm4() -> ModelConfig:
    """``tiny`` with MiniCPM4's muP (scale_emb 12, scale_depth 1.4, dim_model_base 16)."""
    return replace(tiny(), family="minicpm4", use_mup=True, scale_emb=12.0, scale_depth=1.4, dim_model_base=16)


@dataclass
class Layout:
    parallel: ParallelConfig
    world: int = 2
    overrides: Dict[str, object] = field(default_factory=dict)  # TransformerConfig fields


LAYOUTS: Dict[str, Layout] = {
    "ref": Layout(ParallelConfig(), world=1),
    "tp2": Layout(ParallelConfig(tensor_parallel=2)),
    "tp2_sp": Layout(ParallelConfig(tensor_parallel=2, sequence_parallel=True)),
    "pp2": Layout(ParallelConfig(pipeline_parallel=2)),
    "dp2": Layout(ParallelConfig()),
    "tp2_recompute": Layout(ParallelConfig(tensor_parallel=2),
                            overrides={"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
    "tp4": Layout(ParallelConfig(tensor_parallel=4), world=4),
    "tp2pp2": Layout(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), world=4),
}


@dataclass
class Case:
    model: ModelConfig
    attn: AttentionConfig
    layouts: List[str]
    packed: bool = False  # one packed row of documents (cu_seqlens) instead of a batch
    record_selection: bool = False
    seed: int = 1234


def _nosa(head: str = "ed_dma", pattern: Optional[List[str]] = None, variant: str = "nosa") -> AttentionConfig:
    return AttentionConfig(variant=variant, layer_pattern=pattern,
                           nosa=tiny_geometry(eviction_head=head), backend="reference")


def _longrope_model() -> ModelConfig:
    half = tiny().kv_channels // 2
    lr = LongRoPEConfig(short_factor=[1.0 + 0.1 * i for i in range(half)],
                        long_factor=[1.0 + 0.5 * i for i in range(half)], original_max_position_embeddings=128)
    return replace(tiny(), rope_type="longrope", longrope=lr, max_position_embeddings=1024)


CASES: Dict[str, Case] = {
    "dense": Case(replace(tiny(), tie_embeddings=True), AttentionConfig(variant="dense"),
                  ["tp2", "tp2_sp", "pp2", "dp2"]),
    "nosa": Case(tiny(), _nosa(pattern=["dense", "nosa", "nosa", "nosa"]),
                 ["tp2", "tp2_sp", "tp2_recompute", "pp2", "dp2", "tp4", "tp2pp2"], record_selection=True),
    "nosa_kv1": Case(replace(tiny(), num_kv_heads=1), _nosa(), ["tp2"], record_selection=True),
    "infllm_v2": Case(replace(tiny(), num_kv_heads=1), _nosa(head="none", variant="infllm_v2"), ["tp2"],
                      record_selection=True),
    "locret": Case(tiny(), _nosa(head="locret"), ["tp2"]),
    "s_dma": Case(tiny(), _nosa(head="s_dma"), ["tp2"]),
    "packed": Case(tiny(), _nosa(), ["tp2", "pp2"], packed=True, record_selection=True),
    "minicpm4_mup": Case(tiny_minicpm4(), _nosa(), ["tp2", "pp2"]),
    "longrope": Case(_longrope_model(), _nosa(), ["tp2"]),
}

# Packed case: documents of these lengths in each row (positions restart, no attention across).
PACKED_DOCS = [96, 112, 48]
MICRO_BATCH = 2
GLOBAL_BATCH = 4

# Sync-free packed RoPE check: odd lengths, a 1-token document, longest (99) < SEQ and < LongRoPE's 128.
ROPE_DOCS = [37, 1, 99, 55, 63, 1]
