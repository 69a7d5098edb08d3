"""Typed configs of a NOSA GPT model: architecture, attention variants, parallel layout.

All cross-field checks live in :func:`validate` and raise ``ValueError`` with one line that names
the fix. Builders (``nosa_layers.megatron.model``) take these dataclasses, never DictConfig.
Field names avoid ``X | None`` so OmegaConf structured configs accept them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from nosa_layers.config import NOSAConfig
from nosa_layers.rope.longrope import LongRoPEConfig

FAMILIES = ("llama3", "minicpm4")
VARIANTS = ("dense", "infllm_v2", "nosa")
ROPE_TYPES = ("default", "longrope")
DTYPES = ("float32", "bfloat16", "float16")
SPARSE_VARIANTS = ("infllm_v2", "nosa")


@dataclass
class ModelConfig:
    """Decoder-only Llama-style architecture (RMSNorm, SwiGLU, RoPE, GQA, no biases).

    ``use_mup`` turns on MiniCPM's muP: embeddings x ``scale_emb``, every residual branch x
    ``scale_depth / sqrt(num_layers)``, logits = ``lm_head(h) / (hidden_size / dim_model_base)``.
    """

    family: str = "llama3"
    size: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: int = 128
    vocab_size: int = 73448
    make_vocab_size_divisible_by: int = 8  # the embedding is padded to a multiple of this
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_type: str = "default"
    longrope: Optional[LongRoPEConfig] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    use_mup: bool = False
    scale_emb: float = 1.0
    scale_depth: float = 1.0
    dim_model_base: Optional[int] = None
    params_dtype: str = "float32"

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def residual_scale(self) -> float:
        """Multiplier of each residual branch (1.0 without muP)."""
        return self.scale_depth / math.sqrt(self.num_layers) if self.use_mup else 1.0

    @property
    def logit_scale(self) -> float:
        """Multiplier of the output logits (1.0 without muP)."""
        return self.dim_model_base / self.hidden_size if self.use_mup else 1.0


@dataclass
class AttentionConfig:
    """Which attention each layer runs and the NOSA geometry of the sparse ones.

    ``variant`` applies to every layer unless ``layer_pattern`` (one entry per layer, e.g.
    ``["dense", "nosa", "nosa", "nosa"]``) is given. ``infllm_v2`` is query-aware only (no
    eviction head); ``nosa`` uses ``nosa.eviction_head`` from the registry.
    ``backend`` is the NOSA kernel backend (``reference`` | ``triton`` | ``auto``).
    """

    variant: str = "dense"
    layer_pattern: Optional[List[str]] = None
    nosa: NOSAConfig = field(default_factory=NOSAConfig)
    backend: str = "auto"
    eviction_bias: bool = False  # delta.bias of the value-gated heads (the released models: False)

    def layer_variants(self, num_layers: int) -> List[str]:
        """The variant of each layer, index 0 = first layer."""
        if self.layer_pattern is not None:
            return list(self.layer_pattern)
        return [self.variant] * num_layers

    def nosa_config_for(self, variant: str) -> NOSAConfig:
        """The NOSAConfig a layer of ``variant`` runs (``infllm_v2`` forces the ``none`` head)."""
        if variant == "infllm_v2":
            from dataclasses import replace

            return replace(self.nosa, eviction_head="none")
        return self.nosa

    def has_sparse_layers(self, num_layers: int) -> bool:
        return any(v in SPARSE_VARIANTS for v in self.layer_variants(num_layers))


@dataclass
class ParallelConfig:
    """The megatron-core layout a model is built for (DP is what is left of the world)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: Optional[int] = None
    context_parallel: int = 1
    sequence_parallel: bool = False


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate(model: ModelConfig, attn: AttentionConfig, parallel: Optional[ParallelConfig] = None,
             seq_length: Optional[int] = None) -> None:
    """Check one model + attention + layout combination; raises ``ValueError`` (one line)."""
    parallel = parallel or ParallelConfig()
    tp, pp, cp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.context_parallel
    hq, hkv = model.num_attention_heads, model.num_kv_heads

    _need(model.family in FAMILIES, f"model.family={model.family!r} is unknown; use one of {FAMILIES}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size",
                 "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings"):
        _need(int(getattr(model, name)) > 0, f"model.{name} must be positive, got {getattr(model, name)}")
    _need(model.params_dtype in DTYPES, f"model.params_dtype={model.params_dtype!r}; use one of {DTYPES}")
    _need(hq % hkv == 0, f"num_attention_heads={hq} is not a multiple of num_kv_heads={hkv}; "
          f"pick num_kv_heads dividing {hq}")
    _need(model.head_dim is not None or model.hidden_size % hq == 0,
          f"hidden_size={model.hidden_size} is not divisible by num_attention_heads={hq}; set head_dim")
    _need(model.kv_channels % 2 == 0, f"head_dim={model.kv_channels} must be even for RoPE")

    _need(model.rope_type in ROPE_TYPES, f"model.rope_type={model.rope_type!r}; use one of {ROPE_TYPES}")
    if model.rope_type == "longrope":
        _need(model.longrope is not None, "model.rope_type='longrope' needs model.longrope "
              "(short_factor, long_factor, original_max_position_embeddings)")
        model.longrope.validate(model.kv_channels, model.max_position_embeddings, model.rope_theta)
    if model.use_mup:
        _need(model.dim_model_base is not None and model.dim_model_base > 0,
              "model.use_mup=True needs model.dim_model_base (MiniCPM4: 256)")
        _need(model.scale_emb > 0 and model.scale_depth > 0,
              "model.scale_emb and model.scale_depth must be positive with use_mup")

    for x in (tp, pp, cp):
        _need(int(x) >= 1, f"parallel sizes must be >= 1, got tp={tp} pp={pp} cp={cp}")
    _need(hq % tp == 0, f"num_attention_heads={hq} is not divisible by tensor_parallel={tp}; "
          f"use a tensor_parallel that divides {hq}")
    _need(hkv % tp == 0 or tp % hkv == 0,
          f"tensor_parallel={tp} can neither split nor replicate num_kv_heads={hkv}; "
          f"use a tensor_parallel that divides {hkv} or is a multiple of it")
    _need(model.padded_vocab_size % tp == 0,
          f"padded vocab {model.padded_vocab_size} is not divisible by tensor_parallel={tp}; "
          f"set make_vocab_size_divisible_by to a multiple of {tp}")
    _need(model.ffn_hidden_size % tp == 0,
          f"ffn_hidden_size={model.ffn_hidden_size} is not divisible by tensor_parallel={tp}")
    _need(not parallel.sequence_parallel or tp > 1,
          "sequence_parallel=True needs tensor_parallel > 1; turn it off for tp=1")
    stages = pp * (parallel.virtual_pipeline or 1)
    _need(model.num_layers % stages == 0,
          f"num_layers={model.num_layers} is not divisible by pipeline_parallel*virtual_pipeline={stages}")
    _need(parallel.virtual_pipeline is None or pp > 1, "virtual_pipeline needs pipeline_parallel > 1")

    variants = attn.layer_variants(model.num_layers)
    _need(attn.variant in VARIANTS, f"attention.variant={attn.variant!r} is unknown; use one of {VARIANTS}")
    _need(len(variants) == model.num_layers,
          f"attention.layer_pattern has {len(variants)} entries but the model has "
          f"{model.num_layers} layers; give one variant per layer")
    bad = sorted({v for v in variants if v not in VARIANTS})
    _need(not bad, f"attention.layer_pattern has unknown variants {bad}; use {VARIANTS}")
    _need(attn.backend in ("reference", "triton", "auto"),
          f"attention.backend={attn.backend!r}; use reference, triton or auto")
    if any(v in SPARSE_VARIANTS for v in variants):
        attn.nosa.validate()
        if "nosa" in variants:
            _need(attn.nosa.eviction_head != "none",
                  "variant 'nosa' with eviction_head='none' is InfLLM-V2; use variant='infllm_v2'")
        if seq_length is not None:
            bs = attn.nosa.block_size
            _need(seq_length % bs == 0, f"seq_length={seq_length} is not a multiple of the NOSA "
                  f"block_size={bs}; use a seq_length divisible by {bs}")
    if seq_length is not None:
        _need(seq_length <= model.max_position_embeddings,
              f"seq_length={seq_length} exceeds max_position_embeddings={model.max_position_embeddings}")
        _need(not parallel.sequence_parallel or seq_length % (tp * cp) == 0,
              f"seq_length={seq_length} must be divisible by tensor_parallel*context_parallel={tp * cp} with "
              f"sequence_parallel")
        _need(cp == 1 or seq_length % (2 * cp) == 0,
              f"seq_length={seq_length} must be divisible by 2*context_parallel={2 * cp}")
