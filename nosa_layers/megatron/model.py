"""Build a megatron-core ``GPTModel`` for a NOSA model from the typed configs.

``build_model(model_cfg, attn_cfg, parallel_cfg, pre_process, post_process)`` is what the trainer
and the converters call after ``parallel_state.initialize_model_parallel``. The model's forward is
megatron's: ``model(input_ids, position_ids, attention_mask=None, labels=labels,
packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, ...))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig, validate
from nosa_layers.megatron.rope import LongRoPERotaryEmbedding
from nosa_layers.megatron.spec import get_nosa_decoder_block_spec, have_te
from nosa_layers.rope.longrope import LongRoPEConfig


def fused_config(model: ModelConfig) -> dict:
    """megatron-core fusions that ``build_model(fusions=True)`` turns on: its SwiGLU (keeps only the
    input for the backward). The loss is chosen on its own (``cross_entropy_loss_fusion``, or the chunked
    loss of ``nosa_layers.megatron.lm_loss``)."""
    return dict(bias_activation_fusion=True)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_transformer_config(model: ModelConfig, attn: AttentionConfig, parallel: Optional[ParallelConfig] = None,
                             **overrides) -> TransformerConfig:
    """The megatron ``TransformerConfig`` of a Llama-style model (RMSNorm, SwiGLU, no biases).

    Fusions are off and ``use_cpu_initialization`` follows the device (True without CUDA, which
    also makes the initial weights independent of the TP size); override any field by keyword.
    """
    parallel = parallel or ParallelConfig()
    dtype = _DTYPES[model.params_dtype]
    kwargs = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_kv_heads,
        kv_channels=model.kv_channels, ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=model.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        softmax_scale=1.0 / math.sqrt(model.kv_channels), init_method_std=model.init_std,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context_parallel, sequence_parallel=parallel.sequence_parallel,
        cp_comm_type="all_gather",  # the scheme of every NOSA layer (context_parallel.py); TE attention is not used
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if model.use_mup:
        kwargs.update(use_mup=True, mup_base_hidden_size=model.dim_model_base, mup_embedding_mult=model.scale_emb,
                      mup_output_mult=model.logit_scale)
    kwargs.update(overrides)
    if kwargs.get("apply_rope_fusion") and model.rope_type == "longrope":
        raise ValueError("apply_rope_fusion ignores the LongRoPE attention factor; set apply_rope_fusion=False")
    return TransformerConfig(**kwargs)


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one named part of the model (stable across processes and Python versions)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_layer(seed: int) -> type:
    """``TransformerLayer`` whose parameters are drawn from a generator seeded by ``(seed, global layer index)``.

    With ``use_cpu_initialization`` megatron-core draws every weight at its full (unsharded) size on the
    CPU and keeps this rank's slice, so what a layer draws does not depend on the TP size; reseeding at
    each layer makes it independent of which pipeline stage (and which layers before it) built it.
    """

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, vp_stage=None, pg_collection=None,
                     **kwargs):
            pp_rank = (get_pg_rank(pg_collection.pp) if pg_collection is not None
                       else parallel_state.get_pipeline_model_parallel_rank())
            index = layer_number - 1 + get_transformer_layer_offset(config, vp_stage, pp_rank)
            torch.manual_seed(derive_seed(seed, f"decoder.layers.{index}"))
            super().__init__(config, submodules, layer_number, *args, vp_stage=vp_stage,
                             pg_collection=pg_collection, **kwargs)

    return SeededTransformerLayer


class NOSAGPTModel(GPTModel):
    """``GPTModel`` with optional LongRoPE (replaces ``rotary_pos_emb``); everything else is megatron's.

    ``init_seed`` (with ``use_cpu_initialization``): the initial weights are a function of the seed and
    the parameter only: the embedding is drawn from ``derive_seed(seed, "embedding")``, each layer from
    ``(seed, global layer index)`` (:func:`seeded_layer`), the output layer right after the last layer.
    Any TP / PP / VPP / DP layout then starts from the same weights; the global RNG state is restored.
    """

    def __init__(self, *args, longrope: Optional[LongRoPEConfig] = None, init_seed: Optional[int] = None,
                 **kwargs) -> None:
        with torch.random.fork_rng(devices=[]) if init_seed is not None else contextlib.nullcontext():
            if init_seed is not None:
                torch.manual_seed(derive_seed(init_seed, "embedding"))
            super().__init__(*args, **kwargs)
        if longrope is not None:
            self.rotary_pos_emb = LongRoPERotaryEmbedding(
                kv_channels=self.config.kv_channels, longrope=longrope, rotary_base=self.rotary_base,
                rotary_interleaved=self.config.rotary_interleaved,
                use_cpu_initialization=self.config.use_cpu_initialization, cp_group=self.pg_collection.cp)


def _check_parallel_state(parallel: ParallelConfig) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is not initialised; call "
                           "parallel_state.initialize_model_parallel(...) before build_model")
    got = (parallel_state.get_tensor_model_parallel_world_size(),
           parallel_state.get_pipeline_model_parallel_world_size(),
           parallel_state.get_context_parallel_world_size())
    want = (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.context_parallel)
    if got != want:
        raise ValueError(f"ParallelConfig (tp, pp, cp)={want} does not match the initialised megatron "
                         f"parallel state {got}; initialise with the same sizes")


def build_model(model: ModelConfig, attn: AttentionConfig, parallel: Optional[ParallelConfig] = None,
                pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                vp_stage: Optional[int] = None, seq_length: Optional[int] = None, use_te: bool = False,
                init_seed: Optional[int] = None, fusions: bool = False, **config_overrides) -> NOSAGPTModel:
    """One pipeline stage (``vp_stage`` chunk) of the model, on this rank's TP shard.

    ``pre_process`` / ``post_process`` default to this rank's pipeline position. ``seq_length``
    (optional) is validated against the NOSA block size. ``use_te`` picks the Transformer Engine
    layer spec instead of megatron-core's local one (explicit: never chosen because TE imports;
    its checkpoints name the fused norms differently). ``init_seed`` (needs
    ``use_cpu_initialization``) makes the initial weights independent of the parallel layout
    (:class:`NOSAGPTModel`). ``fusions`` (GPU training): the fused Triton RMSNorm of the local spec,
    the fused Triton RoPE and megatron-core's fused SwiGLU (``torch.compile``; the same formulas, fewer
    passes over memory). Extra keywords override ``TransformerConfig`` fields (e.g.
    ``recompute_granularity``, ``bias_activation_fusion``).
    """
    parallel = parallel or ParallelConfig()
    if fusions:
        config_overrides = dict(fused_config(model), **config_overrides)
    validate(model, attn, parallel, seq_length=seq_length)
    _check_parallel_state(parallel)
    config = build_transformer_config(model, attn, parallel, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if use_te and not have_te():
        raise ValueError("use_te=True but Transformer Engine is not importable; install it (pip install -e .[te]) "
                         "or build the local spec")
    block_spec = get_nosa_decoder_block_spec(config, model, attn, use_te=use_te, vp_stage=vp_stage,
                                             pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                                             fusions=fusions)
    if init_seed is not None:
        if not config.use_cpu_initialization:
            raise ValueError("init_seed needs use_cpu_initialization=True (GPU initialisation draws per TP rank)")
        layer = seeded_layer(init_seed)
        block_spec = dataclasses.replace(block_spec, layer_specs=[
            dataclasses.replace(s, module=layer) if s.module is TransformerLayer else s
            for s in block_spec.layer_specs])
    return NOSAGPTModel(
        config=config, transformer_layer_spec=block_spec, vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="rope", rotary_base=model.rope_theta, vp_stage=vp_stage,
        longrope=model.longrope if model.rope_type == "longrope" else None, init_seed=init_seed)
