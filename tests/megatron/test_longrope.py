"""LongRoPE vs Hugging Face transformers' ``longrope`` rope type, below and above
``original_max_position_embeddings`` (measured max abs diff 0.0 for the pure tables; the
megatron ``LongRoPERotaryEmbedding`` equals the pure tables exactly)."""

from __future__ import annotations

import math

import pytest
import torch

from nosa_layers.rope.longrope import LongRoPEConfig, longrope_cos_sin

transformers = pytest.importorskip("transformers")

HEAD_DIM, THETA, ORIG, MAX = 16, 10000.0, 128, 1024


def _cfg(attention_factor=None) -> LongRoPEConfig:
    half = HEAD_DIM // 2
    return LongRoPEConfig(short_factor=[1.0 + 0.1 * i for i in range(half)],
                          long_factor=[1.0 + 0.5 * i for i in range(half)],
                          original_max_position_embeddings=ORIG, attention_factor=attention_factor)


def _hf(cfg: LongRoPEConfig, seq_len: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX,
                         rope_parameters=cfg.to_hf_rope_scaling(THETA))
    rot = LlamaRotaryEmbedding(hf_cfg)
    cos, sin = rot(torch.zeros(1, seq_len, HEAD_DIM), torch.arange(seq_len)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("seq_len", [64, ORIG, ORIG + 1, 300])
@pytest.mark.parametrize("attention_factor", [None, 1.3])
def test_longrope_matches_transformers(seq_len, attention_factor):
    cfg = _cfg(attention_factor)
    cos, sin = longrope_cos_sin(cfg, torch.arange(seq_len), HEAD_DIM, THETA, MAX)
    cos_hf, sin_hf = _hf(cfg, seq_len)
    assert (cos - cos_hf).abs().max().item() <= 1e-6
    assert (sin - sin_hf).abs().max().item() <= 1e-6


def test_short_long_switch_and_default_attention_factor():
    cfg = _cfg()
    f = cfg.resolved_attention_factor(MAX)
    assert math.isclose(f, math.sqrt(1 + math.log(MAX / ORIG) / math.log(ORIG)))
    assert cfg.resolved_attention_factor(ORIG) == 1.0
    below, _ = longrope_cos_sin(cfg, torch.arange(ORIG), HEAD_DIM, THETA, MAX)
    above, _ = longrope_cos_sin(cfg, torch.arange(ORIG + 1), HEAD_DIM, THETA, MAX)
    assert not torch.allclose(below[1:ORIG], above[1:ORIG]), "long factors were not used above the original length"


def test_factor_count_is_validated():
    with pytest.raises(ValueError, match="head_dim/2"):
        _cfg().validate(rotary_dim=32, max_position_embeddings=MAX)


def test_megatron_longrope_equals_pure_tables(megatron_ref):
    r = megatron_ref.status("ref", "longrope_megatron")
    assert r["abs"] <= 1e-6


def test_megatron_longrope_factors_follow_inv_freq_once():
    """megatron moves a CPU-built ``inv_freq`` to the GPU at the first forward: both factor tables follow
    it once (here to ``meta``, the device a CPU machine has besides ``cpu``), not once per forward."""
    pytest.importorskip("megatron.core")
    from nosa_layers.megatron.rope import LongRoPERotaryEmbedding

    half = 8
    lr = LongRoPEConfig(short_factor=[1.0] * half, long_factor=[1.0 + i for i in range(half)],
                        original_max_position_embeddings=64)
    emb = LongRoPERotaryEmbedding(2 * half, lr, rotary_base=10000.0, use_cpu_initialization=True)
    short, long = emb.short_inv_freq.clone(), emb.long_inv_freq.clone()
    assert torch.equal(emb._inv_freq(False), short) and torch.equal(emb._inv_freq(True), long)
    emb.inv_freq = emb.inv_freq.to("meta")
    moved = emb._inv_freq(True)
    assert moved.device.type == "meta" and emb.short_inv_freq.device.type == "meta"
    assert emb._inv_freq(True) is moved and emb._inv_freq(False) is emb.short_inv_freq  # no further copy
