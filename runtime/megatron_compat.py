"""Narrow fixes for megatron-core behaviour we depend on, each applied only where it is needed.

* megatron-core 0.19.2, distributed optimizer, ``fully_reshardable`` checkpoints, torch Adam(W)
  (no Apex / Transformer Engine): loading copies every tensor of the optimizer state from the
  checkpoint, but torch keeps ``step`` as a tensor state that the checkpoint stores separately,
  so ``_set_main_param_and_optimizer_states`` raises ``KeyError: 'step'``. The patch supplies the
  already-restored ``step`` for that copy. Fused optimizers (Apex/TE) have no such state and are
  untouched.
* Same setting: the loader gives every parameter state the SAME ``step`` tensor object, which
  torch's foreach Adam then increments once per parameter per step (wrong bias correction
  after a resume). :func:`untie_adam_step_tensors` gives each state its own copy.
* megatron-core 0.19.2 without Transformer Engine or Apex: the gradient clipping falls back to
  ``megatron.core.utils.local_multi_tensor_l2_norm``, which reads every gradient's norm back to the
  host one by one (``torch.tensor([norm, ...])`` of device scalars: one host sync per parameter
  tensor, 227 per step for a 28-layer NOSA model, each draining the GPU's queue), and to
  ``local_multi_tensor_scale``, two kernel launches per tensor. :func:`use_sync_free_multi_tensor_ops`
  puts in the same operations as a few ``torch._foreach_*`` calls with no host read; the one read of
  the total norm that megatron makes after its all-reduce stays.
* megatron-core 0.19.2 without Apex: ``gradient_accumulation_fusion`` (each weight gradient GEMM adds
  its product into the fp32 ``main_grad`` in place, Megatron-LM's default) needs Apex's
  ``fused_weight_gradient_mlp_cuda``; without it every linear layer's weight gradient is written in
  bf16 and then added to ``main_grad`` by a separate fp32 kernel (one per weight per micro-batch).
  :func:`provide_gradient_accumulation_fusion` gives megatron-core the same two functions built on
  torch's own GEMM with an fp32 output (``torch.addmm(..., out_dtype=torch.float32)``, CUDA).
"""

from __future__ import annotations

import torch

_PATCHED = False


def patch_distributed_optimizer_step_state() -> None:
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer import distrib_optimizer as do

    if getattr(do, "HAVE_APEX_OR_TE", True):
        return
    original = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    do.DistributedOptimizer._set_main_param_and_optimizer_states = _set_states
    _PATCHED = True


def untie_adam_step_tensors(optimizer) -> None:
    """Give every torch Adam(W) parameter state its own ``step`` tensor (after loading)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].detach().clone()


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron-core's ``local_multi_tensor_l2_norm`` (``amp_C.multi_tensor_l2norm``'s
    signature): the L2 norm over every tensor of ``tensor_lists[0]`` as ``[1]`` fp32 on their device
    and ``None`` (no per-tensor norms), without reading anything back to the host."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron-core's ``local_multi_tensor_scale``: ``dst.copy_(src * scale)`` for every
    pair of ``tensor_lists = [src, dst]``, as one in-place multiply where ``dst`` is ``src`` (gradient
    clipping) or a copy where ``scale`` is 1."""
    src, dst = tensor_lists
    if not dst:
        return
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_sync_free_multi_tensor_ops() -> bool:
    """Replace megatron-core's local (no TE / Apex) multi-tensor L2 norm and scale with
    :func:`multi_tensor_l2_norm` / :func:`multi_tensor_scale` wherever it uses them. Idempotent;
    returns whether megatron-core was on its local fallback (TE's or Apex's kernels are left alone)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale
    return clip_grads.l2_norm_impl is multi_tensor_l2_norm


class TorchWgradAccumulation:
    """Apex's ``fused_weight_gradient_mlp_cuda`` interface on torch GEMMs (CUDA):
    ``main_grad [out, in] += grad_output[tokens, out]^T @ total_input[tokens, in]``, accumulated by the
    GEMM itself (its epilogue reads and writes ``main_grad``; no bf16 product, no separate add)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def provide_gradient_accumulation_fusion() -> bool:
    """Let megatron-core's linear layers take ``gradient_accumulation_fusion=True`` without Apex: where its
    import of ``fused_weight_gradient_mlp_cuda`` failed, hand it :class:`TorchWgradAccumulation` (Apex's own
    kernel, when installed, is left alone). Idempotent; returns whether the stand-in is in use. Needs
    CUDA (the fp32-output GEMM) and megatron-core's DDP (``main_grad`` on every weight)."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
        layers._grad_accum_fusion_available = True
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is TorchWgradAccumulation
