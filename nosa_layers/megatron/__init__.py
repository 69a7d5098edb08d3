"""NOSA models on megatron-core: typed configs, layer specs, model builder.

Public API::

    from nosa_layers.megatron import (ModelConfig, AttentionConfig, ParallelConfig, validate,
        build_model, build_transformer_config, get_nosa_layer_spec,
        get_nosa_decoder_block_spec, NOSAMegatronSelfAttention, NOSACoreAttention, DenseCoreAttention,
        chunked_lm_loss, ChunkedLMLossProcessor, reference_lm_loss)

Names that need megatron-core are imported lazily, so the configs import without it.
"""

from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig, validate

_LAZY = {
    "build_model": "nosa_layers.megatron.model",
    "build_transformer_config": "nosa_layers.megatron.model",
    "NOSAGPTModel": "nosa_layers.megatron.model",
    "get_nosa_layer_spec": "nosa_layers.megatron.spec",
    "get_nosa_decoder_block_spec": "nosa_layers.megatron.spec",
    "NOSAMegatronSelfAttention": "nosa_layers.megatron.self_attention",
    "NOSACoreAttention": "nosa_layers.megatron.core_attention",
    "DenseCoreAttention": "nosa_layers.megatron.core_attention",
    "LongRoPERotaryEmbedding": "nosa_layers.megatron.rope",
    "chunked_lm_loss": "nosa_layers.megatron.lm_loss",
    "ChunkedLMLossProcessor": "nosa_layers.megatron.lm_loss",
    "reference_lm_loss": "nosa_layers.megatron.lm_loss",
}

__all__ = ["ModelConfig", "AttentionConfig", "ParallelConfig", "validate", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nosa_layers.megatron' has no attribute {name!r}")
