"""Model recipes and the one-line config errors (no megatron-core needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nosa_layers.config import tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ParallelConfig, validate
from tests.recipes import attention_recipe, model_recipe, recipe_names

NOSA = attention_recipe("nosa")


@pytest.mark.parametrize("name,shape", [("llama3_1b", (28, 2048, 16, 2)), ("llama3_3b", (32, 2560, 32, 2)),
                                        ("minicpm4_8b", (32, 4096, 32, 2))])
def test_model_recipes(name, shape):
    m = model_recipe(name)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == shape
    assert m.vocab_size == 73448 and m.padded_vocab_size == 73448 and m.kv_channels == 128
    for tp in (1, 2, 4, 8):
        validate(m, NOSA, ParallelConfig(tensor_parallel=tp), seq_length=16384)


def test_every_model_recipe_validates():
    for name in recipe_names("model"):
        validate(model_recipe(name), AttentionConfig(variant="dense"))


@pytest.mark.parametrize("kwargs,parallel,seq,match", [
    ({}, ParallelConfig(tensor_parallel=3), None, "not divisible by tensor_parallel=3"),
    ({"num_attention_heads": 12}, ParallelConfig(tensor_parallel=3), None, "can neither split nor replicate"),
    ({}, ParallelConfig(), 1000, "multiple of the NOSA block_size=64"),
    ({}, ParallelConfig(pipeline_parallel=5), None, "num_layers=32 is not divisible"),
    ({}, ParallelConfig(sequence_parallel=True), None, "sequence_parallel=True needs tensor_parallel > 1"),
    ({}, ParallelConfig(context_parallel=3), 16384, "divisible by 2\\*context_parallel=6"),
])
def test_config_errors_are_one_line(kwargs, parallel, seq, match):
    m = replace(model_recipe("minicpm4_8b"), **kwargs)
    with pytest.raises(ValueError, match=match) as e:
        validate(m, NOSA, parallel, seq_length=seq)
    assert "\n" not in str(e.value)


def test_context_parallel_is_valid_for_every_variant():
    for attn in (NOSA, attention_recipe("infllm_v2"), AttentionConfig(variant="dense")):
        validate(model_recipe("llama3_1b"), attn, ParallelConfig(context_parallel=2), seq_length=16384)
        validate(model_recipe("minicpm4_8b"), attn, ParallelConfig(tensor_parallel=2, context_parallel=8,
                                                                   sequence_parallel=True), seq_length=32768)


def test_layer_pattern():
    m = model_recipe("tiny")
    a = AttentionConfig(variant="nosa", layer_pattern=["dense", "nosa", "nosa", "nosa"], nosa=tiny_geometry())
    validate(m, a, seq_length=256)
    assert a.layer_variants(4)[0] == "dense"
    with pytest.raises(ValueError, match="one variant per layer"):
        validate(m, replace(a, layer_pattern=["dense", "nosa"]))
    with pytest.raises(ValueError, match="unknown variants"):
        validate(m, replace(a, layer_pattern=["dense", "nosa", "mla", "nosa"]))
    assert a.nosa_config_for("infllm_v2").eviction_head == "none"
