"""Fused value-gated eviction score (``nosa_layers/ops/gated_score.py``) against the reference
(``nosa_layers.eviction.value_gated_score``) on ``dev``: the score and the gradients of v, W, b and
A, fp32 against fp64 and bf16 against the reference on the same inputs; odd lengths, 1-16 KV heads,
strided values, softplus far in both tails, determinism, the fallback and the heads that use it."""

import pytest
import torch

from nosa_layers.eviction import build_eviction_head, value_gated_score


def _fused(*args):
    from nosa_layers.ops.gated_score import fused_gated_score

    return fused_gated_score(*args)


def _inputs(B, T, H, D, dtype, seed, device, bias=True, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(B, T, H, D, generator=g) * spread).to(device, dtype)
    w = (torch.randn(H, H * D, generator=g) / (H * D) ** 0.5).to(device, dtype)
    b = (torch.randn(H, generator=g)).to(device, dtype) if bias else None
    a = (torch.randn(H, generator=g)).to(device, dtype)
    gs = torch.randn(B, T, H, generator=g).to(device)
    return v, w, b, a, gs


def _score64(v, w, b, a):
    """The reference formula in fp64 (``value_gated_score`` computes in fp32)."""
    z = torch.nn.functional.linear(v.flatten(-2).double(), w.double(), None if b is None else b.double())
    return a.double() * torch.nn.functional.softplus(z)


def _run(fn, v, w, b, a, gs):
    """Score and the gradients of (v, w, b, a) of ``sum(score * gs)``."""
    leaves = [x.detach().requires_grad_() for x in (v, w, b, a) if x is not None]
    args = list(leaves)
    if b is None:
        args.insert(2, None)
    s = fn(*args)
    grads = torch.autograd.grad(s, leaves, gs.to(s.dtype))
    return s.detach(), grads


@pytest.mark.parametrize("B,T,H,D,bias,seed", [(1, 100, 2, 64, False, 0), (2, 37, 3, 32, True, 1),
                                                (1, 129, 1, 16, True, 2), (1, 70, 8, 16, False, 3),
                                                (1, 65, 4, 128, True, 4), (1, 33, 16, 32, True, 13),
                                                (2, 45, 2, 256, False, 14)])
def test_fp32_matches_the_reference_in_fp64(dev, B, T, H, D, bias, seed):
    v, w, b, a, gs = _inputs(B, T, H, D, torch.float32, seed, dev, bias)
    s, grads = _run(_fused, v, w, b, a, gs)
    s64, grads64 = _run(_score64, *(None if x is None else x.double() for x in (v, w, b, a)), gs.double())
    assert s.dtype == torch.float32 and s.shape == (B, T, H)
    for got, ref in ((s, s64), *zip(grads, grads64)):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_bf16_inputs_give_the_reference_up_to_fp32_rounding(dev):
    v, w, b, a, gs = _inputs(1, 90, 2, 128, torch.bfloat16, 5, dev)
    s, (dv, dw, db, da) = _run(_fused, v, w, b, a, gs)
    sr, (dvr, dwr, dbr, dar) = _run(value_gated_score, v, w, b, a, gs)
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=1e-5 * sr.abs().max().item())
    for got, ref in ((dv, dvr), (dw, dwr), (db, dbr), (da, dar)):
        assert got.dtype == torch.bfloat16
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().max().item()
        assert (got.float() - ref.float()).abs().max().item() <= 2 * ulp


def test_softplus_tails_keep_their_relative_precision(dev):
    """z far below zero (score ~ exp(z), what ranks blocks of low score) and above the threshold 20."""
    D = 16
    z = torch.tensor([-60.0, -30.0, -17.0, -1e-3, 0.0, 3e-8, 5.0, 19.9, 20.1, 45.0])
    v = torch.zeros(1, z.numel(), 1, D)
    v[0, :, 0, 0] = z
    w = torch.zeros(1, D)
    w[0, 0] = 1.0
    a = torch.tensor([1.0])
    v, w, a = v.to(dev), w.to(dev), a.to(dev)
    s = _fused(v, w, None, a).double().cpu()
    ref = _score64(v, w, None, a).cpu()
    torch.testing.assert_close(s, ref, rtol=4e-7, atol=0)


