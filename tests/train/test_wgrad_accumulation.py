"""``runtime.megatron_compat.provide_gradient_accumulation_fusion``: megatron-core's linear layers add each
weight gradient into ``main_grad`` inside the GEMM through the torch stand-in for Apex's kernel."""

import pytest
import torch

from runtime.megatron_compat import TorchWgradAccumulation, provide_gradient_accumulation_fusion

layers = pytest.importorskip("megatron.core.tensor_parallel.layers")


def test_the_stand_in_is_given_once_and_apex_is_left_alone(monkeypatch):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    assert provide_gradient_accumulation_fusion() and provide_gradient_accumulation_fusion()
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda is TorchWgradAccumulation
    apex = object()  # an installed Apex kernel: megatron-core imported it, nothing to provide
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex)
    assert not provide_gradient_accumulation_fusion()
    assert layers.fused_weight_gradient_mlp_cuda is apex


def _case(device, main_dtype, seed, tokens=37, d_in=24, d_out=40):
    """Inputs of a linear layer and a ``main_grad`` that is a view into a larger gradient buffer (as megatron's
    DDP makes it), already holding an earlier micro-batch's gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g).to(device, torch.bfloat16)
    w = torch.randn(d_out, d_in, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(tokens, d_out, generator=g).to(device, torch.bfloat16)
    buffer = torch.randn(d_out * d_in + 29, generator=g).to(device, main_dtype)
    return x, w, dy, buffer, buffer[13:13 + d_out * d_in].view(d_out, d_in)


def _through_megatron(x, w, dy, main_grad):
    """megatron-core's linear autograd function with gradient_accumulation_fusion=True: ``(dx, w.grad)``."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    w.main_grad = main_grad
    y = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(x, w, None, True, False, False, None, 0, None, 1)
    y.backward(dy)
    return x.grad, w.grad


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_main_grads_accumulate_in_place_through_megatron(monkeypatch, seed):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    provide_gradient_accumulation_fusion()
    x, w, dy, buffer, main_grad = _case("cpu", torch.bfloat16, seed)
    before = buffer.clone()
    dx, wgrad = _through_megatron(x, w, dy, main_grad)
    assert wgrad is None  # the gradient went into main_grad, nothing for autograd to accumulate
    want = before[13:13 + main_grad.numel()].view_as(main_grad).double() + dy.double().t() @ x.double()
    torch.testing.assert_close(main_grad.double(), want, rtol=2e-2, atol=0.25)  # bf16 accumulator
    assert torch.equal(buffer[:13], before[:13]) and torch.equal(buffer[13 + main_grad.numel():],
                                                                 before[13 + main_grad.numel():])
    torch.testing.assert_close(dx.double(), dy.double() @ w.double(), rtol=2e-2, atol=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fp32-output GEMM)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp32_main_grads_accumulate_in_the_gemm_on_the_gpu(monkeypatch, seed):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    provide_gradient_accumulation_fusion()
    x, w, dy, buffer, main_grad = _case("cuda", torch.float32, seed, tokens=1000 + seed, d_in=136, d_out=72)
    before = buffer.clone()
    ptr = main_grad.data_ptr()
    for _ in range(2):  # two micro-batches
        dx, wgrad = _through_megatron(x, w, dy, main_grad)
    assert wgrad is None and main_grad.data_ptr() == ptr
    want = before[13:13 + main_grad.numel()].view_as(main_grad).double() + 2 * (dy.double().t() @ x.double())
    # fp32 accumulation of bf16 products: far tighter than a bf16-rounded gradient added afterwards
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-5, atol=1e-3)
    rounded = before[13:13 + main_grad.numel()].view_as(main_grad) + 2 * (dy.t() @ x).float()
    assert (main_grad.double() - want).abs().max() < (rounded.double() - want).abs().max()
    assert torch.equal(buffer[:13], before[:13]) and torch.equal(buffer[13 + main_grad.numel():],
                                                                 before[13 + main_grad.numel():])
