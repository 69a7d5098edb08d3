"""Fused RMSNorm kernel (``nosa_layers/ops/rms_norm.py``) against the reference formula
(``nosa_layers.megatron.norm.rms_norm_reference``) on ``dev``: outputs, dx and dw, fp32 and bf16,
odd hidden sizes, strided inputs, empty batches."""

import pytest
import torch

from nosa_layers.megatron.norm import RMSNorm, rms_norm_reference


def _inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 4).to(device, dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, w, dy


def _grads(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, 1e-5)
    dx, dw = torch.autograd.grad(y, (x, w), dy.to(y.dtype))
    return y.detach(), dx, dw


def _fused(x, w, eps):
    from nosa_layers.ops.rms_norm import fused_rms_norm

    return fused_rms_norm(x, w, eps)


@pytest.mark.parametrize("shape,seed", [((7, 48), 0), ((3, 5, 100), 1), ((1, 1, 64), 2), ((33, 2, 96), 3)])
def test_fp32_matches_the_reference_in_fp64(dev, shape, seed):
    x, w, dy = _inputs(shape, torch.float32, seed, dev)
    y, dx, dw = _grads(_fused, x, w, dy)
    yr, dxr, dwr = _grads(rms_norm_reference, x.double(), w.double(), dy.double())
    tol = 1e-5 if dev.type == "cpu" else 1e-4
    for got, ref in ((y, yr), (dx, dxr), (dw, dwr)):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("shape,seed", [((9, 2, 80), 4), ((16, 128), 5)])
def test_bf16_output_is_the_reference_up_to_one_rounding(dev, shape, seed):
    x, w, dy = _inputs(shape, torch.bfloat16, seed, dev)
    y, dx, dw = _grads(_fused, x, w, dy)
    yr = rms_norm_reference(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    # the statistics are summed in another order, so the normalised value may round to the
    # neighbouring bf16 and the product with w round the other way: two steps compiled; the
    # interpreter rounds its two bf16 casts toward zero, which may add one more
    ulps = 2 if dev.type == "cuda" else 3
    ulp = torch.finfo(torch.bfloat16).eps * yr.float().abs().clamp_min(1e-30)
    assert ((y.float() - yr.float()).abs() <= ulps * ulp).all()
    if dev.type == "cuda":
        assert (y == yr).float().mean() > 0.9
    _, dx64, dw64 = _grads(rms_norm_reference, x.double(), w.double(), dy.double())
    _, dx16, dw16 = _grads(rms_norm_reference, x, w, dy)
    for got, ref16, ref in ((dx, dx16, dx64), (dw, dw16, dw64)):
        assert got.dtype == torch.bfloat16
        err, err16 = (got.double() - ref).abs().max(), (ref16.double() - ref).abs().max()
        assert err <= 1.5 * err16 + 1e-2 * ref.abs().max(), (err, err16)


def test_strided_input_and_empty_batch(dev):
    x, w, dy = _inputs((6, 4, 40), torch.float32, 6, dev)
    xt, dyt = x.transpose(0, 1), dy.transpose(0, 1)  # [4, 6, 40], rows not in memory order
    y, dx, dw = _grads(_fused, xt, w, dyt)
    yr, dxr, dwr = _grads(rms_norm_reference, xt, w, dyt)
    tol = 1e-5 if dev.type == "cpu" else 1e-4
    for got, ref in ((y, yr), (dx, dxr), (dw, dwr)):
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    empty = torch.empty(0, 3, 40, device=dev, requires_grad=True)
    wq = w.detach().requires_grad_()
    out = _fused(empty, wq, 1e-5)
    assert out.shape == (0, 3, 40)
    out.sum().backward()
    assert empty.grad.shape == empty.shape and torch.equal(wq.grad, torch.zeros_like(w))


def test_a_weight_of_the_wrong_size_is_a_clear_error(dev):
    x, w, _ = _inputs((4, 32), torch.float32, 7, dev)
    with pytest.raises(ValueError, match="does not match"):
        _fused(x, w[:16], 1e-5)


def test_the_module_fuses_where_the_kernels_run(dev, monkeypatch):
    """``fused=True`` takes the kernel on CUDA and under the interpreter (tests), and the reference
    formula, bit for bit, on a CPU without it."""
    from nosa_layers.ops import rms_norm

    class Cfg:
        normalization, params_dtype, sequence_parallel = "RMSNorm", torch.float32, False

    fused, plain = RMSNorm(Cfg(), 48, fused=True).to(dev), RMSNorm(Cfg(), 48).to(dev)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5)
        plain.weight.copy_(fused.weight)
    x = torch.randn(5, 48, device=dev)
    calls = []
    kernel = rms_norm.fused_rms_norm
    monkeypatch.setattr(rms_norm, "fused_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-4)
    assert calls == [1]
    if dev.type == "cpu":  # without the interpreter the CPU takes the reference formula
        monkeypatch.delenv("TRITON_INTERPRET")
        assert torch.equal(fused(x), plain(x)) and calls == [1]


def test_training_shape_bf16(cuda):
    x, w, dy = _inputs((4096, 2, 2048), torch.bfloat16, 8, cuda)
    y, dx, dw = _grads(_fused, x, w, dy)
    yr, dx16, dw16 = _grads(rms_norm_reference, x, w, dy)
    ulp = torch.finfo(torch.bfloat16).eps * yr.float().abs().clamp_min(1e-30)
    assert ((y.float() - yr.float()).abs() <= 2 * ulp).all() and (y == yr).float().mean() > 0.9
    _, dx64, dw64 = _grads(rms_norm_reference, x.double(), w.double(), dy.double())
    assert (dx.double() - dx64).abs().max() <= 1.5 * (dx16.double() - dx64).abs().max()
    assert (dw.double() - dw64).abs().max() <= 1.5 * (dw16.double() - dw64).abs().max()