def test_strided_values_and_expanded_gradients(dev):
    """Values as megatron hands them ([s, b, h, D] transposed to [b, s, h, D]) and a broadcast gradient."""
    v, w, b, a, _ = _inputs(3, 41, 2, 32, torch.float32, 6, dev)
    v = v.transpose(0, 1).contiguous().transpose(0, 1)
    gs = torch.randn(1, 1, 2, device=dev).expand(3, 41, 2)
    s, grads = _run(_fused, v, w, b, a, gs)
    sr, gr = _run(value_gated_score, v, w, b, a, gs.contiguous())
    assert grads[0].stride() == v.stride()
    for got, ref in ((s, sr), *zip(grads, gr)):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_backward_is_deterministic_and_skips_dv_for_detached_values(dev):
    v, w, b, a, gs = _inputs(1, 300, 2, 64, torch.float32, 7, dev)
    first = _run(_fused, v, w, b, a, gs)[1]
    second = _run(_fused, v, w, b, a, gs)[1]
    for x, y in zip(first, second):
        assert torch.equal(x, y)
    w_, a_ = w.detach().requires_grad_(), a.detach().requires_grad_()
    s = _fused(v.detach(), w_, None, a_)
    dw, da = torch.autograd.grad(s, (w_, a_), gs)
    dwr, dar = torch.autograd.grad(value_gated_score(v.detach(), w_, None, a_), (w_, a_), gs)
    torch.testing.assert_close(dw, dwr, rtol=2e-5, atol=2e-5 * dwr.abs().max().item())
    torch.testing.assert_close(da, dar, rtol=2e-5, atol=2e-5 * dar.abs().max().item())


def test_empty_rows_and_the_reference_fallback(dev):
    v, w, b, a, gs = _inputs(1, 0, 2, 32, torch.float32, 8, dev)
    s, (dv, dw, db, da) = _run(_fused, v, w, b, a, gs)
    assert s.shape == (1, 0, 2) and dv.shape == v.shape
    assert not dw.any() and not db.any() and not da.any()
    v, w, b, a, gs = _inputs(1, 20, 2, 48, torch.float32, 9, dev)  # D = 48: not a power of two
    assert torch.equal(_fused(v, w, b, a), value_gated_score(v, w, b, a))


def test_bad_parameter_shapes_raise(dev):
    v, w, b, a, _ = _inputs(1, 8, 2, 32, torch.float32, 10, dev)
    with pytest.raises(ValueError, match="do not fit v"):
        _fused(v, w[:, :32], b, a)
    with pytest.raises(ValueError, match="do not fit v"):
        _fused(v, w, b, a[:1])


@pytest.mark.parametrize("name", ["ed_dma", "dma", "s_dma"])
def test_heads_with_the_fused_score_match_the_reference_heads(dev, name):
    """The head's ``score_op`` constructor argument (the layer spec's ``train.fusions``) changes its score op only."""
    from nosa_layers.ops.gated_score import fused_gated_score

    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, bias=True, detach_value=False)
    fused, plain = build_eviction_head(name, **kw, score_op=fused_gated_score), build_eviction_head(name, **kw)
    assert fused.score_op is fused_gated_score and plain.score_op is value_gated_score
    plain.load_state_dict(fused.state_dict())
    torch.manual_seed(11)
    with torch.no_grad():
        for h in (fused, plain):
            h.A.copy_(torch.tensor([0.7, -0.4]))
    fused.to(dev), plain.to(dev)
    v = torch.randn(1, 50, 2, 32, device=dev)
    q, k = torch.randn(1, 50, 4, 32, device=dev), torch.randn(1, 50, 2, 32, device=dev)
    outs = []
    for h in (fused, plain):
        ev = h(q, k, v.requires_grad_())
        (ev.bias * torch.linspace(-1, 1, 100, device=dev).view(1, 50, 2)).sum().backward()
        outs.append((ev.score.detach(), v.grad.clone(), h.delta.weight.grad.clone(), h.A.grad.clone()))
        v.grad = None
    for got, ref in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    assert set(fused.state_dict()) == set(build_eviction_head(name, num_q_heads=4, num_kv_heads=2,
                                                              head_dim=32, bias=True).state_dict())


def test_a_view_of_the_fused_qkv_buffer_is_saved_as_a_compact_copy(dev):
    """v sliced from megatron's ``[b, s, 3 * Hkv, D]`` projection: the backward keeps Hkv heads of
    values, not the whole projection, and its gradients are those of the reference."""
    _, w, b, a, gs = _inputs(2, 45, 2, 32, torch.float32, 12, dev)
    qkv = torch.randn(2, 45, 6, 32, device=dev, dtype=torch.bfloat16)
    v = qkv[:, :, 4:].detach().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s = _fused(v, w, b, a)
    assert max(saved) <= max(v.numel() * v.element_size(), s.numel() * 4)
    dv, = torch.autograd.grad(s, v, gs)
    dvr, = torch.autograd.grad(value_gated_score(v, w, b, a), v, gs)
    torch.testing.assert_close(dv.float(), dvr.float(), rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps
                               * dvr.float().abs().max().item())
