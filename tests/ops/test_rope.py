"""Fused RoPE kernel (``nosa_layers/ops/rope.py``) against its reference and megatron-core's unfused
``_apply_rotary_pos_emb_bshd``: outputs and input gradients, bshd (positions = rows) and packed
(per-token positions), strided inputs, LongRoPE's attention factor, odd head counts."""

import pytest
import torch

from nosa_layers.ops.rope import fused_rope, rope_reference, rope_tables


def _case(S, B, H, D, dtype, seed, device, mscale=1.0, P=None):
    g = torch.Generator().manual_seed(seed)
    P = P or S
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.arange(P, dtype=torch.float64) * (1 + torch.rand(1, generator=g).item()), inv).float()
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]
    cos, sin = rope_tables(freqs.to(device), mscale, dtype)
    x = (torch.randn(S, B, H, D, generator=g) * 3).to(device, dtype)
    dy = torch.randn(S, B, H, D, generator=g).to(device, dtype)
    return freqs.to(device), cos, sin, x, dy


def _run(fn, x, dy, *args):
    x = x.detach().requires_grad_()
    y = fn(x, *args)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


def _terms(x, cos, sin, positions=None):
    """``|x| |cos| + |x rotated| |sin|`` per element (fp32): the size of the two rounded products."""
    c = (cos[:x.shape[0]] if positions is None else cos[positions]).float().abs()[:, None, None, :]
    s = (sin[:x.shape[0]] if positions is None else sin[positions]).float().abs()[:, None, None, :]
    x1, x2 = torch.chunk(x.float().abs(), 2, dim=-1)
    return x.float().abs() * c + torch.cat((x2, x1), dim=-1) * s


def _assert_same(got, ref, dev, terms):
    """Bitwise on a GPU and for fp16 / fp32 under the interpreter; bf16 under the interpreter within one
    step of each of its three roundings (its casts to bf16 truncate), relative to the products' size
    ``terms`` (``_terms``)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dev.type == "cuda" and got.dtype == torch.float32:  # the compiler may fuse a multiply-add
        eps = torch.finfo(torch.float32).eps
    elif dev.type == "cuda" or got.dtype != torch.bfloat16:
        assert torch.equal(got, ref)
        return
    else:
        eps = torch.finfo(torch.bfloat16).eps * 2
    assert ((got.float() - ref.float()).abs() <= eps * (terms + ref.float().abs())).all()


def test_the_reference_is_megatrons_unfused_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    freqs, cos, sin, x, dy = _case(37, 2, 3, 64, torch.bfloat16, 0, torch.device("cpu"), mscale=1.21)
    y, dx = _run(rope_reference, x, dy, cos, sin)
    ym, dxm = _run(lambda t: _apply_rotary_pos_emb_bshd(t, freqs, mscale=1.21), x, dy)
    assert torch.equal(y, ym) and torch.equal(dx, dxm)
    pos = torch.randint(0, 37, (37,), generator=torch.Generator().manual_seed(1))
    yp, dxp = _run(lambda t: rope_reference(t, cos, sin, pos), x, dy)
    ymp, dxmp = _run(lambda t: _apply_rotary_pos_emb_bshd(t, freqs[pos], mscale=1.21), x, dy)
    assert torch.equal(yp, ymp) and torch.equal(dxp, dxmp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("S,B,H,D,seed", [(19, 1, 5, 64, 0), (8, 3, 2, 128, 1), (33, 2, 16, 32, 2)])
def test_matches_the_reference_with_rows_as_positions(dev, dtype, S, B, H, D, seed):
    _, cos, sin, x, dy = _case(S, B, H, D, dtype, seed, dev, mscale=1.0 + seed / 7, P=S + 5)
    y, dx = _run(fused_rope, x, dy, cos, sin)
    yr, dxr = _run(rope_reference, x, dy, cos, sin)
    assert y.is_contiguous() and dx.is_contiguous()
    _assert_same(y, yr, dev, _terms(x, cos, sin))
    _assert_same(dx, dxr, dev, _terms(dy, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_positions_and_strided_views(dev, dtype):
    """Packed documents (positions restart at each document) on a strided view, as megatron's split of
    the fused QKV hands q over."""
    S, H, D = 45, 3, 64
    _, cos, sin, _, dy = _case(S, 1, H, D, dtype, 3, dev, mscale=1.3)
    cu = torch.tensor([0, 7, 8, 30, 45])
    pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])]).to(dev)
    g = torch.Generator().manual_seed(4)
    qkv = (torch.randn(S, 1, H, 3 * D, generator=g) * 2).to(dev, dtype)
    x = qkv[..., D:2 * D]  # unit last stride, head stride 3 D
    assert not x.is_contiguous()
    y, dx = _run(lambda t: fused_rope(t, cos, sin, pos), x, dy)
    yr, dxr = _run(lambda t: rope_reference(t, cos, sin, pos), x, dy)
    _assert_same(y, yr, dev, _terms(x, cos, sin, pos))
    _assert_same(dx, dxr, dev, _terms(dy, cos, sin, pos))
    # a non-contiguous output gradient
    dy2 = torch.randn(S, 1, D, H, generator=g).to(dev, dtype).transpose(2, 3)
    _, dx2 = _run(lambda t: fused_rope(t, cos, sin, pos), x, dy2)
    _, dxr2 = _run(lambda t: rope_reference(t, cos, sin, pos), x, dy2)
    _assert_same(dx2, dxr2, dev, _terms(dy2, cos, sin, pos))


def test_empty_and_bad_inputs(dev):
    _, cos, sin, x, _ = _case(4, 1, 2, 64, torch.bfloat16, 5, dev)
    assert fused_rope(x[:0], cos, sin).shape == (0, 1, 2, 64)
    with pytest.raises(ValueError, match="table rows"):
        fused_rope(torch.cat([x, x]), cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        fused_rope(x, cos.float(), sin)
    with pytest.raises(ValueError, match="positions must be"):
        fused_rope(x, cos, sin, torch.zeros(3, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match="head dim"):
        fused_rope(x[..., :48], cos[:, :48], sin[:, :48])
