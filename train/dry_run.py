"""``dry_run=true``: validate the layout for ``parallel.world_size`` GPUs and say whether it fits
``cluster.gpu_memory_gib``, without a GPU, data or other processes.

Parameters are counted exactly on a meta-device build (one private process group, TP = PP = 1).
Per-GPU bytes of the most loaded pipeline stage then follow from the layout:

* weights (bf16/fp16: 2 B, fp32: 4 B per parameter) and fp32 gradient buffers (4 B), split by TP and PP;
* optimizer: fp32 master weights (bf16/fp16 only, 4 B) + Adam moments (8 B), also split over
  DP x CP with the distributed optimizer;
* activations per layer and token, as this project's layers keep them for the backward (bf16 a = 2 B):
  two RMSNorms computed in fp32 ``2 (4 + 2a) h`` (fused, ``train.fusions``: their input, ``2 a h``);
  attention ``a (5 q + 5 kv)`` (fused QKV output, rotated q/k, the kernel's contiguous q/k/v,
  attention output and projection input; flash-style kernels keep no s x s matrix);
  SwiGLU MLP ``4 a f`` (gate|up output, silu(gate), down-projection input; the fused SwiGLU keeps
  ``a f`` less, not credited here: with it the estimate fell 5-9% below the peaks measured at 32K).
  ``q``/``kv``: query / KV channels, ``f``: FFN size. Norm terms split by TP only with sequence parallelism. Selective
  recompute of core attention frees nothing more for flash-style kernels; full recompute keeps
  ``a h`` per layer plus one layer's full set;
* NOSA layers add the block selection (1 B) and the kernels' block-sparse index (4 B) per
  (KV head, query token, key block), and the eviction head's score and bias (2 x 4 B per KV head
  and token); the reference backend (CPU tests) adds O(s^2) scores;
* the logits of the last stage: bf16 output + the fp32 copy the loss keeps (6 B per token and
  vocabulary entry; 8 B in fp32);
* the backward's working set: one more layer's activations.

Pipeline stages hold up to PP micro-batches in flight (1F1B; interleaving adds (PP-1)/(PP*VPP)).
The verdict leaves 10% of the GPU to the CUDA context, NCCL buffers and allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from train.config import RunConfig, validate

GIB = 2 ** 30
HEADROOM = 0.90  # share of cluster.gpu_memory_gib a layout may plan to use
PARTS = ("weights", "grads", "optimizer", "activations", "nosa", "logits")


@dataclass
class StageMemory:
    """Bytes per GPU of one pipeline stage (``name``: only / first / last) by part (``PARTS``)."""

    name: str
    parts: dict

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _private_process_group():
    """A one-process gloo group on an in-memory store: never waits for WORLD_SIZE peers."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def count_parameters(cfg: RunConfig) -> dict:
    """Exact parameter counts of the full model (embedding, output layer, decoder layers, eviction heads)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nosa_layers.megatron import ParallelConfig, build_model
    from runtime.megatron_cpu import apply_cpu_shim
    from train.distributed import seed_everything

    apply_cpu_shim(force=True)
    created = _private_process_group()
    ps.initialize_model_parallel(1, 1)
    seed_everything(cfg.run.seed)
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
        if created:
            dist.destroy_process_group()


def layer_activation_bytes(cfg: RunConfig) -> dict:
    """Bytes one micro-batch keeps per decoder layer on one GPU: ``layer`` (kept for the backward
    under ``train.recompute``), ``full_layer`` (without recompute) and ``nosa`` (per NOSA layer)."""
    m, p, t, a = cfg.model, cfg.parallel, cfg.train, cfg.attention
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    act = 4 if t.precision == "fp32" else 2
    tokens = t.seq_length // cp * t.micro_batch_size
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
    # the plan is for GPUs, where train.fusions applies (fused norms keep only their input)
    norms = 2 * (act if t.fusions else 4 + 2 * act) * h / (tp if p.sequence_parallel else 1)
    full = tokens * (norms + (act * (5 * q + 5 * kv) + 4 * act * f) / tp)
    kept = {"none": full, "selective": full,
            "full": tokens * act * h / (tp if p.sequence_parallel else 1)}[t.recompute]
    nosa = 0.0
    if a.has_sparse_layers(m.num_layers):
        n = a.nosa
        kv_heads = max(1, m.num_kv_heads // tp)
        key_blocks = -(-t.seq_length // n.block_size)
        nosa = kv_heads * tokens * (5 * key_blocks + 8)
        if a.backend == "reference":
            nosa += 12 * max(1, m.num_attention_heads // tp) * tokens * t.seq_length
    return {"layer": kept, "full_layer": full, "nosa": nosa}


def estimate_memory(cfg: RunConfig, counts: dict, world_size: int) -> list[StageMemory]:
    """Per-GPU bytes of each kind of pipeline stage (one entry at PP=1; first and last otherwise)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    dp = world_size // p.model_parallel_size
    low = t.precision in ("bf16", "fp16")
    shard = dp * p.context_parallel_size if p.use_distributed_optimizer else 1
    layers = m.num_layers // pp
    per_layer = counts["layers"] / m.num_layers
    sparse = sum(v in ("nosa", "infllm_v2") for v in cfg.attention.layer_variants(m.num_layers)) / m.num_layers
    output = counts["output"] or (counts["embedding"] if pp > 1 else 0)  # tied: the last stage keeps a copy
    act = layer_activation_bytes(cfg)
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    tokens = t.seq_length // p.context_parallel_size * t.micro_batch_size
    stages = [("only", True, True)] if pp == 1 else [("first", True, False), ("last", False, True)]
    out = []
    for name, first, last in stages:
        params = (layers * per_layer + (counts["embedding"] if first else 0) + (output if last else 0)) / tp
        in_flight = 1.0
        if first and pp > 1:
            in_flight = min(pp, microbatches) * (1 + (pp - 1) / (pp * vpp) if vpp else 1)
        kept_nosa = act["nosa"] * (layers * sparse if t.recompute != "full" else min(1.0, layers * sparse))
        parts = {"weights": params * (2 if low else 4), "grads": params * 4,
                 "optimizer": params * ((4 if low else 0) + 8) / shard,
                 "activations": (act["layer"] * layers) * in_flight + act["full_layer"],
                 "nosa": kept_nosa * in_flight,
                 "logits": tokens * m.padded_vocab_size / tp * (6 if low else 8) if last else 0.0}
        out.append(StageMemory(name, parts))
    return out


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


def dry_run(cfg: RunConfig) -> int:
    """Print the layout, parameter counts, per-GPU memory and the verdict; 0 if it fits, 1 if not."""
    world_size = _world_size(cfg)
    validate(cfg, world_size=world_size, check_files=False)
    counts = count_parameters(cfg)
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
    for s in stages:
        parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in s.parts.items() if v)
        print(f"  per GPU, {s.name} stage: {parts} = ~{s.total / GIB:.1f} GiB")
    if fits:
        print(f"fits in {gpu:g} GiB: ~{worst.total / GIB:.1f} GiB <= {HEADROOM:.0%} of cluster.gpu_memory_gib={gpu:g} "
              f"(the rest: CUDA context, NCCL buffers, fragmentation)")
        return 0
    alts = _alternatives(cfg, counts, world_size)
    hint = f"; would fit: {' or '.join(alts)}" if alts else "; use more GPUs (TP/PP) or shorter sequences"
    print(f"does not fit in {gpu:g} GiB: ~{worst.total / GIB:.1f} GiB on the {worst.name} stage > {HEADROOM:.0%} of "
          f"cluster.gpu_memory_gib={gpu:g}{hint}")
    return 1
