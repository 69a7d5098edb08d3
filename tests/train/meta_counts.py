"""Parameter counts of models built by megatron-core on the meta device: the ground truth of
``train.memory_model.parameter_counts`` (``tests/train/test_sizing.py``).

``python tests/train/meta_counts.py OUT.json CASES.json`` (``CASES.json``: ``{name: [overrides]}``)
writes ``{name: {total, embedding, output, layers, eviction}}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def meta_counts(overrides: list[str]) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from nosa_layers.megatron import ParallelConfig, build_model
    from train.compose import load_config

    cfg = load_config(overrides)
    ps.initialize_model_parallel(1, 1)
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
                counts["eviction"] += p.numel() if "eviction" in name else 0
        return counts
    finally:
        ps.destroy_model_parallel()


if __name__ == "__main__":
    from runtime.megatron_cpu import apply_cpu_shim, lean_megatron_import

    lean_megatron_import()  # before anything imports megatron-core: a meta build needs none of its GPU machinery
    import torch.distributed as dist

    apply_cpu_shim(force=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with open(sys.argv[2]) as fh:
        cases = json.load(fh)
    result = {name: meta_counts(overrides) for name, overrides in cases.items()}
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, sys.argv[1])
