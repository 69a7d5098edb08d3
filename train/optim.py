"""megatron-core AdamW (optionally distributed, optionally torch's fused kernel) and its LR scheduler,
configured in optimizer steps."""

from __future__ import annotations

import torch

from train.config import RunConfig


def mixed_precision(cfg: RunConfig, device: torch.device) -> str:
    """Effective precision: bf16/fp16 on GPU as configured, fp32 on CPU."""
    return cfg.train.precision if device.type == "cuda" else "fp32"


def build_optimizer(cfg: RunConfig, model_chunks: list, precision: str):
    """megatron-core's optimizer for ``model_chunks``; without Transformer Engine or Apex its gradient
    norm and clipping run sync-free replacements of megatron's per-tensor fallback
    (``runtime.megatron_compat.use_sync_free_multi_tensor_ops``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from runtime.megatron_compat import use_sync_free_multi_tensor_ops

    use_sync_free_multi_tensor_ops()

    o = cfg.optim
    ocfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=precision == "bf16", fp16=precision == "fp16",
        params_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32),
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        # megatron skips the update when the gradient norm exceeds this; an overflowed (inf) norm
        # does, NaN gradients are caught before the step by train.finite.grads_nonfinite_flag
        grad_norm_skip_threshold=float(torch.finfo(torch.float32).max),
    )
    return get_megatron_optimizer(ocfg, model_chunks, config_overrides=lr_overrides(cfg, ocfg))


EVICTION_PARAMS = "*.eviction_head.*"  # megatron parameter names of the NOSA layers' eviction heads


def lr_overrides(cfg: RunConfig, ocfg) -> dict | None:
    """megatron-core's parameter-group overrides: its standard ones (no weight decay on biases and norms)
    plus the eviction heads' peak / floor lr times ``optim.eviction_lr_mult`` (None when it is 1:
    megatron-core applies its standard ones itself)."""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey

    o = cfg.optim
    if o.eviction_lr_mult == 1.0:
        return None
    return {**get_standard_config_overrides(ocfg),
            ParamKey(name=EVICTION_PARAMS): {"max_lr": o.lr * o.eviction_lr_mult,
                                             "min_lr": o.min_lr * o.eviction_lr_mult}}


def torch_adams(optimizer) -> list:
    """The torch Adam(W)s inside megatron-core's ``optimizer`` (one per optimizer of a chain that has one)."""
    inners = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [inner for inner in inners if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))]


def use_fused_adam(optimizer, fused: bool) -> int:
    """Run every torch Adam(W) inside megatron-core's ``optimizer`` with torch's fused kernel (one
    kernel per parameter group and dtype instead of the multi-tensor path's dozen passes; megatron-core
    falls back to torch's optimizer without Transformer Engine or Apex) or with the multi-tensor path.
    The step counters move where that path keeps them, one tensor per parameter: on the parameter's
    device (fused) or on the CPU. Call after building the optimizer and after loading a checkpoint
    (loading restores the saved groups' settings). Returns how many torch optimizers it set."""
    adams = torch_adams(optimizer)
    for inner in adams:
        for group in inner.param_groups:
            group["fused"], group["foreach"] = (True, None) if fused else (None, None)
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    device = p.device if fused or group.get("capturable") else torch.device("cpu")
                    inner.state[p]["step"] = step.detach().to(device=device, dtype=torch.float32).clone()
    return len(adams)


def adam_is_fused(optimizer) -> bool:
    """Whether every parameter group of the torch Adam(W)s inside ``optimizer`` runs the fused kernel."""
    groups = [g for inner in torch_adams(optimizer) for g in inner.param_groups]
    return bool(groups) and all(g.get("fused") for g in groups)


def build_scheduler(cfg: RunConfig, optimizer):
    """Linear warmup (lr/warmup at step 1), then WSD (stable + final decay), cosine or constant; one unit = one step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, steps = cfg.optim, cfg.train.max_steps
    style = {"wsd": "WSD", "cosine": "cosine", "constant": "constant"}[o.schedule]
    wsd_steps = None
    if o.schedule == "wsd":
        wsd_steps = max(1, min(steps - o.warmup_steps, round(o.wsd_decay_fraction * steps)))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=steps, lr_decay_style=style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=steps, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False, wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=o.wsd_decay_style if o.schedule == "wsd" else None)
    scheduler.step(increment=1)  # step k (1-based) trains with lr(k); the decay ends at the last step
    return scheduler
