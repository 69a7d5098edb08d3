"""Named model flavours (``<family>_<size>``) and attention presets.

Shapes from the NOSA paper (1B: 28/2048/16/2, 3B: 32/2560/32/2, 8B: 32/4096/32/2, head_dim 128,
vocab 73448). FFN sizes of 1B/3B and the 1B/3B rope base are not published: 8192 / 10240 and the
Llama-3 base 500000 are our choice. LongRoPE factors are not preset: copy the ``rope_scaling``
block of the released ``config.json`` into :class:`~nosa_layers.rope.LongRoPEConfig`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict

from nosa_layers.config import NOSAConfig
from nosa_layers.megatron.config import AttentionConfig, ModelConfig


def llama3_1b() -> ModelConfig:
    return ModelConfig(family="llama3", size="1b", num_layers=28, hidden_size=2048, num_attention_heads=16,
                       num_kv_heads=2, head_dim=128, ffn_hidden_size=8192, vocab_size=73448,
                       max_position_embeddings=32768, rope_theta=500000.0)


def llama3_3b() -> ModelConfig:
    return ModelConfig(family="llama3", size="3b", num_layers=32, hidden_size=2560, num_attention_heads=32,
                       num_kv_heads=2, head_dim=128, ffn_hidden_size=10240, vocab_size=73448,
                       max_position_embeddings=32768, rope_theta=500000.0)


def minicpm4_8b() -> ModelConfig:
    return ModelConfig(family="minicpm4", size="8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_kv_heads=2, head_dim=128, ffn_hidden_size=16384, vocab_size=73448,
                       max_position_embeddings=32768, rope_theta=10000.0, use_mup=True, scale_emb=12.0,
                       scale_depth=1.4, dim_model_base=256)


def tiny() -> ModelConfig:
    """4 layers, hidden 64, 4 heads / 2 KV heads of 16 channels: CPU tests."""
    return ModelConfig(family="llama3", size="tiny", num_layers=4, hidden_size=64, num_attention_heads=4,
                       num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=256,
                       max_position_embeddings=1024, rope_theta=10000.0)


def tiny_minicpm4() -> ModelConfig:
    """``tiny`` with MiniCPM4's muP (scale_emb 12, scale_depth 1.4, dim_model_base 16)."""
    return replace(tiny(), family="minicpm4", use_mup=True, scale_emb=12.0, scale_depth=1.4, dim_model_base=16)


MODEL_PRESETS: Dict[str, Callable[[], ModelConfig]] = {
    "llama3_1b": llama3_1b, "llama3_3b": llama3_3b, "minicpm4_8b": minicpm4_8b,
    "tiny": tiny, "tiny_minicpm4": tiny_minicpm4,
}


def tiny_nosa_geometry() -> NOSAConfig:
    """A geometry that is really sparse at a few hundred tokens (16-token blocks, 6-block budget)."""
    return NOSAConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                      select_blocks=2, topk=6)


ATTENTION_PRESETS: Dict[str, Callable[[], AttentionConfig]] = {
    "dense": lambda: AttentionConfig(variant="dense"),
    "infllm_v2": lambda: AttentionConfig(variant="infllm_v2", nosa=NOSAConfig(eviction_head="none")),
    "nosa": lambda: AttentionConfig(variant="nosa", nosa=NOSAConfig(eviction_head="ed_dma")),
}


def model_preset(name: str) -> ModelConfig:
    """A fresh :class:`ModelConfig` for a flavour name (``llama3_1b``, ``minicpm4_8b``, ``tiny``, ...)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]()
