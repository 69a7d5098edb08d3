"""The hand-scheduled Hopper forward (``attention_fwd_sm90``, Gluon: TMA ring + overlapped wgmma)
against the PyTorch reference and the Triton forward, on an sm90 GPU only (wgmma is Hopper-only and
Gluon has no interpreter): bf16 / fp16, head dims 64 and 128, GQA ratios 1-16, odd lengths, packed
documents, two batch rows (a block past the last row's end is zero-filled by TMA, one past the
first row's end reads the next row's first keys, masked), every ring depth,
Q from shared memory or registers. The sm90 compile check of ``test_arch`` covers it on CPU."""

import pytest
import torch

from nosa_layers import NOSAConfig, nosa_attention, select_blocks
from nosa_layers.ops import attention_op, build_sparse_index, sparse_attention
from tests.nosa.common import random_qkvs


@pytest.fixture
def hopper(cuda):
    if torch.cuda.get_device_capability(cuda) != (9, 0):
        pytest.skip("needs an sm90 (Hopper) GPU")
    return cuda


def _config(monkeypatch, **fwd):
    cfg = attention_op.CONFIG["sm90"]
    monkeypatch.setitem(cfg, "fwd", dict(cfg["fwd"], **fwd))


CASES = [  # B, T, Hq, Hkv, D, cu_seqlens, dtype
    pytest.param(1, 3000, 16, 2, 128, None, torch.bfloat16, id="G8-T3000-D128"),
    pytest.param(1, 2113, 16, 1, 128, [0, 700, 701, 2113], torch.bfloat16, id="G16-docs"),
    pytest.param(2, 1100, 16, 2, 128, None, torch.bfloat16, id="B2-G8"),
    pytest.param(1, 2500, 8, 2, 64, [0, 1000, 2500], torch.float16, id="G4-D64-fp16"),
    pytest.param(1, 1999, 2, 2, 128, None, torch.bfloat16, id="G1-T1999"),
]


@pytest.mark.parametrize("stages,q_regs", [(2, False), (3, True), (4, False)], ids=["s2", "s3-qregs", "s4"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", CASES)
def test_hopper_forward_matches_reference_and_triton(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype, stages, q_regs):
    dev = hopper
    cfg = NOSAConfig(topk=12, local_blocks=2, select_blocks=6).validate()
    q, k, v, s = (x.to(dev) for x in random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=T + Hq + stages))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    sel = select_blocks(q, k, s, cfg, cu_seqlens=cu_t)
    idx = build_sparse_index(sel, cfg, T, cu_t, num_q_heads=Hq)
    q16, k16, v16 = (x.to(dtype) for x in (q, k, v))
    _config(monkeypatch, impl="triton")
    want_o, want_lse = attention_op.attention_forward(q16, k16, v16, s, idx, D ** -0.5)
    _config(monkeypatch, impl="gluon", num_stages=stages, q_regs=q_regs)
    assert attention_op.hopper_forward(q16, idx, attention_op.heads_per_program(Hq // Hkv, idx.qt, 64),
                                       attention_op.CONFIG["sm90"]["fwd"])
    got_o, got_lse = attention_op.attention_forward(q16, k16, v16, s, idx, D ** -0.5)
    assert torch.isfinite(got_o).all()
    valid = torch.isfinite(want_lse)
    assert torch.equal(valid, torch.isfinite(got_lse))
    assert (got_lse[valid] - want_lse[valid]).abs().max().item() < 2e-3
    assert (got_o.float() - want_o.float()).abs().max().item() < 2e-2
    ref = nosa_attention(q16.double(), k16.double(), v16.double(), s.double(), cfg, selected=sel,
                         cu_seqlens=cu_t)
    err = (got_o.double() - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item(), err


def test_hopper_forward_gradients(hopper, monkeypatch):
    """Training through the Hopper forward: the backward reads its LSE; gradients match the Triton
    forward's (same backward kernels)."""
    dev = hopper
    cfg = NOSAConfig(topk=12, local_blocks=2, select_blocks=6).validate()
    q, k, v, s = (x.to(dev) for x in random_qkvs(1, 2300, 16, 2, 128, dtype=torch.float32, seed=7))
    sel = select_blocks(q, k, s, cfg)
    idx = build_sparse_index(sel, cfg, 2300, num_q_heads=16)
    do = torch.randn(1, 2300, 16, 128, device=dev, dtype=torch.bfloat16)
    grads = {}
    for impl in ("triton", "gluon"):
        _config(monkeypatch, impl=impl)
        xs = [x.to(torch.bfloat16).requires_grad_(True) for x in (q, k, v)]
        b = s.clone().requires_grad_(True)
        out = sparse_attention(*xs, idx, bias=b)
        grads[impl] = (out, *torch.autograd.grad(out, [*xs, b], do))
    for name, a, w in zip(("out", "dq", "dk", "dv", "db"), grads["gluon"], grads["triton"]):
        err = (a.float() - w.float()).abs().max().item()
        assert err <= 2e-2 * w.float().abs().max().item(), f"{name}: {err}"


def test_impl_is_checked(monkeypatch):
    q = torch.zeros(1, 64, 8, 128)
    _config(monkeypatch, impl="cuda")
    with pytest.raises(ValueError, match="fwd.impl"):
        attention_op.hopper_forward(q, None, 8, attention_op.CONFIG["sm90"]["fwd"])
