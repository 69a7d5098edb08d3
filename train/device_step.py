"""megatron-core's optimizer step without a host read (``train.step_reads=at_log``).

megatron-core's step reads the gradient norm back to the host (its clip decision and skip threshold are
host-side), and the trainer reads the loss and the finite-gradient verdict before it; each read drains the
GPU's queue, so the optimizer step and the next step's first forward then run at the host's pace. Here the
same step is queued with nothing read back:

* megatron-core's own pieces: ``prepare_grads`` (model gradients to main gradients),
  ``get_grads_for_grad_norm`` of each optimizer (its filter of shared and tensor-parallel-duplicate
  gradients) and ``step_with_ready_grads`` (the torch AdamW steps, the copy back to the model parameters
  and the parameter gathers, in the chain's order);
* the gradient norm as ``get_grad_norm_fp32`` computes it (L2 over the optimizer's grad-stats group), kept
  on the device, and clipping by the tensor coefficient ``min(1, clip / (norm + 1e-6))`` (megatron-core's
  own path where Transformer Engine provides a tensor scale);
* a step whose ``bad`` flag (non-finite loss or gradients) is set or whose norm is not finite is skipped on
  the device: torch's fused AdamW takes a ``found_inf`` tensor and then leaves the weights, the moments and
  the step count as they were.

:func:`queue_step` queues one step and a non-blocking copy of its loss, skip and norm; the trainer reads
them later with :func:`read_queued` (at the log, evaluation, checkpoint and stop points) and applies its
non-finite policy there. Needs the fused AdamW (``optim.fused``) and no fp16 loss
scaler (its unscale reads ``found_inf`` on the host)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.megatron_compat import multi_tensor_l2_norm
from train.optim import adam_is_fused, torch_adams


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def supports_device_step(optimizer) -> str | None:
    """Why :func:`step_on_device` cannot run ``optimizer`` (``None`` if it can)."""
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group, _is_separate_grad_norm_group

    for opt in _optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if any(_is_separate_grad_norm_group(_get_param_grad_norm_group(p)) for p in opt.get_parameters()):
            return "parameters with a separate gradient-norm group"
        if getattr(opt, "grad_scaler", None) is not None:
            return "an fp16 loss scaler reads found_inf on the host"
        if opt.config.use_precision_aware_optimizer:
            return "the precision-aware optimizer keeps decoupled gradients"
    if not adam_is_fused(optimizer):
        return "the device-side skip needs torch's fused AdamW (optim.fused=true)"
    return None


def grad_norm_on_device(optimizer, device: torch.device) -> torch.Tensor:
    """0-dim fp32: the L2 norm of the gradients megatron-core clips by (each optimizer's
    ``get_grads_for_grad_norm``, summed in squares over its grad-stats group), not read by the host."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for opt in _optimizers(optimizer):
        grads = opt.get_grads_for_grad_norm()
        # a rank without gradients here still joins the reduction (as megatron-core's does), or its peers wait
        sq = (multi_tensor_l2_norm(None, None, [grads], False)[0].reshape(()).square() if grads
              else torch.zeros((), dtype=torch.float32, device=device))
        group = opt.get_grad_stats_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        total = total + sq
    return total.sqrt()


def step_on_device(optimizer, bad: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue ``optimizer``'s step (megatron-core's) with no host read: returns ``(grad_norm, skipped)``, 0-dim
    fp32 tensors on ``device``; ``bad`` (any shape, nonzero = skip) is the caller's verdict of the step."""
    opts = _optimizers(optimizer)
    if optimizer.prepare_grads():  # only an fp16 loss scaler reports here (refused by supports_device_step)
        raise RuntimeError("step_on_device: the loss scaler found inf/nan (fp16 is not supported)")
    norm = grad_norm_on_device(optimizer, device)
    for opt in opts:  # each optimizer clips its own gradients by the whole norm, as megatron-core's chain does
        grads = [p.grad for p in opt.get_parameters() if p.grad is not None]
        if opt.config.clip_grad > 0 and grads:
            torch._foreach_mul_(grads, (opt.config.clip_grad / (norm + 1.0e-6)).clamp_max(1.0))
    skipped = (bad.reshape(-1).ne(0).any() | ~torch.isfinite(norm)).float().reshape(())
    adams = torch_adams(optimizer)
    for adam in adams:
        adam.found_inf = skipped
    try:
        optimizer.step_with_ready_grads()  # a chain's own: its parameter-sync ordering across optimizers
    finally:
        for adam in adams:
            del adam.found_inf
    return norm, skipped


def queue_step(optimizer, loss: torch.Tensor, grads_nonfinite: torch.Tensor, device: torch.device) -> tuple:
    """Queue ``optimizer``'s step (:func:`step_on_device`), skipped for a non-finite ``loss`` (``[1]``) or a
    set ``grads_nonfinite`` flag (``[1]``). Returns ``(values, event)``: ``[loss, skipped, grad_norm]``
    float64, copied to pinned host memory without blocking (on the CPU the tensor itself, ``event`` None)."""
    bad = torch.cat([grads_nonfinite.double(), (~torch.isfinite(loss)).double()])
    norm, skipped = step_on_device(optimizer, bad, device)
    values = torch.stack([loss.reshape(()), skipped.double(), norm.double()])
    event = None
    if values.is_cuda:
        host = torch.empty(3, dtype=torch.float64, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        values = host
    return values, event


def read_queued(queued: tuple) -> tuple[float, bool, float]:
    """``(loss, skipped, grad_norm)`` of a :func:`queue_step`, waiting for the GPU only as far as that step."""
    values, event = queued
    if event is not None:
        event.synchronize()
    loss, skipped, norm = values.tolist()
    return loss, bool(skipped), norm
