"""The language-model loss without the whole logits: cross entropy chunk by chunk of tokens.

megatron-core's loss computes the ``[tokens, vocab/tp]`` logits of a micro-batch from the final hidden
states, and its cross entropy keeps their fp32 softmax for the backward: at 32K tokens and a 73,448-entry
vocabulary, 4.5 GiB of bf16 logits and 9 GiB of fp32 softmax on one GPU, at the moment every layer's
activations are alive too.

:func:`chunked_lm_loss` computes the same masked loss sum ``chunk_tokens`` tokens at a time and, while a
chunk's logits exist, also its gradients (for the hidden states and the output weight): nothing of the size
of the logits outlives a chunk, and no logit is computed twice (the same three GEMMs as the whole-logit
loss: logits, hidden-state gradient, weight gradient). What it keeps for the backward is the hidden-state
gradient ``[tokens, h]`` and the fp32 weight gradient ``[vocab/tp, h]``; the backward only scales them by the
incoming gradient of the (scalar) loss sum. Its output is that sum, so it serves losses that are a weighted
sum of per-token losses (the trainer's per-token loss: mask weights, the global token count applied later).

Under tensor parallelism each rank holds a vocabulary shard of the output weight: each chunk's cross entropy
is megatron-core's vocab-parallel one (its own helpers: the unfused ones, or its compiled fused ones for bf16
on a GPU), and the hidden-state gradient is this shard's partial sum, which megatron's mappings reduce as
its output layer does (:class:`ChunkedLMLossProcessor`: all-reduce, or reduce-scatter with sequence
parallelism).

:func:`reference_lm_loss` is the plain PyTorch definition (whole logits, ``F.cross_entropy``) the chunked
loss is tested against, with megatron-core's own whole-logit loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 4096


def reference_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      loss_mask: Optional[torch.Tensor] = None, logit_scale: float = 1.0) -> torch.Tensor:
    """``sum(loss_mask * cross_entropy(logit_scale * hidden @ weight.T, labels))`` with the whole logits, as
    an fp32 scalar. ``hidden [N, h]``, ``weight [V, h]`` (the whole vocabulary), ``labels [N]`` (ids in
    ``[0, V)``), ``loss_mask [N]`` (None: every token weighs 1)."""
    logits = (hidden @ weight.t()) * logit_scale
    losses = F.cross_entropy(logits.float(), labels.long(), reduction="none")
    return losses.sum() if loss_mask is None else (losses * loss_mask.float()).sum()


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _chunk_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, grad_scale: torch.Tensor,
                         logit_scale: float, vocab_start: int, group, fused: bool, want_grad: bool):
    """One chunk: ``(loss [C] fp32, logit gradient [C, V/tp] in the weight's dtype or None)``.

    The logits ``x @ weight.T * logit_scale`` live only in here (the bf16 copy is dropped as soon as the fp32
    one exists). megatron-core's vocab-parallel cross entropy, step by step: the fused helpers are its
    compiled ones (bf16 only: their gradient is bf16), the others its plain ones. ``grad_scale [C]``: the
    weight of each token's loss (mask x logit scale), by which the gradient is multiplied."""
    logits = torch.matmul(x, weight.t())
    if logit_scale != 1.0:
        logits = logits * logit_scale  # in the weight's dtype, as megatron-core's _scale_logits
    vocab_end = vocab_start + logits.shape[-1]
    if fused:
        from megatron.core.fusions import fused_cross_entropy as fce

        logits32, logits_max = fce.calculate_logits_max(logits)
        del logits
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        target_mask, masked_target_1d, predicted_and_sum, exp_logits = fce.calculate_predicted_logits(
            logits32, target, logits_max, vocab_start, vocab_end)
        del logits32
        _all_reduce(predicted_and_sum, dist.ReduceOp.SUM, group)
        exp_logits, loss = fce.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
        if not want_grad:
            return loss, None
        return loss, fce.calculate_gradients(exp_logits, grad_scale, target_mask, masked_target_1d)

    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as vpce

    dtype = logits.dtype
    logits32, logits_max = vpce.calculate_logits_max(logits)  # fp32 copy (the same tensor when fp32)
    del logits
    _all_reduce(logits_max, dist.ReduceOp.MAX, group)
    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = vpce.calculate_predicted_logits(
        logits32, target, logits_max, vocab_start, vocab_end)
    del logits32
    if group is not None and dist.get_world_size(group) > 1:  # one all-reduce for both
        both = torch.cat((predicted, sum_exp))
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        predicted, sum_exp = both.split(predicted.numel())
    exp_logits, loss = vpce.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    if not want_grad:
        return loss, None
    grad_2d, arange_1d, softmax_update, grad = vpce.prepare_gradient_calculation_operands(exp_logits, target_mask)
    grad = vpce.calculate_gradients(grad_2d, arange_1d, masked_target_1d, softmax_update, grad, grad_scale)
    return loss, grad.to(dtype)


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
    """``acc [V/tp, h] (fp32) += grad_logits[C, V/tp]^T @ x[C, h]``: on a GPU a 16-bit GEMM with an fp32
    output that adds into ``acc`` itself (no 16-bit product); elsewhere the product, then the sum."""
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), x)
    elif acc.is_cuda:
        torch.addmm(acc, grad_logits.t(), x, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(grad_logits.t() @ x)


class _ChunkedLMLoss(torch.autograd.Function):
    """Forward: the loss sum and, chunk by chunk, its gradients; backward: those gradients x the incoming
    gradient. Runs one backward (the stored gradients are scaled in place)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, chunk_tokens: int, logit_scale: float, group,
                fused: bool, want_grad: bool, main_grad: bool):
        n = hidden.shape[0]
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        vocab_start = rank * weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad else None
        grad_scale = token_weights * logit_scale if logit_scale != 1.0 else token_weights
        for s in range(0, n, chunk_tokens):
            e = min(n, s + chunk_tokens)
            x = hidden[s:e]
            loss, grad_logits = _chunk_cross_entropy(x, weight, labels[s:e], grad_scale[s:e], logit_scale,
                                                     vocab_start, group, fused, want_grad)
            total += (loss * token_weights[s:e]).sum()
            if want_grad:
                torch.matmul(grad_logits, weight, out=grad_hidden[s:e])
                _accumulate_weight_grad(grad_weight, grad_logits, x)
            del loss, grad_logits
        ctx.param = weight if main_grad else None
        ctx.dtype = weight.dtype
        ctx.done = False
        if want_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.done:
            raise RuntimeError("the chunked loss runs one backward (its stored gradients are scaled in place)")
        ctx.done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden.mul_(grad_total)
        grad_weight = grad_weight.mul_(grad_total)
        param = ctx.param
        if param is not None and getattr(param, "main_grad", None) is not None:
            # megatron-core's gradient accumulation fusion: add into the fp32 main gradient directly and hand
            # autograd a placeholder (zeros where the weight is also the embedding's: its gradient adds to it)
            param.main_grad.add_(grad_weight)
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
                make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
                wgrad = make(param.shape, dtype=ctx.dtype, device=param.device)
            else:
                wgrad = None
        else:
            wgrad = grad_weight.to(ctx.dtype)
        return grad_hidden, wgrad, None, None, None, None, None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    loss_mask: Optional[torch.Tensor] = None, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    logit_scale: float = 1.0, group=None, fused: bool = False,
                    accumulate_main_grad: bool = False) -> torch.Tensor:
    """``sum(loss_mask * cross_entropy(logit_scale * hidden @ weight.T, labels))`` as an fp32 scalar, without
    the whole logits (module docstring).

    ``hidden [N, h]`` and ``weight [V/tp, h]`` (this rank's vocabulary shard, rank-ordered as megatron's
    ``VocabUtility``) in one dtype; ``labels [N]`` ids of the whole vocabulary; ``loss_mask [N]`` (None: 1).
    ``group``: the vocab-parallel (TP) group (None or size 1: ``weight`` is the whole vocabulary); the
    hidden-state gradient is this shard's partial sum, for the caller to reduce over ``group``.
    ``chunk_tokens``: tokens per chunk (peak: about ``chunk_tokens x V/tp x 10`` bytes in bf16).
    ``fused``: megatron-core's compiled cross-entropy helpers per chunk (bf16 only).
    ``accumulate_main_grad``: the weight gradient goes into ``weight.main_grad`` (megatron-core's
    ``gradient_accumulation_fusion``) where the weight has one. Gradients are computed in the forward only
    when autograd records it (grad mode on, ``hidden`` or ``weight`` requiring a gradient)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: need [N, h] and [V, h]")
    if fused and weight.dtype != torch.bfloat16:
        raise ValueError(f"fused=True needs bf16 (megatron-core's fused cross entropy writes bf16 gradients), "
                         f"got {weight.dtype}")
    n = hidden.shape[0]
    labels = labels.reshape(n)
    token_weights = (torch.ones(n, dtype=torch.float32, device=hidden.device) if loss_mask is None
                     else loss_mask.reshape(n).float())
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLMLoss.apply(hidden, weight, labels, token_weights, int(chunk_tokens), float(logit_scale), group,
                                fused, want_grad, accumulate_main_grad)


class ChunkedLMLossProcessor:
    """megatron-core ``GPTModel``'s ``output_processor`` (its forward's hook for what follows the decoder on
    the last stage): the model returns :func:`chunked_lm_loss`'s masked loss sum (fp32 scalar) instead of
    per-token losses. Call the model with ``labels`` and ``loss_mask [b, s]``.

    The output layer's settings are megatron's: its TP group and weight (the embedding's when tied),
    sequence parallelism (the hidden states are gathered over the TP group, their gradient reduce-scattered)
    or a TP copy (gradient all-reduced), muP's logit multiplier and ``gradient_accumulation_fusion``.
    ``fused``: megatron-core's compiled cross-entropy helpers per chunk where the weight is bf16."""

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, fused: bool = False) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.chunk_tokens, self.fused = int(chunk_tokens), fused

    def __call__(self, *, hidden_states: torch.Tensor, output_layer, output_weight, labels, loss_mask, config,
                 **unused) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        if labels is None:
            raise ValueError("the chunked loss needs labels; call the model without output_processor for logits")
        weight = output_weight if output_weight is not None else output_layer.weight
        group = output_layer.tp_group
        if group.size() > 1:
            if output_layer.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward: reduce-scatter
                hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True,
                                                                     group=group)
            else:  # backward: all-reduce of the shards' partial sums
                hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=group)
        h = hidden_states.shape[-1]
        # [s, b, h] against labels / mask [b, s]: token order s-major
        tokens = labels.transpose(0, 1).reshape(-1)
        mask = None if loss_mask is None else loss_mask.transpose(0, 1).reshape(-1)
        scale = config.mup_output_mult if config.use_mup else 1.0
        fused = self.fused and weight.dtype == torch.bfloat16
        return chunked_lm_loss(hidden_states.reshape(-1, h), weight, tokens, mask, chunk_tokens=self.chunk_tokens,
                               logit_scale=scale, group=group, fused=fused,
                               accumulate_main_grad=bool(output_layer.gradient_accumulation_fusion))
