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
