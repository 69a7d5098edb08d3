"""Distributed checkpoints (megatron-core ``dist_checkpointing``, torch_dist format).

Layout under ``<run.dir>/checkpoints``::

    iter_0000020/        one complete checkpoint (model, optimizer, scheduler, RNG, data position)
    latest               text file naming the last COMPLETE checkpoint, replaced atomically

A save writes ``iter_N.tmp`` first and renames it when every rank has finished, then moves the
``latest`` pointer, so a crash (even kill -9) during a save leaves the previous checkpoint and
pointer intact. ``resume`` restores everything; ``init_from`` loads model weights only (the next
stage), tolerating parameters that the checkpoint lacks when they are new eviction-head
parameters (dense -> NOSA), which keep their initial values (A = 0).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from runtime.checkpoint_files import LATEST, MODEL_CONFIG, find_checkpoint

OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}  # reshardable over TP/PP/DP


def checkpoints_dir(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints"


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def unwrap(model):
    """The bare megatron model inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _model_sharded_state(model_chunks: list) -> dict:
    from megatron.core import parallel_state as ps

    model_chunks = [unwrap(m) for m in model_chunks]
    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict(metadata=meta)}
    return {f"model{i}": m.sharded_state_dict(metadata=meta) for i, m in enumerate(model_chunks)}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(s: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(s["random"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


def _rng_sharded(world_size: int, rank: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", _rng_state(), (world_size,), (rank,), replica_id=0)


def _state_dict(model_chunks, optimizer, scheduler, step: int, loader_state: dict, extra: dict) -> dict:
    sd = _model_sharded_state(model_chunks)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=OPTIM_METADATA)
    sd["scheduler"] = scheduler.state_dict()
    sd["rng_state"] = _rng_sharded(dist.get_world_size(), dist.get_rank())
    sd["step"] = step
    sd["data"] = loader_state
    sd["extra"] = extra
    return sd


def save_checkpoint(run_dir: str, step: int, model_chunks, optimizer, scheduler, loader_state: dict,
                    extra: dict, keep_last: int = 0, log=print, model_config: dict | None = None) -> Path:
    """Save a complete checkpoint of ``step`` and move ``latest`` to it (all ranks call this).

    ``model_config`` (model + attention configs as plain dicts) is written next to the tensors as
    ``nosa_config.json`` so that converters can rebuild the model without the training config.
    """
    from megatron.core import dist_checkpointing

    root = checkpoints_dir(run_dir)
    final, tmp = root / iter_name(step), root / (iter_name(step) + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_state_dict(model_chunks, optimizer, scheduler, step, loader_state, extra), str(tmp))
    if os.environ.get("NOSA_FAULT_KILL_DURING_SAVE") == str(step):  # test hook: crash mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    if dist.get_rank() == 0:
        if model_config is not None:
            (tmp / MODEL_CONFIG).write_text(json.dumps({**model_config, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / (LATEST + ".tmp")
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / LATEST)
        _prune(root, keep_last, keep=final.name)
        log(f"saved checkpoint {final}")
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int, keep: str) -> None:
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in root.glob("iter_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
    if keep_last > 0:
        for p in done[:-keep_last]:
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)


def _init_empty_adam_states(optimizer) -> None:
    """Give every parameter of a fresh torch Adam(W) a (zero) state, ``step`` included.

    megatron-core's optimizers build their loading templates from the current state; without
    Apex/TE a torch optimizer that never stepped has none. The values are overwritten on load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def load_checkpoint(ckpt: Path, model_chunks, optimizer, scheduler) -> tuple[int, dict, dict]:
    """Full resume: model, optimizer, scheduler, RNG. Returns ``(step, loader_state, extra)``."""
    from megatron.core import dist_checkpointing

    from runtime.megatron_compat import patch_distributed_optimizer_step_state, untie_adam_step_tensors

    patch_distributed_optimizer_step_state()
    _init_empty_adam_states(optimizer)
    sd = _model_sharded_state(model_chunks)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=OPTIM_METADATA)
    sd["rng_state"] = _rng_sharded(dist.get_world_size(), dist.get_rank())
    loaded = dist_checkpointing.load(sd, str(ckpt))
    _load_model(model_chunks, loaded, strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    untie_adam_step_tensors(optimizer)
    scheduler.num_steps = 0  # megatron's load_state_dict *adds* the saved step count
    scheduler.load_state_dict(loaded["scheduler"])
    _set_rng_state(loaded["rng_state"])
    return int(loaded["step"]), loaded["data"], loaded.get("extra", {})


def _load_model(model_chunks, loaded: dict, strict: bool) -> list[str]:
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    missing_all = []
    for key, m in zip(keys, model_chunks):
        result = unwrap(m).load_state_dict(loaded[key], strict=strict)
        if not strict:
            missing_all.extend(result.missing_keys)
    return missing_all


NEW_STAGE_PARAM_MARKERS = ("eviction", "_extra_state")


def load_weights(path: str, model_chunks, log=print) -> Path:
    """Weights-only start from a checkpoint (``init_from``); new eviction-head params keep their init."""
    from megatron.core import dist_checkpointing

    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"init_from={path!r}: no checkpoint there (expected a run dir, "
                                f"its checkpoints/ dir with a 'latest' pointer, or an iter_* dir)")
    sd = _model_sharded_state(model_chunks)
    saved = set(dist_checkpointing.load_tensors_metadata(str(ckpt)).keys())
    skipped = []
    for key in list(sd):
        for name in list(sd[key]):
            obj = sd[key][name]
            skey = getattr(obj, "key", None)
            if skey is not None and skey not in saved:
                if not any(mark in name for mark in NEW_STAGE_PARAM_MARKERS):
                    raise KeyError(f"init_from={ckpt}: the checkpoint has no tensor {skey!r} for {name}; "
                                   f"only new eviction-head parameters may be missing")
                skipped.append(name)
                del sd[key][name]
    loaded = dist_checkpointing.load(sd, str(ckpt))
    missing = _load_model(model_chunks, loaded, strict=False)
    unexpected = [k for k in missing if k not in skipped and not any(m in k for m in NEW_STAGE_PARAM_MARKERS)]
    if unexpected:
        raise KeyError(f"init_from={ckpt}: parameters not restored: {unexpected}")
    new_params = sorted(n for n in skipped if "_extra_state" not in n)
    if new_params:
        log(f"init_from {ckpt}: {len(new_params)} new parameters keep their initial values "
            f"(e.g. {new_params[0]})")
    return ckpt
