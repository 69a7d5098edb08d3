"""One micro-batch as megatron-core's schedules see it: the loader's batch moved to the device as model
inputs (``to_microbatch``), and the forward step and loss function the schedules call (``forward_step``).

Packed batches become one THD row with flat ``cu_seqlens`` (positions and ``max_seqlen`` travel with it in
megatron-core's ``PackedSeqParams``); with context parallelism each rank keeps its chunks of the row
(``train.context_parallel``). The loss is a per-token sum and count, so megatron-core's
``calculate_per_token_loss`` divides by the tokens of the whole global batch. With an ``output_processor``
(``train.loss_impl=chunked``: ``nosa_layers.megatron.lm_loss.ChunkedLMLossProcessor``) the model returns that
masked sum itself, computed without the whole logits; otherwise it returns per-token losses and the loss
function applies the mask.
"""

from __future__ import annotations

from functools import partial

import torch

from train.context_parallel import split_microbatch


def to_microbatch(batch: dict, device: torch.device, cp: tuple[int, int] = (1, 0)) -> dict:
    """Loader batch -> model inputs. Packed batches become one THD row with flat cu_seqlens. ``cp``:
    ``(size, rank)`` of the context-parallel group: this rank keeps its chunks (``train.context_parallel``).

    On a GPU every tensor goes through pinned memory: a copy from pageable memory (beyond a few KiB, e.g.
    a 16K-token row) waits for the GPU's whole queue (the previous step's backward and update), a copy
    from pinned memory does not."""
    def to_device(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

    out = {k: to_device(batch[k]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    if "cu_seqlens" in batch:
        from data.packing import flat_cu_seqlens

        out = {k: v.reshape(1, -1) for k, v in out.items()}
        cu = flat_cu_seqlens(batch)
        out["cu_seqlens"] = to_device(cu)
        _hand_over_cu_seqlens(out["cu_seqlens"], cu.tolist())
        out["max_seqlen"] = int(batch["max_seqlen"])
    return split_microbatch(out, *cp)


def _hand_over_cu_seqlens(device_cu: torch.Tensor, values: list) -> None:
    """Give the NOSA kernels' block table the host values of ``cu_seqlens`` (then the layers never read
    it back from the GPU); without Triton there are no kernels and nothing to hand over."""
    try:
        from nosa_layers.ops.layout import remember_host_values
    except ImportError:
        return
    remember_host_values(device_cu, values)


def forward_step(data_iterator, model, output_processor=None):
    """megatron-core forward step: returns the model's loss output and the loss function. ``output_processor``
    (bind it with ``functools.partial``): megatron-core ``GPTModel``'s hook after the decoder, given the loss
    mask; the model then returns the masked loss sum (an fp32 scalar) instead of per-token losses."""
    from megatron.core.packed_seq_params import PackedSeqParams

    mb = next(data_iterator)
    psp = None
    if "cu_seqlens" in mb:
        cu = mb["cu_seqlens"]
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"])
    with torch.profiler.record_function("train.forward_first" if mb.get("first") else "train.forward"):
        if output_processor is None:
            output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"], packed_seq_params=psp)
        else:
            output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"], packed_seq_params=psp,
                           loss_mask=mb["loss_mask"], output_processor=output_processor)
    return output, partial(_loss_func, mb["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``(loss sum, tokens, logged [sum, tokens])`` of a micro-batch from the model's output: per-token losses
    ``[b, s]`` (masked and summed here) or the masked sum itself (a scalar, from an output processor)."""
    mask = loss_mask.reshape(-1).float()
    if output_tensor.dim() == 0:
        loss_sum = output_tensor.float()
    else:
        loss_sum = (output_tensor.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}
