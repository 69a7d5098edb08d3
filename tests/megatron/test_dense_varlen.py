"""Variable-length dense attention of packed documents (``nosa_layers/megatron/dense_varlen.py``):
on a GPU it equals the per-document SDPA loop (output and gradients, GQA, odd lengths, a
one-token document); everywhere, it refuses what it cannot take."""

import pytest
import torch
import torch.nn.functional as F

from nosa_layers.megatron.dense_varlen import causal_varlen_attention, varlen_supported


def _loop(q, k, v, cu):
    """Reference: one causal SDPA per document, fp32; ``[t, H, D]``."""
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds, bounds[1:]):
        qs, ks, vs = (x[s:e].float().transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def test_refuses_cpu_and_fp32_with_a_clear_error():
    q, k = torch.randn(10, 4, 64), torch.randn(10, 2, 64)
    assert not varlen_supported(q, k)
    with pytest.raises(ValueError, match="CUDA fp16/bf16"):
        causal_varlen_attention(q, k, k, torch.tensor([0, 4, 10], dtype=torch.int32), 6)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_equals_the_per_document_loop(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(seed)
    lens = [1, 37, 200, 64, 129] if seed == 0 else [300, 5, 91]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
               for h in (8, 2, 2))
    out = causal_varlen_attention(q, k, v, cu, max(lens))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qr, kr, vr = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = _loop(qr, kr, vr, cu)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.float())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        err = (a.float() - r).abs().max().item()
        assert err <= 2e-2 * (r.abs().max().item() + 1e-6), f"{name}: {err:.3e}"
