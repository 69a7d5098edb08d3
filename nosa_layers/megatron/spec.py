"""megatron-core layer specs of NOSA GPT models (the seam ``GPTModel`` builds its layers from).

Entry points:

* :func:`get_nosa_layer_spec` -> ``ModuleSpec(TransformerLayer)`` for one attention variant;
* :func:`get_nosa_decoder_block_spec` -> ``TransformerBlockSubmodules`` with one spec per layer
  of this pipeline stage (per-layer variants, e.g. the first layers dense).

Both start from megatron-core's own GPT layer submodules (TE when importable, local otherwise)
and replace only ``self_attention`` (-> :class:`NOSAMegatronSelfAttention` with a dense, InfLLM-V2 or
NOSA core attention and, for NOSA, the eviction head of :func:`eviction_head_spec`), the local norms
(-> SP-capable RMSNorm) and, with muP, the residual ``*_bda`` (-> :class:`ScaledBiasDropoutAdd`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from nosa_layers.config import NOSAConfig
from nosa_layers.eviction import EVICTION_HEADS, ValueGatedHead
from nosa_layers.megatron.core_attention import DenseCoreAttention, NOSACoreAttention
from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from nosa_layers.megatron.mup import ScaledBiasDropoutAdd
from nosa_layers.megatron.norm import RMSNorm
from nosa_layers.megatron.self_attention import NOSAMegatronSelfAttention, NOSAMegatronSelfAttentionSubmodules


def have_te() -> bool:
    """Whether Transformer Engine is importable (then the TE spec is the default)."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def rope_attention_factor(model: ModelConfig) -> float:
    """LongRoPE's cos/sin multiplier (1.0 for plain RoPE)."""
    if model.rope_type == "longrope":
        return model.longrope.resolved_attention_factor(model.max_position_embeddings)
    return 1.0


def _norm_spec(fused_norm: bool):
    """The local spec's RMSNorm, fused (one Triton kernel on CUDA inputs) or the reference formula."""
    return ModuleSpec(module=RMSNorm, params={"fused": True}) if fused_norm else RMSNorm


def eviction_head_spec(nosa_cfg: NOSAConfig, model: ModelConfig, attn: AttentionConfig,
                       fused: bool = False) -> Optional[ModuleSpec]:
    """The registry's eviction head ``nosa_cfg.eviction_head`` with the FULL head counts (replicated on
    every TP rank), or ``None`` for a head without a score (InfLLM-V2's ``none``: nothing to run).
    ``fused`` (``train.fusions``): value-gated heads compute their score with the fused Triton kernel
    (``nosa_layers.ops.gated_score``), which falls back to the reference off the GPU."""
    head = EVICTION_HEADS[nosa_cfg.eviction_head]
    if not head.has_score:
        return None
    params = dict(num_q_heads=model.num_attention_heads, num_kv_heads=model.num_kv_heads,
                  head_dim=model.kv_channels, bias=attn.eviction_bias, detach_value=nosa_cfg.detach_value)
    if fused and issubclass(head, ValueGatedHead):
        from nosa_layers.ops.gated_score import fused_gated_score

        params["score_op"] = fused_gated_score
    return ModuleSpec(module=head, params=params)


def get_nosa_layer_spec(model: ModelConfig, attn: AttentionConfig, variant: str,
                        use_te: Optional[bool] = None, fusions: bool = False,
                        context_parallel: int = 1) -> ModuleSpec:
    """``ModuleSpec(TransformerLayer)`` whose attention is ``variant`` (dense | infllm_v2 | nosa).

    ``fusions``: the attention's RoPE and the value-gated eviction score run fused Triton kernels on
    CUDA inputs, and the local spec's norms the fused Triton RMSNorm (the TE spec has its own fused
    norms). With ``context_parallel > 1`` dense layers run ``DenseCoreAttention`` in both specs (the
    all-gather context parallelism of every NOSA layer; TE's own CP splits packed rows differently)."""
    use_te = have_te() if use_te is None else use_te
    if use_te:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        submods = get_gpt_layer_with_transformer_engine_submodules()
        dense_core = TEDotProductAttention if context_parallel == 1 else DenseCoreAttention
    else:
        submods = get_gpt_layer_local_submodules(normalization="RMSNorm")
        norm = _norm_spec(fusions)
        submods = replace(submods, input_layernorm=norm, pre_mlp_layernorm=norm)
        dense_core = DenseCoreAttention
    stock = submods.self_attention.submodules

    eviction = None
    if variant == "dense":
        core = ModuleSpec(module=dense_core)
    elif variant in ("infllm_v2", "nosa"):
        nosa_cfg = attn.nosa_config_for(variant)
        core = ModuleSpec(module=NOSACoreAttention, params=dict(
            nosa_config=nosa_cfg, backend=attn.backend, num_q_heads=model.num_attention_heads,
            num_kv_heads=model.num_kv_heads))
        if variant == "nosa":
            eviction = eviction_head_spec(nosa_cfg, model, attn, fusions)
    else:
        raise ValueError(f"unknown attention variant {variant!r}; use dense, infllm_v2 or nosa")

    self_attention = ModuleSpec(
        module=NOSAMegatronSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "rope_attention_factor": rope_attention_factor(model),
                "fused_rope": fusions},
        submodules=NOSAMegatronSelfAttentionSubmodules(
            linear_qkv=stock.linear_qkv, core_attention=core, linear_proj=stock.linear_proj,
            q_layernorm=stock.q_layernorm, k_layernorm=stock.k_layernorm, eviction_head=eviction))
    submods = replace(submods, self_attention=self_attention)
    if model.use_mup:
        bda = ModuleSpec(module=ScaledBiasDropoutAdd, params={"scale": model.residual_scale})
        submods = replace(submods, self_attn_bda=bda, mlp_bda=bda)
    return ModuleSpec(module=TransformerLayer, submodules=submods)


def get_nosa_decoder_block_spec(config, model: ModelConfig, attn: AttentionConfig, use_te: Optional[bool] = None,
                                vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                fusions: bool = False) -> TransformerBlockSubmodules:
    """Layer specs of the layers this pipeline stage builds (``config`` is the TransformerConfig)."""
    use_te = have_te() if use_te is None else use_te
    specs = [get_nosa_layer_spec(model, attn, v, use_te, fusions, config.context_parallel_size)
             for v in attn.layer_variants(model.num_layers)]
    if config.pipeline_model_parallel_layout is not None:
        raise NotImplementedError("pipeline_model_parallel_layout is not supported by the NOSA spec; "
                                  "use uniform pipeline stages")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    num = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = _norm_spec(fusions)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + num], layer_norm=final_norm)
