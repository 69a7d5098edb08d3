"""Distributed checkpoints (megatron-core ``dist_checkpointing``, torch_dist format).

Layout under ``<run.dir>/checkpoints``::

    iter_0000020/        one complete checkpoint (model, optimizer, scheduler, RNG, data position)
        manifest.json    size + xxh3-128 checksum of every file (runtime.checkpoint_manifest)
    latest               text file naming the last COMPLETE checkpoint, replaced atomically

A save writes ``iter_N.tmp`` first; when every rank has finished, the ranks hash the files (each
a share), rank 0 writes the manifest, renames the directory and moves the ``latest`` pointer, so
a crash (even kill -9) during a save leaves the previous checkpoint and pointer intact; a failed or
interrupted save (a full disk) removes its ``iter_N.tmp`` and says so in one line. Loading
verifies the manifest first (again split over the ranks); a checkpoint of this trainer without one
is damaged. A damaged checkpoint is reported in one line and the resume falls back to the newest
verified one (``checkpoint.on_corrupt=fallback``) or stops (``fail``). Rotation keeps the
``keep_last`` newest verified checkpoints, re-hashing each older one it counts before it deletes
anything older still (one previous checkpoint per save once the run is under way).

``resume`` restores everything; ``init_from`` loads model weights only (the next stage),
tolerating parameters that the checkpoint lacks when they are new eviction-head parameters
(dense -> NOSA), which keep their initial values (A = 0).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data import disk_space
from runtime import checkpoint_manifest as manifest
from runtime.checkpoint_files import LATEST, MODEL_CONFIG, CheckpointError, complete_checkpoints, select_checkpoint
from runtime.outputs import write_atomic
from runtime.safe_unpickling import load_error_line, read_checkpoint_metadata
from train.lost_rank import is_collective_failure

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
                    extra: dict, keep_last: int = 0, log=print, model_config: dict | None = None,
                    newest_verified: Path | None = None) -> Path:
    """Save a complete checkpoint of ``step`` and move ``latest`` to it (all ranks call this).

    ``model_config`` (model + attention configs as plain dicts) is written next to the tensors as
    ``nosa_config.json`` so that converters can rebuild the model without the training config. A failed
    or interrupted save removes its ``iter_N.tmp`` and leaves the earlier checkpoints as they were; a
    failure is one :class:`CheckpointError` line (a full disk says how much to free), naming
    ``newest_verified``.
    """
    root = checkpoints_dir(run_dir)
    final, tmp = root / iter_name(step), root / (iter_name(step) + ".tmp")

    def publish():  # the complete checkpoint under its name, then `latest` moved to it
        if final.is_symlink():  # a link is replaced, never followed
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / LATEST, final.name + "\n")  # a rename: a link named `latest` is replaced
        manifest.fsync_dir(root)
        log(f"saved checkpoint {final}")

    try:
        _write_checkpoint(tmp, step, model_chunks, optimizer, scheduler, loader_state, extra, model_config)
        _on_rank0(publish)
    except BaseException as e:
        _save_failed(e, tmp, step, newest_verified)
    _prune(root, keep_last, keep=final, log=log)
    return final


def _write_checkpoint(tmp: Path, step: int, model_chunks, optimizer, scheduler, loader_state: dict, extra: dict,
                      model_config: dict | None) -> None:
    """Every file of the checkpoint, its manifest last, into ``tmp`` (all ranks call this; the steps only
    rank 0 takes report their failure to every rank)."""
    from megatron.core import dist_checkpointing

    def start():
        if tmp.is_symlink():
            tmp.unlink()
        elif tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _on_rank0(start)
    dist_checkpointing.save(_state_dict(model_chunks, optimizer, scheduler, step, loader_state, extra), str(tmp))
    if os.environ.get("NOSA_FAULT_KILL_DURING_SAVE") == str(step):  # test hook: crash mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    if model_config is not None:
        _on_rank0(lambda: (tmp / MODEL_CONFIG).write_text(json.dumps({**model_config, "step": step}, indent=2)))
    entries = _hash_shared(tmp)
    _on_rank0(lambda: manifest.write_manifest(tmp, entries))


class _PeerFailed(RuntimeError):
    """Rank 0 failed a step of the save that only it takes (its own error says why)."""


def _on_rank0(fn) -> None:
    """Run ``fn`` on rank 0; every rank learns whether it failed (one broadcast) and raises with it."""
    failed = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failed[0] = f"{type(e).__name__}: {e}"
            dist.broadcast_object_list(failed, src=0)
            raise
    dist.broadcast_object_list(failed, src=0)
    if failed[0] is not None:
        raise _PeerFailed(f"rank 0 failed: {failed[0]}")


def _save_failed(e: BaseException, tmp: Path, step: int, newest_verified: Path | None):
    """Remove the partial ``tmp`` (rank 0) and re-raise: an interruption as it is, a failure as one line."""
    root = tmp.parent
    interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))  # torch's CheckpointException is a BaseException
    full = not interrupted and not isinstance(e, _PeerFailed) and disk_space.is_disk_full(e, root)
    free, partial = disk_space.free_bytes(root), disk_space.tree_bytes(tmp)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if interrupted or is_collective_failure(e):  # reported by train.main
        raise e
    kept = f"newest verified checkpoint: {newest_verified}" if newest_verified else "no earlier checkpoint"
    if full:
        prev = next(iter(complete_checkpoints(root)), None)
        need = disk_space.tree_bytes(prev) if prev is not None else None
        what = (f"a checkpoint takes about {disk_space.human(need)}: free at least that much"
                if need else f"free more than the {disk_space.human(partial)} it had written")
        raise CheckpointError(f"disk full while saving the step-{step} checkpoint into {root} "
                              f"({disk_space.human(free)} free): removed the partial {tmp.name}, the earlier "
                              f"checkpoints are as they were ({kept}); {what} there (checkpoint.keep_last=N keeps "
                              f"fewer) and launch again to resume") from None
    raise CheckpointError(f"cannot save the step-{step} checkpoint into {root} ({load_error_line(e)}): removed "
                          f"the partial {tmp.name}, the earlier checkpoints are as they were ({kept})") from None


def _my_share(names: list[str]) -> list[str]:
    return names[_rank()::dist.get_world_size() if dist.is_initialized() else 1]


def _hash_shared(ckpt: Path) -> dict:
    """Manifest entries of every file of ``ckpt``, each rank hashing a share (all ranks call this)."""
    names = manifest.list_files(ckpt)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, manifest.hash_files(ckpt, _my_share(names)))
    return {k: v for part in parts for k, v in part.items()}


def verify_shared(ckpt: Path) -> str | None:
    """``runtime.checkpoint_manifest.verify`` with the hashing split over the ranks (all ranks call this; without a
    process group, this process hashes everything)."""
    try:
        entries = manifest.read_manifest(ckpt)
    except ValueError as e:
        return str(e)
    names = sorted(entries)
    missing = manifest.unlisted(ckpt, entries)  # every rank lists the same directory: no collective
    mine = manifest.check_entries(ckpt, {n: entries[n] for n in _my_share(names)})
    if not dist.is_initialized():
        return manifest.first_problem(missing + mine)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return manifest.first_problem(missing + [p for part in parts for p in part])


def newest_verified_checkpoint(run_dir: str) -> Path | None:
    """The newest checkpoint of a run whose every file matches its manifest hash (one rank, no collective)."""
    root = checkpoints_dir(run_dir)
    return next((d for d in complete_checkpoints(root) if manifest.verify(d, deep=True) is None), None) \
        if root.is_dir() else None


def _prune(root: Path, keep_last: int, keep: Path, log=print, verify=None) -> None:
    """Delete the checkpoints older than the ``keep_last`` newest verified ones, ``keep`` (just written and
    hashed) among them (all ranks call this). Each older candidate is re-hashed (``verify``, split over the
    ranks) before anything older than it goes: a damaged one never stands in for a deleted good one."""
    verify = verify or verify_shared
    if _rank() == 0:
        for p in root.glob("iter_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last <= 0:
        return
    t0, done = time.perf_counter(), complete_checkpoints(root)  # newest first
    verified = [keep]
    for d in done:
        if len(verified) == keep_last:
            break
        if d == keep or _step_of(d) > _step_of(keep):
            continue
        problem = verify(d)
        if problem is None:
            verified.append(d)
        else:
            log(f"warning: checkpoint {d} is damaged ({problem}): rotation does not count it")
    if len(verified) < keep_last:
        return
    gone = [d for d in done if _step_of(d) < _step_of(verified[-1]) and d != keep  # only what this trainer wrote
            and any((d / name).exists() for name in (manifest.MANIFEST, MODEL_CONFIG))]
    if gone and _rank() == 0:
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        log(f"rotation: deleted {', '.join(d.name for d in gone)} (checkpoint.keep_last={keep_last}; the kept "
            f"{', '.join(d.name for d in verified[1:]) or keep.name} verified by hash in "
            f"{time.perf_counter() - t0:.1f}s)")
    _barrier()


def _step_of(d: Path) -> int:
    try:
        return int(d.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def saved_world_size(ckpt: Path) -> int | None:
    """How many ranks saved ``ckpt`` (its per-rank RNG states ``rng_state/shard_<rank>_<world>``); None when
    its metadata does not say (the load reports an unreadable one)."""
    try:
        keys = read_checkpoint_metadata(ckpt).state_dict_metadata
    except Exception:  # noqa: BLE001 - reported in one line by the load itself
        return None
    sizes = {k.rsplit("_", 1)[1] for k in keys if k.startswith("rng_state/shard_")}
    return int(sizes.pop()) if len(sizes) == 1 and next(iter(sizes)).isdigit() else None


def load_checkpoint(ckpt: Path, model_chunks, optimizer, scheduler, seed: int = 0,
                    log=print) -> tuple[int, dict, dict]:
    """Full resume: model, optimizer, scheduler, RNG. Returns ``(step, loader_state, extra)``.

    The RNG states are per rank: saved by another number of ranks, the ranks the checkpoint has a state for
    take theirs, the others are re-seeded from ``seed`` as at a fresh start (one line says so)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from runtime.megatron_compat import patch_distributed_optimizer_step_state, untie_adam_step_tensors
    from train.distributed import seed_everything

    patch_distributed_optimizer_step_state()
    _init_empty_adam_states(optimizer)
    sd = _model_sharded_state(model_chunks)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=OPTIM_METADATA)
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = saved_world_size(ckpt) or world
    rng = {"rng_state": ShardedObject("rng_state", _rng_state(), (saved,), (rank,), replica_id=0)} \
        if rank < saved else {}
    loaded = _load({**sd, **rng} if saved == world else sd, ckpt)
    if saved != world:  # some states are not read (fewer ranks) or not there (more): megatron's check of
        again = _load(rng, ckpt, validate=False)  # whole coverage does not apply to them
        loaded["rng_state"] = again.get("rng_state")  # (the rest of `again` is the common state once more)
    _load_model(model_chunks, loaded, strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    untie_adam_step_tensors(optimizer)
    scheduler.num_steps = 0  # megatron's load_state_dict *adds* the saved step count
    scheduler.load_state_dict(loaded["scheduler"])
    if rank < saved:
        _set_rng_state(loaded["rng_state"])
    else:
        seed_everything(seed)
    if saved != world and rank == 0:
        def ranks(a, b, one, many):
            return f"{one} {a}" if a == b else f"{many} {a}-{b}"

        what = (f"{ranks(saved, world - 1, 'rank', 'ranks')} re-seeded from run.seed={seed}, the others continue "
                f"their RNG states" if world > saved else
                f"{ranks(world, saved - 1, 'the RNG state of rank', 'the RNG states of ranks')} dropped")
        log(f"resuming {ckpt}, saved by {saved} rank(s), on {world}: {what}; the run continues, though not bit "
            f"for bit as it would on {saved}")
    return int(loaded["step"]), loaded["data"], loaded.get("extra", {})


def _load(sharded_state: dict, ckpt: Path, validate: bool = True) -> dict:
    """``dist_checkpointing.load`` whose failures (unreadable or unsafe files) are one ``CheckpointError`` line;
    ``validate``: megatron-core's check that the ranks together read every shard exactly once."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        read_checkpoint_metadata(ckpt)
        return dist_checkpointing.load(sharded_state, str(ckpt), validate_access_integrity=validate)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's is a BaseException
        if is_collective_failure(e):
            raise
        raise CheckpointError(f"cannot load {ckpt}: {load_error_line(e)}") from None


def _load_model(model_chunks, loaded: dict, strict: bool) -> list[str]:
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    missing_all = []
    for key, m in zip(keys, model_chunks):
        result = unwrap(m).load_state_dict(loaded[key], strict=strict)
        if not strict:
            missing_all.extend(result.missing_keys)
    return missing_all


NEW_STAGE_PARAM_MARKERS = ("eviction", "_extra_state")


UNVERIFIED_HINT = "set checkpoint.allow_unverified=true to load it anyway"


def load_weights(path: str, model_chunks, log=print, allow_unverified: bool = False) -> Path:
    """Weights-only start from a checkpoint (``init_from``); new eviction-head params keep their init."""
    from megatron.core import dist_checkpointing

    ckpt = select_checkpoint(path, verify=verify_shared, fallback=False, log=log, allow_foreign=allow_unverified,
                             foreign_hint=UNVERIFIED_HINT)
    if ckpt is None:
        raise CheckpointError(f"init_from={path!r}: no checkpoint there (expected a run dir, "
                              f"its checkpoints/ dir with a 'latest' pointer, or an iter_* dir)")
    sd = _model_sharded_state(model_chunks)
    try:
        read_checkpoint_metadata(ckpt)
        saved = set(dist_checkpointing.load_tensors_metadata(str(ckpt)).keys())
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint is one line
        raise CheckpointError(f"cannot read {ckpt}: {load_error_line(e)}") from None
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
    loaded = _load(sd, ckpt)
    missing = _load_model(model_chunks, loaded, strict=False)
    unexpected = [k for k in missing if k not in skipped and not any(m in k for m in NEW_STAGE_PARAM_MARKERS)]
    if unexpected:
        raise KeyError(f"init_from={ckpt}: parameters not restored: {unexpected}")
    new_params = sorted(n for n in skipped if "_extra_state" not in n)
    if new_params:
        log(f"init_from {ckpt}: {len(new_params)} new parameters keep their initial values "
            f"(e.g. {new_params[0]})")
    return ckpt
