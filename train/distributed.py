"""Process group, megatron-core parallel state and seeding for one training process.

Works under ``torchrun`` (reads RANK / WORLD_SIZE / LOCAL_RANK) and as a plain single process.
On CPU it uses gloo and applies the megatron-core CPU shim (``runtime.megatron_cpu``);
GPU runs use NCCL and never touch the shim.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from train.config import RunConfig


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    is_last_stage: bool
    cp: tuple = (1, 0)  # (size, rank) of this rank's context-parallel group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def owns_loss(self) -> bool:
        """The rank that reports metrics: last pipeline stage, first TP, DP and CP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp[1] == 0


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but CUDA is not available; use run.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def world_size_from_env() -> int:
    """The process count torchrun set (1 for a plain ``python train/main.py``).

    Raises ``ValueError`` (one line) for WORLD_SIZE > 1 without RANK: such a process would wait
    forever for peers that nobody starts.
    """
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise ValueError(f"WORLD_SIZE={world!r} in the environment is not a positive integer; unset it or launch "
                         f"with torchrun")
    if int(world) > 1 and "RANK" not in os.environ:
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: start the {world} processes with torchrun "
                         f"(or launch/run_train.sh), or unset WORLD_SIZE for one process")
    return int(world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: RunConfig) -> DistEnv:
    """Create the process group and megatron parallel state for ``cfg.parallel``; seed everything."""
    from megatron.core import parallel_state as ps

    device = resolve_device(cfg.run.device)
    if device.type == "cpu":
        from runtime.megatron_cpu import apply_cpu_shim

        apply_cpu_shim(force=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        timeout = timedelta(minutes=cfg.cluster.dist_timeout_minutes)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one store over its restarts (--max-restarts): a fresh key space per attempt, else the
        # restarted ranks read the previous attempt's addresses and cannot connect
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                store=dist.PrefixStore(f"attempt_{attempt}/", store), rank=rank, world_size=world)
    p = cfg.parallel
    ps.initialize_model_parallel(
        distributed_timeout_minutes=max(1, round(cfg.cluster.dist_timeout_minutes)),
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size)
    seed_everything(cfg.run.seed)
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   device=device, dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   is_last_stage=ps.is_pipeline_last_stage(),
                   cp=(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()))


def seed_everything(seed: int) -> None:
    """Python/NumPy/torch seeds plus megatron's model-parallel RNG tracker (Megatron's +100 per PP stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
