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
    # the loss is train.loss_impl's choice (train.build.loss_plan), not the layers' fusions
    for dtype in ("float32", "bfloat16"):
        assert fused_config(replace(model, params_dtype=dtype)) == {"bias_activation_fusion": True}


def test_fused_eviction_heads_take_the_fused_score_and_others_keep_theirs():
    """The layer spec's eviction head, built with megatron's ``build_module``: value-gated heads get the
    fused score as a constructor argument under ``train.fusions``, the others are built unchanged."""
    from megatron.core.transformer.spec_utils import build_module

    from nosa_layers.eviction import EVICTION_HEADS, value_gated_score
    from nosa_layers.megatron.spec import get_nosa_layer_spec
    from nosa_layers.ops.gated_score import fused_gated_score

    model = model_recipe("llama3_1b")

    def build(name, fused):
        attn = replace(NOSA, nosa=replace(NOSA.nosa, eviction_head=name))
        spec = get_nosa_layer_spec(model, attn, "nosa", use_te=False, fusions=fused)
        head = build_module(spec.submodules.self_attention.submodules.eviction_head)
        assert type(head) is EVICTION_HEADS[name]
        assert (head.num_q_heads, head.num_kv_heads) == (model.num_attention_heads, model.num_kv_heads)
        return head

    for name in ("ed_dma", "dma", "s_dma"):
        assert build(name, True).score_op is fused_gated_score
        assert build(name, False).score_op is value_gated_score
    assert not hasattr(build("locret", True), "score_op")
    for variant in ("infllm_v2", "dense"):
        spec = get_nosa_layer_spec(model, NOSA, variant, use_te=False, fusions=True)
        assert getattr(spec.submodules.self_attention.submodules, "eviction_head", None) is None
