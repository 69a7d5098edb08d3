"""Compiled kernels at realistic shapes in bf16/fp16 (``cuda`` only).

Tolerance rule (FlashAttention tests): the error of the kernel against an fp32 reference on the
same bf16/fp16 inputs must be at most 2x the error of a PyTorch implementation computing in the
low precision, plus a tiny absolute slack.
"""

import pytest
import torch

from nosa_layers import NOSAConfig, select_blocks
from nosa_layers.ops import build_sparse_index, select_blocks_triton, sparse_attention
from nosa_layers.ops.block_selection import block_scores_triton, compress
from nosa_layers.ops.layout import block_layout
from nosa_layers.selection import topk_mask
from tests.ops.helpers import assert_topk_tie_aware, reference_block_scores

SPARSE_4K = NOSAConfig(topk=24, local_blocks=6, select_blocks=8)  # 24 of 64 blocks at T=4K


def masked_attention(q, k, v, bias, sel, block, compute_dtype, scale=None):
    """Dense masked attention over ``sel`` computed in ``compute_dtype`` (bf16 = the 'PyTorch
    low-precision implementation', fp32 = the reference)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = scale or D ** -0.5
    qd, kd, vd = (x.to(compute_dtype) for x in (q, k, v))
    kb = torch.arange(T, device=q.device) // block
    causal = torch.arange(T, device=q.device)[None, :] <= torch.arange(T, device=q.device)[:, None]
    allowed = sel[..., kb] & causal  # [B, Hkv, T, T]
    logits = torch.einsum("bthgd,bshd->bhgts", qd.view(B, T, Hkv, G, D), kd) * scale
    if bias is not None:
        logits = logits + bias.to(compute_dtype).permute(0, 2, 1)[:, :, None, None, :]
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).to(compute_dtype)
    return torch.einsum("bhgts,bshd->bthgd", p, vd).reshape(B, T, Hq, D)


def _inputs(B, T, Hq, Hkv, D, dtype, seed=0, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, generator=g)
    s = 0.5 * torch.randn(B, T, Hkv, device=dev, dtype=torch.float32, generator=g)
    return q, k, v, s


def _grads(fn, xs, do):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    return (out, *torch.autograd.grad(out, xs, do))


@pytest.mark.parametrize("Hq,dtype,qt", [(16, torch.bfloat16, None), (32, torch.bfloat16, None),
                                         (16, torch.float16, None), (32, torch.bfloat16, 64)])
def test_vs_fp32_reference_4k(cuda, Hq, dtype, qt):
    cfg = SPARSE_4K
    B, T, Hkv, D = 1, 4096, 2, 128
    q, k, v, s = _inputs(B, T, Hq, Hkv, D, dtype, seed=Hq)
    sel = select_blocks_triton(q, k, s, cfg)
    assert sel.sum(-1).max() <= cfg.topk and not sel.all()
    index = build_sparse_index(sel, cfg, T, num_q_heads=Hq, qt=qt, row_budget=cfg.topk)
    do = torch.randn_like(q)
    ours = _grads(lambda q, k, v, b: sparse_attention(q, k, v, index, bias=b), (q, k, v, s), do)
    ref = _grads(lambda q, k, v, b: masked_attention(q, k, v, b, sel, cfg.block_size, torch.float32), (q, k, v, s), do)
    low = _grads(lambda q, k, v, b: masked_attention(q, k, v, b, sel, cfg.block_size, dtype), (q, k, v, s), do)
    for name, a, r, p in zip(("out", "dq", "dk", "dv", "dbias"), ours, ref, low):
        assert torch.isfinite(a).all(), name
        err = (a.float() - r.float()).abs().max().item()
        err_low = (p.float() - r.float()).abs().max().item()
        print(f"{name}: ours {err:.3e}  low-precision torch {err_low:.3e}")
        assert err <= 2 * err_low + 1e-5, f"{name}: {err:.3e} > 2 x {err_low:.3e}"


def test_selection_vs_reference_4k(cuda):
    cfg = SPARSE_4K
    q, k, _, s = _inputs(1, 4096, 16, 2, 128, torch.bfloat16, seed=3)
    got = select_blocks_triton(q, k, s, cfg)
    ref = select_blocks(q, k, s, cfg)
    layout = block_layout(1, 4096, None, cfg.block_size, q.device)
    bt = block_scores_triton(q, compress(k, None, layout, cfg, q.dtype)[0], layout, cfg)
    bref = reference_block_scores(q.cpu().float(), k.cpu().float(), cfg).to(q.device)
    seen = torch.arange(64, device=q.device)[None, :] <= (torch.arange(4096, device=q.device) // 64)[:, None]
    bt = bt.masked_fill(~seen, float("-inf"))
    fin = bref.isfinite()
    assert torch.equal(fin, bt.isfinite())
    err = (bt.double() - bref)[fin].abs().max().item()
    assert err < 2e-2, err  # bf16 tensor-core dot products vs fp64
    n_diff = assert_topk_tie_aware(topk_mask(bt, cfg.query_aware_blocks),
                                   topk_mask(bref.float(), cfg.query_aware_blocks), bref, 4 * err)
    rows = (got != ref).any(-1).float().mean().item()
    print(f"block-score max err {err:.2e}; rows differing from the reference: {rows:.4f}; near-tie rows {n_diff}")
    assert rows < 0.05
