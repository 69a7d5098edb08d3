"""``train.fusions`` wiring: the layer spec's norms and RoPE, and the megatron-core fusion flags (imports
megatron-core, builds nothing)."""

from __future__ import annotations

from dataclasses import replace

from tests.recipes import attention_recipe, model_recipe

NOSA = attention_recipe("nosa")


def test_fusions_reach_the_norms_and_the_megatron_config():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from nosa_layers.megatron.model import fused_config
    from nosa_layers.megatron.norm import RMSNorm
    from nosa_layers.megatron.spec import get_nosa_layer_spec

    model = model_recipe("llama3_1b")
    fused = get_nosa_layer_spec(model, NOSA, "nosa", use_te=False, fusions=True)
    plain = get_nosa_layer_spec(model, NOSA, "nosa", use_te=False)
    for norm in (fused.submodules.input_layernorm, fused.submodules.pre_mlp_layernorm):
        assert isinstance(norm, ModuleSpec) and norm.module is RMSNorm and norm.params == {"fused": True}
    assert plain.submodules.input_layernorm is RMSNorm
    assert fused.submodules.self_attention.params["fused_rope"] is True
    assert plain.submodules.self_attention.params["fused_rope"] is False
    assert fused_config(model)["bias_activation_fusion"] and "cross_entropy_loss_fusion" not in fused_config(model)
    bf16 = fused_config(replace(model, params_dtype="bfloat16"))
    assert bf16["cross_entropy_loss_fusion"] and bf16["cross_entropy_fusion_impl"] == "native"
