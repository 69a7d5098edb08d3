"""Finite checks of gradients and weights, agreed on by every rank (one collective and at most one host
read per check).

Each check reads megatron-core's flat DDP buffers (``grad_data``; ``param_data`` where the
distributed optimizer keeps one, else the buffer's parameters) with one ``aminmax`` reduction per
buffer: min and max are finite iff every element is (NaN propagates), and it allocates nothing
of the buffer's size. The per-rank verdicts stay on the device until they are combined with one
``all_reduce(MAX)`` over the world; the host reads the combined verdict once, so all ranks take the
same branch and a step waits for the GPU once per check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _buffers(model_chunks) -> list:
    out = []
    for chunk in model_chunks:
        out += list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
    return out


def _local_nonfinite(tensors, device: torch.device) -> torch.Tensor:
    """``[1]`` float32 on ``device``: 1 if any element of ``tensors`` (any float dtype) is NaN or +-inf,
    else 0; computed without a host read."""
    extremes = [torch.stack(torch.aminmax(t.reshape(-1))).float().to(device)
                for t in tensors if t is not None and t.numel()]
    if not extremes:
        return torch.zeros(1, device=device)
    return (~torch.isfinite(torch.cat(extremes)).all()).float().reshape(1)


def _on_all_ranks(flag: torch.Tensor) -> torch.Tensor:
    """``flag`` combined over every rank (``all_reduce(MAX)``), still on the device."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def _any_rank(flag: torch.Tensor) -> bool:
    """The verdict of every rank's ``flag``, read by the host once."""
    return bool(_on_all_ranks(flag).item() > 0)


def grads_nonfinite_flag(model_chunks, device: torch.device) -> torch.Tensor:
    """``[1]`` float32 on ``device``, the same on every rank: 1 if any rank holds a NaN/inf gradient
    (after the backward and the DP reduction), else 0. Not read by the host, so the caller can read it
    together with other values (the trainer reads it with the loss: one wait per step)."""
    return _on_all_ranks(_local_nonfinite([b.grad_data for b in _buffers(model_chunks)], device))


def weights_nonfinite(model_chunks, device: torch.device) -> bool:
    """Whether any rank holds a NaN/inf weight (checked before every checkpoint save)."""
    tensors = []
    for b in _buffers(model_chunks):
        tensors += [b.param_data] if b.param_data is not None else [p.data for p in b.params]
    if not tensors:  # not wrapped in megatron DDP
        tensors = [p.data for m in model_chunks for p in m.parameters()]
    return _any_rank(_local_nonfinite(tensors, device))
