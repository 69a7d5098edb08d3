"""``dry_run=true``: validate the layout for ``parallel.world_size`` GPUs and say whether it fits
``cluster.gpu_memory_gib``, from the shapes alone (nothing is built or allocated: any model size answers
at once), without a GPU, data or other processes.

The per-GPU peak comes from ``train/memory_model.py`` (weights, gradient buffer, optimizer state, the
activations each layer keeps under ``train.recompute``, the loss's peak under ``train.loss_impl``, workspaces;
every term is stated there). The verdict leaves 10% of the GPU to what the estimate does not hold: the CUDA
context, NCCL buffers and the allocator's fragmentation (reserved beyond the allocated peak: 1-2% at
16K, ~12% at 32K on an H200). A model whose weights, gradients and optimizer state alone, spread over
all the GPUs, exceed the largest GPUs made (``LARGEST_GPU_GIB``) is refused in one line before anything
else is checked.
"""

from __future__ import annotations

import dataclasses
import os

from train.config import RunConfig, init_changes_line, validate
from train.memory_model import (GIB, bytes_per_parameter, estimate_memory, layer_bytes, parameter_counts,
                                variant_counts)

HEADROOM = 0.90  # share of cluster.gpu_memory_gib a layout may plan to use
LARGEST_GPU_GIB = 288  # above the largest GPU memories made (B300, MI355X: 288 GB = 268 GiB)


def _world_size(cfg: RunConfig) -> int:
    if cfg.parallel.world_size:
        return cfg.parallel.world_size
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 else cfg.parallel.model_parallel_size


def _fits(total: float, gpu_gib: float) -> bool:
    return total <= HEADROOM * gpu_gib * GIB


def _alternatives(cfg: RunConfig, counts: dict, world_size: int) -> list[str]:
    """Overrides that would fit (recompute, then twice the TP size), for the 'does not fit' line."""
    found = []
    tries = [{"train": dataclasses.replace(cfg.train, recompute=r)} for r in ("selective", "full")
             if r != cfg.train.recompute]
    tp2 = cfg.parallel.tensor_model_parallel_size * 2
    if world_size % (cfg.parallel.model_parallel_size * 2) == 0 and cfg.model.num_kv_heads % tp2 == 0:
        tries.append({"parallel": dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp2,
                                                      sequence_parallel=True)})
    for change in tries:
        alt = dataclasses.replace(cfg, **change)
        worst = max(s.total for s in estimate_memory(alt, counts, world_size))
        if _fits(worst, cfg.cluster.gpu_memory_gib):
            key, sec = next(iter(change.items()))
            what = f"train.recompute={sec.recompute}" if key == "train" else \
                f"parallel.tensor_model_parallel_size={tp2} parallel.sequence_parallel=true"
            found.append(f"{what} (~{worst / GIB:.1f} GiB)")
    return found


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f}" if n < 1000 * GIB else f"{n / GIB:,.0f}"


def refusal(cfg: RunConfig, world_size: int) -> str | None:
    """The one-line answer for a model no GPU holds: its weights, gradient buffer and optimizer state,
    spread evenly over all ``world_size`` GPUs, exceed ``LARGEST_GPU_GIB`` per GPU; None otherwise (also
    for sizes too broken to count, which the validation names)."""
    try:
        total = parameter_counts(cfg)["total"]
        need = total * sum(bytes_per_parameter(cfg).values()) / world_size
    except (ArithmeticError, ValueError, TypeError, AttributeError):
        return None
    if need <= LARGEST_GPU_GIB * GIB:
        return None
    return (f"does not fit: no GPU holds this model on {world_size} GPU{'s' if world_size > 1 else ''} "
            f"({total:.2e} parameters: weights, gradients and optimizer state alone are ~{_gib(need)} GiB per GPU "
            f"spread over all of them; no GPU holds {LARGEST_GPU_GIB} GiB); use more GPUs or a smaller model")


def dense_length_note(cfg: RunConfig) -> str | None:
    """The line saying that NOSA trains densely at ``train.seq_length`` (every causal block fits the selection
    budget ``topk x block_size``), or None when the model has no sparse layer or the length is past the budget."""
    n = cfg.attention.nosa
    if not cfg.attention.has_sparse_layers(cfg.model.num_layers) or cfg.train.seq_length > n.dense_len:
        return None
    return (f"note: train.seq_length={cfg.train.seq_length} is within the selection budget (attention.nosa.topk "
            f"{n.topk} x block_size {n.block_size} = {n.dense_len} tokens): every query attends to all its keys, so "
            f"the sparse layers train densely here (sparse from train.seq_length > {n.dense_len})")


def dry_run(cfg: RunConfig) -> int:
    """Print the layout, parameter counts, per-GPU memory and the verdict; 0 if it fits, 1 if not."""
    world_size = _world_size(cfg)
    refused = refusal(cfg, world_size)
    if refused is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(refused)
        return 1
    validate(cfg, world_size=world_size, check_files=False, check_init=True)  # init_from: as the run checks it
    counts = parameter_counts(cfg)
    stages = estimate_memory(cfg, counts, world_size)
    worst = max(stages, key=lambda s: s.total)
    p, gpu = cfg.parallel, cfg.cluster.gpu_memory_gib
    fits = _fits(worst.total, gpu)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if fits else 1
    dp = world_size // p.model_parallel_size
    print(f"dry run of {cfg.recipe}: layout valid for {world_size} GPUs (TP={p.tensor_model_parallel_size} "
          f"PP={p.pipeline_model_parallel_size} CP={p.context_parallel_size} DP={dp}), "
          f"recompute={cfg.train.recompute}, micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_length} tokens")
    print(f"  parameters: {counts['total'] / 1e9:.3f} B total ({counts['layers'] / 1e9:.3f} B in layers, "
          f"{counts['eviction']} in eviction heads, embedding {counts['embedding'] / 1e6:.1f} M, "
          f"output {counts['output'] / 1e6:.1f} M)")
    kept = ", ".join(f"{v} {sum(layer_bytes(cfg, v).values()) / 1024:,.1f} KiB"
                     for v in variant_counts(cfg, 0, cfg.model.num_layers))
    print(f"  kept for the backward per layer and token: {kept}")
    for line in (init_changes_line(cfg), dense_length_note(cfg)):
        if line:
            print(f"  {line}")
    for s in stages:
        parts = " + ".join(f"{k} {_gib(v)}" for k, v in s.parts.items() if v)
        print(f"  per GPU, {s.name} stage: {parts} = ~{_gib(s.total)} GiB")
    if fits:
        print(f"fits in {gpu:g} GiB: ~{worst.total / GIB:.1f} GiB <= {HEADROOM:.0%} of cluster.gpu_memory_gib={gpu:g} "
              f"(the rest: CUDA context, NCCL buffers, fragmentation)")
        return 0
    alts = _alternatives(cfg, counts, world_size)
    hint = f"; would fit: {' or '.join(alts)}" if alts else "; use more GPUs (TP/PP) or shorter sequences"
    print(f"does not fit in {gpu:g} GiB: ~{_gib(worst.total)} GiB on the {worst.name} stage > {HEADROOM:.0%} of "
          f"cluster.gpu_memory_gib={gpu:g}{hint}")
    return 1
