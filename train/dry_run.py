"""``dry_run=true``: validate the parallel layout and estimate per-GPU memory without a GPU or data.

The model is built on the meta device in one process (TP = PP = 1, no memory, no init compute)
to count parameters exactly; per-rank figures then follow from the layout: weights and gradients
split by TP and PP, optimizer state (fp32 master + Adam moments) also by DP with the distributed
optimizer, activations from the per-layer Megatron estimate (selective recompute keeps ~34·s·b·h
bytes per layer, full recompute ~2·s·b·h; the NOSA reference attention needs O(s²) on top).
"""

from __future__ import annotations

import dataclasses
import os

from train.config import RunConfig, validate

GIB = 2 ** 30


def count_parameters(cfg: RunConfig) -> dict:
    """Exact parameter counts of the full model (embedding, output layer, one decoder layer)."""
    import torch
    from megatron.core import parallel_state as ps

    from nosa_layers.megatron import ParallelConfig, build_model
    from train.distributed import init_distributed

    one = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, sequence_parallel=False),
        run=dataclasses.replace(cfg.run, device="cpu"))
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(one)
    try:
        with torch.device("meta"):
            model = build_model(dataclasses.replace(cfg.model, params_dtype="bfloat16"), cfg.attention,
                                ParallelConfig(), seq_length=cfg.train.seq_length, use_cpu_initialization=True,
                                perform_initialization=False)
        counts = {"total": 0, "embedding": 0, "output": 0, "layers": 0, "eviction": 0}
        for name, p in model.named_parameters():
            counts["total"] += p.numel()
            if "embedding" in name:
                counts["embedding"] += p.numel()
            elif "output_layer" in name:
                counts["output"] += p.numel()
            elif "decoder.layers" in name:
                counts["layers"] += p.numel()
                if "eviction" in name:
                    counts["eviction"] += p.numel()
        return counts
    finally:
        ps.destroy_model_parallel()


def estimate_memory(cfg: RunConfig, counts: dict, world_size: int) -> dict:
    """Per-rank memory (bytes) of the most loaded pipeline stage."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = world_size // p.model_parallel_size
    layers_per_stage = m.num_layers // pp
    stage_params = counts["layers"] / m.num_layers * layers_per_stage + max(counts["embedding"], counts["output"])
    params = stage_params / tp
    low = t.precision in ("bf16", "fp16")
    weights = params * (2 if low else 4)
    grads = params * 4  # fp32 main grads (grad_reduce_in_fp32)
    optim = params * ((4 if low else 0) + 8) / (dp if p.use_distributed_optimizer else 1)
    s, b, h = t.seq_length, t.micro_batch_size, m.hidden_size
    per_layer = {"none": 34 * s * b * h + 5 * m.num_attention_heads * s * s * b,
                 "selective": 34 * s * b * h, "full": 2 * s * b * h}[t.recompute] / tp
    in_flight = min(pp, t.global_batch_size // (t.micro_batch_size * dp)) if pp > 1 else 1
    act = per_layer * layers_per_stage * in_flight
    total = weights + grads + optim + act
    return {"dp": dp, "params_per_rank": params, "weights": weights, "grads": grads, "optimizer": optim,
            "activations": act, "total": total}


def dry_run(cfg: RunConfig, world_size: int | None = None) -> int:
    world_size = world_size or int(os.environ.get("NOSA_DRY_RUN_WORLD_SIZE", "0")) or cfg.parallel.model_parallel_size
    validate(cfg, world_size=world_size, check_files=False)
    counts = count_parameters(cfg)
    mem = estimate_memory(cfg, counts, world_size)
    print(f"dry run of {cfg.recipe}: layout OK for {world_size} GPUs "
          f"(TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
          f"CP={cfg.parallel.context_parallel_size} DP={mem['dp']})")
    print(f"  parameters: {counts['total'] / 1e9:.3f} B total ({counts['layers'] / 1e9:.3f} B in layers, "
          f"{counts['eviction']} in eviction heads, embedding {counts['embedding'] / 1e6:.1f} M, "
          f"output {counts['output'] / 1e6:.1f} M)")
    print(f"  per GPU (largest stage): {mem['params_per_rank'] / 1e9:.3f} B params; weights "
          f"{mem['weights'] / GIB:.1f} GiB + grads {mem['grads'] / GIB:.1f} GiB + optimizer "
          f"{mem['optimizer'] / GIB:.1f} GiB + activations ~{mem['activations'] / GIB:.1f} GiB "
          f"= ~{mem['total'] / GIB:.1f} GiB")
    return 0
