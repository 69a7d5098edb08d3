"""What a run trains with, built from its config: the megatron-core model chunks wrapped in DDP
(:func:`build_model`) and the data loaders (:func:`build_loaders`).

The model: one chunk per virtual pipeline stage of this rank, in the run's precision (``Float16Module`` for
bf16 / fp16), with the recompute and fusion settings of ``train.*``; on a CPU (or with ``run.cpu_init``)
the initial weights are drawn per ``(seed, layer)``, so every parallel layout starts from the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from train.config import RunConfig
from train.distributed import DistEnv

SPEC_NAMES = {"local": "local (megatron-core local layers)", "te": "te (Transformer Engine)"}


def loss_plan(cfg: RunConfig, device_type: str, precision: str) -> tuple[str, dict, object]:
    """What ``train.loss_impl`` runs here: ``(description, TransformerConfig overrides, output processor or
    None)``. ``fused`` (megatron-core's fused cross entropy writes bf16 logit gradients) takes effect on bf16 GPU
    runs, elsewhere megatron-core's unfused cross entropy runs; ``chunked`` uses megatron-core's fused helpers
    per chunk on bf16 GPU runs with ``train.fusions``."""
    t = cfg.train
    bf16_gpu = device_type == "cuda" and precision == "bf16"
    if t.loss_impl == "fused" and bf16_gpu:
        return "fused", dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native"), None
    overrides = dict(cross_entropy_loss_fusion=False)
    if t.loss_impl != "chunked":
        return ("standard" if t.loss_impl == "standard" else "standard (fused needs a bf16 GPU run)"), overrides, None
    from nosa_layers.megatron.lm_loss import ChunkedLMLossProcessor

    fused = bf16_gpu and t.fusions
    return (f"chunked ({t.loss_chunk_tokens} tokens{', fused cross entropy' if fused else ''})", overrides,
            ChunkedLMLossProcessor(t.loss_chunk_tokens, fused=fused))


def build_model(cfg: RunConfig, env: DistEnv, precision: str, log: Callable[[str], None]) -> tuple[list, object]:
    """The model chunks of this rank, each a megatron-core ``DistributedDataParallel`` with its parameters
    broadcast over the data-parallel group, and the output processor of the loss (:func:`loss_plan`; None:
    the model returns per-token losses); logs one line on what was built."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from nosa_layers.megatron import build_model as build_gpt
    from runtime.megatron_compat import provide_gradient_accumulation_fusion

    model_cfg = dataclasses.replace(cfg.model, params_dtype={"bf16": "bfloat16", "fp16": "float16"}
                                    .get(precision, "float32"))
    loss, loss_overrides, processor = loss_plan(cfg, env.device.type, precision)
    overrides = dict(calculate_per_token_loss=True, **loss_overrides)
    if cfg.run.cpu_init or env.device.type == "cpu":  # initial weights independent of the layout
        overrides.update(use_cpu_initialization=True, init_seed=cfg.run.seed)
    if cfg.train.recompute == "selective":
        overrides.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif cfg.train.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    fusions = cfg.train.fusions and env.device.type == "cuda"  # CPU runs keep the reference layers
    if fusions and cfg.train.transformer_impl == "local":  # TE's layers fuse the weight gradients themselves
        provide_gradient_accumulation_fusion()
        overrides.update(gradient_accumulation_fusion=True)
    chunks = []
    for i in range(vpp or 1):
        m = build_gpt(model_cfg, cfg.attention, cfg.parallel.model_parallel(), vp_stage=i if vpp else None,
                      seq_length=cfg.train.seq_length, use_te=cfg.train.transformer_impl == "te",
                      fusions=fusions, **overrides)
        if env.device.type == "cuda":
            m.cuda(torch.cuda.current_device())
        if precision in ("bf16", "fp16"):
            m = Float16Module(m.config, m)
        chunks.append(m)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    model = [DistributedDataParallel(config=m.config, ddp_config=ddp_cfg, module=m, disable_bucketing=i > 0)
             for i, m in enumerate(chunks)]
    for m in model:
        m.broadcast_params()

    n_params = sum(p.numel() for m in model for p in m.parameters())
    init = ("from (seed, layer) on the CPU: the same for every layout" if "init_seed" in overrides
            else "drawn per TP rank on the GPU")
    log(f"model: {cfg.model.family}_{cfg.model.size}, attention={cfg.attention.variant}"
        f"({cfg.attention.nosa.eviction_head if cfg.attention.variant == 'nosa' else '-'}), "
        f"{n_params / 1e6:.2f}M params on rank 0 (TP={ps.get_tensor_model_parallel_world_size()} "
        f"PP={ps.get_pipeline_model_parallel_world_size()} CP={env.cp[0]} DP={env.dp_size}), "
        f"precision={precision}, "
        f"device={env.device.type}, layer spec={SPEC_NAMES[cfg.train.transformer_impl]}, fusions="
        f"{'on' if fusions else 'off'}, loss={loss}, initial weights {init}")
    _log_kernel_plan(cfg, env, precision, log)
    return model, processor


def _log_kernel_plan(cfg: RunConfig, env: DistEnv, precision: str, log: Callable[[str], None]) -> None:
    """One line per NOSA fast path this model's shape does not take on this GPU (``kernel_plan``), before
    step 1: a shape no kernel covers gets another one from the start, never a failure mid-run."""
    m = cfg.model
    if not cfg.attention.has_sparse_layers(m.num_layers):
        return
    from nosa_layers.dispatch import kernel_plan

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    sparse = next(v for v in cfg.attention.layer_variants(m.num_layers) if v != "dense")  # one geometry for all
    for note in kernel_plan(m.num_attention_heads, m.num_kv_heads, m.kv_channels,
                            cfg.attention.nosa_config_for(sparse), dtype, env.device, cfg.attention.backend):
        log(note)


def build_loaders(cfg: RunConfig, env: DistEnv, log: Callable[[str], None]) -> tuple:
    """``(train_loader, valid_loader)`` of this data-parallel rank (SFT or pretraining); bad data (empty
    split, no usable SFT row, ...) is a one-line ``BadInputError``."""
    from data.sources import BadInputError

    try:
        return _loaders(cfg, env, log)
    except BadInputError:
        raise
    except ValueError as e:
        raise BadInputError(str(e)) from None


def _loaders(cfg: RunConfig, env: DistEnv, log: Callable[[str], None]) -> tuple:
    if cfg.stage.kind == "sft":
        from data.loader import build_sft_loaders

        return build_sft_loaders(dataclasses.replace(cfg.sft, model_vocab_size=cfg.model.vocab_size),
                                 env.dp_rank, env.dp_size, log=log)
    from data.loader import build_pretrain_loaders

    need = cfg.train.max_steps * cfg.train.global_batch_size
    dcfg = dataclasses.replace(cfg.data, model_vocab_size=cfg.model.vocab_size,
                               train_samples=cfg.data.train_samples or need,
                               valid_samples=cfg.data.valid_samples or max(
                                   1, cfg.train.eval_iters * cfg.train.global_batch_size))
    return build_pretrain_loaders(dcfg, env.dp_rank, env.dp_size)
