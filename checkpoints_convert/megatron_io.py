"""The parts of the converters that need megatron-core: writing a trainer-loadable distributed
checkpoint and running the Megatron forward (for ``verify``). Single process, gloo, CPU or GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import Tensor

from checkpoints_convert.common import LATEST, MODEL_CONFIG, configs_to_dict
from runtime.checkpoint_manifest import hash_files, list_files, write_manifest

ITER0 = "iter_0000000"


def init_single_process() -> None:
    """A world-size-1 process group (gloo) for megatron-core, unless one exists already."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from runtime.megatron_cpu import apply_cpu_shim

        apply_cpu_shim()
    if dist.is_initialized():
        return
    # a TCP store on a free port: nothing left on disk (a FileStore's directory outlived every run)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def save_dist_checkpoint(tensors: Dict[str, Tensor], out: Path, model_cfg, attn_cfg, step: int = 0,
                         extra: Optional[dict] = None) -> Path:
    """Write ``out/iter_0000000`` (megatron ``torch_dist``, the model under key ``model``), its
    ``nosa_config.json`` and the ``out/latest`` pointer: what the trainer's ``init_from`` and
    ``to_hf --ckpt`` read. ``tensors`` are global; layer tensors stacked on a leading axis."""
    init_single_process()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = Path(out)
    ckpt = out / ITER0
    ckpt.mkdir(parents=True)
    sharded = {k: ShardedTensor.from_rank_offsets(k, t.contiguous(), replica_id=0) for k, t in tensors.items()}
    dist_checkpointing.save({"model": sharded}, str(ckpt))
    cfg = {**configs_to_dict(model_cfg, attn_cfg), "recipe": None, "step": step}
    if extra:
        cfg.update(extra)
    (ckpt / MODEL_CONFIG).write_text(json.dumps(cfg, indent=2))
    write_manifest(ckpt, hash_files(ckpt, list_files(ckpt)))
    (out / LATEST).write_text(ITER0 + "\n")
    return ckpt


def load_megatron_model(ckpt: Path, model_cfg, attn_cfg, backend: str = "reference", dtype: str = "float32",
                        device: Optional[torch.device] = None):
    """The Megatron model (TP=PP=1, local spec, eval mode) with the weights of ``ckpt``, on ``device``
    (default: CUDA when available, else CPU), parameters in ``dtype``, NOSA ``backend``."""
    from dataclasses import replace

    init_single_process()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nosa_layers.megatron import ParallelConfig, build_model

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1)
    attn = replace(attn_cfg, backend=backend)
    # built and loaded on the CPU (the same path on every machine), then moved to ``device``
    model = build_model(replace(model_cfg, params_dtype=dtype), attn, ParallelConfig(), use_te=False,
                        perform_initialization=False, use_cpu_initialization=True)
    # _extra_state entries (TE/fp8 metadata; empty with the local spec) are absent from from_hf
    # checkpoints: load everything else strictly, as the trainer's init_from does.
    sharded = {k: v for k, v in model.sharded_state_dict().items() if "_extra_state" not in k}
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoints_convert.mapping import ConversionError
    from runtime.safe_unpickling import load_error_line, read_checkpoint_metadata

    try:
        read_checkpoint_metadata(ckpt)
        loaded = dist_checkpointing.load({"model": sharded}, str(ckpt))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's is a BaseException
        raise ConversionError(f"cannot load {ckpt}: {load_error_line(e)}") from None
    result = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if "_extra_state" not in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{ckpt}: missing {missing}, unexpected {result.unexpected_keys}")
    model.eval()
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return model.to(device)


def megatron_logits(ckpt: Path, model_cfg, attn_cfg, tokens: Tensor, backend: str = "reference",
                    on_row=None) -> Tensor:
    """Logits ``[B, T, vocab_size]`` (fp32) of the Megatron model (TP=PP=1) loaded from ``ckpt``;
    ``on_row()`` is called after each row."""
    model = load_megatron_model(ckpt, model_cfg, attn_cfg, backend)
    device = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for row in tokens:
            ids = row[None].to(device)
            pos = torch.arange(ids.shape[1], device=device)[None]
            outs.append(model(ids, pos, None).float()[..., :model_cfg.vocab_size].cpu())
            if on_row is not None:
                on_row()
    return torch.cat(outs, dim=0)
