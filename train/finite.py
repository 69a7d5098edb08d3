"""Finite checks of gradients and weights, agreed on by every rank (one collective per check).

Each check reads megatron-core's flat DDP buffers (``grad_data``; ``param_data`` where the
distributed optimizer keeps one, else the buffer's parameters) with one ``aminmax`` reduction per
buffer: min and max are finite iff every element is (NaN propagates), and it allocates nothing
of the buffer's size. The per-rank verdicts are combined with one ``all_reduce(MAX)`` over the
world, so all ranks take the same branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _buffers(model_chunks) -> list:
    out = []
    for chunk in model_chunks:
        out += list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
    return out


def _local_nonfinite(tensors) -> bool:
    """True if any element of ``tensors`` (any float dtype, any device) is NaN or +-inf."""
    extremes = [torch.stack(torch.aminmax(t.reshape(-1))).float() for t in tensors if t is not None and t.numel()]
    return bool(extremes) and not bool(torch.isfinite(torch.cat(extremes)).all())


def _any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def grads_nonfinite(model_chunks, device: torch.device) -> bool:
    """Whether any rank holds a NaN/inf gradient (after the backward and the DP reduction)."""
    return _any_rank(_local_nonfinite([b.grad_data for b in _buffers(model_chunks)]), device)


def weights_nonfinite(model_chunks, device: torch.device) -> bool:
    """Whether any rank holds a NaN/inf weight (checked before every checkpoint save)."""
    tensors = []
    for b in _buffers(model_chunks):
        tensors += [b.param_data] if b.param_data is not None else [p.data for p in b.params]
    if not tensors:  # not wrapped in megatron DDP
        tensors = [p.data for m in model_chunks for p in m.parameters()]
    return _any_rank(_local_nonfinite(tensors), device)
