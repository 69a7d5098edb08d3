"""runtime.megatron_cpu's shim is reversible: a process that trains in-process (a test runner) gets its torch back."""

import pytest
import torch

from runtime import megatron_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only machines")
def test_remove_cpu_shim_restores_what_apply_patched():
    import megatron.core.fusions.fused_softmax as fused_softmax

    # An earlier in-process test of this worker may have left the shim on: start from torch as shipped
    # and leave the worker as it was found.
    was_applied = megatron_cpu._APPLIED
    megatron_cpu.remove_cpu_shim()
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
              fused_softmax.get_default_causal_mask)
    assert megatron_cpu.apply_cpu_shim()
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device="cuda").device.type == "cpu"  # rewritten by the function mode
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    finally:
        megatron_cpu.remove_cpu_shim()
    after = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
             fused_softmax.get_default_causal_mask)
    assert after == before
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")  # no CUDA here: the real error again
    megatron_cpu.remove_cpu_shim()  # a second call is a no-op
    assert megatron_cpu.apply_cpu_shim()  # and the shim applies again
    if not was_applied:
        megatron_cpu.remove_cpu_shim()
