"""Query chunks in the kernels (context parallelism): each rank's zigzag chunks of queries against the whole
key row give the full-row call's selection rows (bit for bit) and attention rows, and the ranks' key-side
gradients sum to the full call's; on ``dev``, packed documents of odd lengths crossing the chunk borders."""

import pytest
import torch

from nosa_layers import nosa_attention
from nosa_layers.ops import build_sparse_index, select_blocks_triton, sparse_attention
from nosa_layers.query_chunks import zigzag_chunks
from nosa_layers.selection import select_blocks_reference
from tests.nosa.common import random_qkvs, tiny_cfg
from tests.ops.conftest import fp32_tol

# B, T, Hq, Hkv, D, cu_seqlens, context-parallel sizes; the tiny budget: 7 blocks of 16 = 112 tokens. Packed
# documents of odd lengths cross the chunk borders at CP=4 (sparse) and CP=2 (each within the budget).
CASES = [
    pytest.param(1, 192, 8, 2, 16, [0, 37, 40, 171, 192], (4,), id="packed-odd-docs-cp4"),
    pytest.param(2, 128, 4, 1, 16, None, (2,), id="B2-rows"),
    pytest.param(1, 96, 4, 2, 16, [0, 29, 51, 96], (2,), id="all-docs-fit-the-budget"),
]


def _inputs(dev, B, T, Hq, Hkv, D, cu, seed):
    q, k, v, s = (x.to(dev) for x in random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=seed))
    return q, k, v, s, None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)


@pytest.mark.parametrize("evict", [True, False], ids=["nosa", "infllm_v2"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,cps", CASES)
def test_selection_of_chunks_equals_the_full_rows(dev, B, T, Hq, Hkv, D, cu, cps, evict):
    cfg = tiny_cfg()
    q, k, _, s, cu_t = _inputs(dev, B, T, Hq, Hkv, D, cu, seed=T + Hq)
    score = s if evict else None
    full = select_blocks_triton(q, k, score, cfg, cu_seqlens=cu_t)
    assert torch.equal(full.cpu(), select_blocks_reference(q.cpu(), k.cpu(), None if score is None else s.cpu(), cfg,
                                                           None if cu_t is None else cu_t.cpu()))
    for cp in cps:
        for r in range(cp):
            ch = zigzag_chunks(T, cp, r)
            rows = ch.rows(dev)
            got = select_blocks_triton(q[:, rows], k, score, cfg, cu_seqlens=cu_t, q_chunks=ch)
            assert torch.equal(got, full[:, :, rows]), f"cp={cp} rank {r}"


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,cps", CASES)
def test_attention_of_chunks_equals_the_full_rows(dev, B, T, Hq, Hkv, D, cu, cps):
    """Forward, dQ of each rank's rows and dK / dV / d(bias) summed over the ranks, against the full-row
    kernel call and the reference."""
    cfg = tiny_cfg()
    q, k, v, s, cu_t = _inputs(dev, B, T, Hq, Hkv, D, cu, seed=2 * T + Hq)
    sel = select_blocks_triton(q, k, s, cfg, cu_seqlens=cu_t)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
    out = sparse_attention(*xs[:3], build_sparse_index(sel, cfg, T, cu_t, num_q_heads=Hq), bias=xs[3])
    dout = torch.randn_like(out)
    full = [out, *torch.autograd.grad(out, xs, dout)]
    tol = fp32_tol(dev)
    for cp in cps:
        key_grads = [torch.zeros_like(g) for g in full[2:]]
        for r in range(cp):
            ch = zigzag_chunks(T, cp, r)
            rows = ch.rows(dev)
            ys = [x.detach().clone().requires_grad_(True) for x in (q[:, rows], k, v, s)]
            index = build_sparse_index(sel[:, :, rows], cfg, T, cu_t, num_q_heads=Hq, q_chunks=ch)
            assert index.n_tiles < index.layout.n_blocks * (cfg.block_size // index.qt)  # only the chunks' tiles
            o = sparse_attention(*ys[:3], index, bias=ys[3])
            grads = torch.autograd.grad(o, ys, dout[:, rows])
            ref = nosa_attention(*(y.detach().cpu().requires_grad_(True) for y in ys[:3]), None, cfg,
                                 cu_seqlens=None if cu_t is None else cu_t.cpu(), attn_bias=s.cpu(),
                                 selected=sel[:, :, rows].cpu(), q_chunks=ch, backend="reference")
            for name, a, b in (("out", o, full[0][:, rows]), ("dq", grads[0], full[1][:, rows]),
                               ("out vs reference", o.cpu(), ref)):
                scale = b.abs().max().item() + 1e-6
                assert (a.detach().cpu() - b.detach().cpu()).abs().max().item() <= tol * scale, f"cp={cp} r={r} {name}"
            for acc, g in zip(key_grads, grads[1:]):
                acc += g
        for name, a, b in zip(("dk", "dv", "dbias"), key_grads, full[2:]):
            scale = b.abs().max().item() + 1e-6
            assert (a - b).abs().max().item() <= tol * scale, f"cp={cp}: {name} summed over the ranks differs"


def test_nosa_attention_triton_backend_takes_chunks(dev):
    """The dispatcher's Triton path (selection, index, attention) with query chunks equals the reference path."""
    cfg = tiny_cfg()
    T = 160
    q, k, v, s, cu_t = _inputs(dev, 1, T, 4, 2, 16, [0, 61, 160], seed=5)
    ch = zigzag_chunks(T, 2, 1)
    rows = ch.rows(dev)
    got = nosa_attention(q[:, rows], k, v, s, cfg, cu_seqlens=cu_t, backend="triton", q_chunks=ch)
    ref = nosa_attention(q[:, rows].cpu(), k.cpu(), v.cpu(), s.cpu(), cfg, cu_seqlens=cu_t.cpu(), q_chunks=ch)
    assert (got.cpu() - ref).abs().max().item() <= fp32_tol(dev) * (ref.abs().max().item() + 1e-6)
