"""Variable-length dense attention of packed documents (``nosa_layers/megatron/dense_varlen.py``):
on a GPU it equals the per-document SDPA loop (output and gradients, GQA, odd lengths, a
one-token document); everywhere, it refuses what it cannot take."""

import types

import pytest
import torch
import torch.nn.functional as F

from nosa_layers.megatron.dense_varlen import causal_varlen_attention, varlen_supported


def _loop(q, k, v, cu):
    """Reference: one causal SDPA per document, fp32 (fp64 inputs: fp64); ``[t, H, D]``."""
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds, bounds[1:]):
        qs, ks, vs = (x[s:e].to(torch.promote_types(x.dtype, torch.float32)).transpose(0, 1)[None] for x in (q, k, v))
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


def _chunk_pieces(T, cp, r, docs):
    from nosa_layers.query_chunks import zigzag_chunks
    from nosa_layers.selection import document_spans

    ch = zigzag_chunks(T, cp, r)
    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist())
    return ch, types.SimpleNamespace(seq_len=T, pieces=tuple(ch.pieces(document_spans(cu, T))))


@pytest.mark.parametrize("cp", [2, 4])
def test_chunked_pieces_equal_the_full_rows(cp):
    """Context-parallel dense attention (each rank's zigzag chunks against the whole row, documents of odd
    lengths crossing the chunk borders): the rows and, summed over the ranks, the key gradients of the
    per-document loop; and the variable-length tables of the GPU path describe the same attention."""
    from nosa_layers.megatron.dense_varlen import _piece_tables, pieces_attention

    g = torch.Generator().manual_seed(cp)
    docs = [37, 101, 3, 51]
    T = sum(docs)
    cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.randn(T, h, 16, generator=g, dtype=torch.float64).requires_grad_(True) for h in (4, 2, 2))
    ref = _loop(q, k, v, cu)
    do = torch.randn_like(ref)
    ref_dk, ref_dv = torch.autograd.grad(ref, (k, v), do)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        ch, plan = _chunk_pieces(T, cp, r, docs)
        rows = ch.rows()
        out = pieces_attention(q[rows].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               plan.pieces)[0].transpose(0, 1)
        torch.testing.assert_close(out, ref[rows], rtol=1e-12, atol=1e-12)
        gk, gv = torch.autograd.grad(out, (k, v), do[rows])
        dk, dv = dk + gk, dv + gv
        index, cu_q, cu_k, max_q, max_k = _piece_tables(plan, 1, "cpu")  # the GPU call's tables, run piece by piece
        kk, vv = k[index], v[index]
        parts = []
        for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
            mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))
            qp, kp, vp = (x.transpose(0, 1)[None] for x in (q[rows][a:b], kk[c:d], vv[c:d]))
            parts.append(F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
        torch.testing.assert_close(torch.cat(parts), out, rtol=1e-12, atol=1e-12)
        assert max_q == max(b - a for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()))
    torch.testing.assert_close(dk, ref_dk, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, ref_dv, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_gpu_chunked_varlen_equals_the_pieces():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nosa_layers.megatron.dense_varlen import chunked_varlen_attention, pieces_attention

    g = torch.Generator().manual_seed(3)
    docs = [301, 5, 600, 118]
    T = sum(docs)
    ch, plan = _chunk_pieces(T, 4, 1, docs)
    rows = ch.rows("cuda")
    q, k, v = (torch.randn(1, T, h, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
               for h in (8, 2, 2))
    out = chunked_varlen_attention(q[:, rows], k, v, plan)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qr, kr, vr = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = pieces_attention(qr[:, rows].transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), plan.pieces)
    ref = ref.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.float())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        err = (a.float() - r).abs().max().item()
        assert err <= 2e-2 * (r.abs().max().item() + 1e-6), f"{name}: {err:.3e}"
