"""nosa_attention: dense limit, bias semantics, gradients, packing, padding, variants."""

import pytest
import torch
import torch.nn.functional as F

from nosa_layers import EVICTION_HEADS, NOSAConfig, build_eviction_head, nosa_attention, select_blocks
from nosa_layers.reference_layer import NOSAReferenceSelfAttention
from nosa_layers.reference import block_sparse_attention
from tests.nosa.common import random_qkvs, tiny_cfg


def dense_causal_with_bias(q, k, v, bias):
    """Independent dense attention: SDPA with an additive float mask (bias + causal -inf)."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    mask = torch.full((T, T), float("-inf"), dtype=q.dtype).triu(1)
    mask = mask[None, None] + bias.repeat_interleave(G, dim=2).permute(0, 2, 1)[:, :, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("cfg,T", [(tiny_cfg(), 112), (tiny_cfg(), 45), (NOSAConfig(), 333), (NOSAConfig(), 17)],
                         ids=["tiny-T=k*bs", "tiny-T45", "default-T333", "default-T17"])
def test_short_sequences_are_dense_causal_attention_with_bias(cfg, T):
    assert T <= cfg.dense_len
    q, k, v, s = random_qkvs(2, T, 6, 2, 16)
    torch.testing.assert_close(nosa_attention(q, k, v, s, cfg), dense_causal_with_bias(q, k, v, s),
                               rtol=1e-10, atol=1e-10)


def test_long_sequences_are_really_sparse():
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 400, 4, 2, 16)
    assert not torch.allclose(nosa_attention(q, k, v, s, cfg), dense_causal_with_bias(q, k, v, s), atol=1e-3)


def test_full_scale_bias_equals_two_call_exp_formulation():
    """Reference trick: Attn(q, k, v*exp(c)) / Attn(q, k, exp(c)) == softmax(qk*scale + c) v."""
    cfg = tiny_cfg()
    q, k, v, c = random_qkvs(2, 290, 4, 2, 16, score_scale=2.0)
    sel = select_blocks(q, k, c, cfg)
    e = c.exp()[..., None]
    num = block_sparse_attention(q, k, v * e, sel, cfg.block_size)
    den = block_sparse_attention(q, k, e.expand_as(v), sel, cfg.block_size)
    torch.testing.assert_close(nosa_attention(q, k, v, c, cfg), num / den[..., :1], rtol=1e-10, atol=1e-12)


def test_gradcheck_q_k_v_bias():
    cfg = tiny_cfg(block_size=8, kernel_size=4, kernel_stride=2, local_blocks=1, select_blocks=1, topk=4)
    q, k, v, s = random_qkvs(1, 53, 4, 2, 4, grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, s: nosa_attention(q, k, v, s, cfg), (q, k, v, s), fast_mode=True)


def test_gradient_reaches_A_at_zero_but_not_delta():
    head = build_eviction_head("ed_dma", num_q_heads=4, num_kv_heads=2, head_dim=8).double()
    assert head.A.shape == (2,) and head.delta.weight.shape == (2, 16) and not head.A.any()
    q, k, v, _ = random_qkvs(1, 150, 4, 2, 8)
    ev = head(q, k, v)
    nosa_attention(q, k, v, ev.score, tiny_cfg(), attn_bias=ev.bias).pow(2).sum().backward()
    assert head.A.grad.abs().min() > 0
    assert torch.count_nonzero(head.delta.weight.grad) == 0


def test_eviction_score_couples_kv_heads_through_delta():
    head = build_eviction_head("ed_dma", num_q_heads=4, num_kv_heads=2, head_dim=8).double()
    with torch.no_grad():
        head.A.fill_(1.0)
    _, k, v, _ = random_qkvs(1, 20, 4, 2, 8)
    base = head(None, k, v).score
    v2 = v.clone()
    v2[..., 1, :] += 1.0  # change only KV head 1
    assert not torch.allclose(head(None, k, v2).score[..., 0], base[..., 0])


def test_packed_documents_are_isolated_in_outputs_and_gradients():
    cfg = tiny_cfg()
    lens = [150, 113]
    cu = torch.tensor([0, lens[0], sum(lens)])
    q, k, v, s = random_qkvs(1, sum(lens), 4, 2, 8)

    def run(perturb):
        xs = [x.clone() for x in (q, k, v, s)]
        if perturb:
            for x in xs:
                x[:, :lens[0]] += torch.randn_like(x[:, :lens[0]])
        xs = [x.requires_grad_(True) for x in xs]
        out = nosa_attention(*xs, cfg, cu_seqlens=cu)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out, [x.grad for x in xs]

    out_a, grads_a = run(False)
    out_b, grads_b = run(True)
    doc2 = slice(lens[0], None)
    assert not torch.allclose(out_a[:, :lens[0]], out_b[:, :lens[0]])
    assert torch.equal(out_a[:, doc2], out_b[:, doc2])
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga[:, doc2], gb[:, doc2])
    # and packing equals running each document alone (positions and blocks restart)
    alone = nosa_attention(q[:, doc2], k[:, doc2], v[:, doc2], s[:, doc2], cfg)
    torch.testing.assert_close(out_a[:, doc2].detach(), alone, rtol=1e-12, atol=1e-12)


def test_batch_with_different_lengths_matches_single_sequences():
    """Right-padded batch: valid rows equal the unpadded single-sequence run."""
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(3, 170, 4, 2, 8)
    out = nosa_attention(q, k, v, s, cfg)
    for b, L in enumerate([170, 99, 31]):
        alone = nosa_attention(q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], s[b:b + 1, :L], cfg)
        torch.testing.assert_close(out[b:b + 1, :L], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 100, 4, 2, 8, dtype=dtype)
    out = nosa_attention(q, k, v, s.to(torch.promote_types(dtype, torch.float32)), cfg)  # fp32+ bias
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(EVICTION_HEADS))
def test_every_variant_runs_forward_backward(name):
    cfg = tiny_cfg(eviction_head=name)
    layer = NOSAReferenceSelfAttention(hidden_size=32, num_heads=4, num_kv_heads=2, cfg=cfg)
    for p in layer.parameters():
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.0)  # A != 0 so every head parameter gets gradient
    x = torch.randn(2, 140, 32)
    cu = None
    if name == "ed_dma":  # one variant also packed
        x, cu = x[:1], torch.tensor([0, 60, 140])
    out = layer(x, cu_seqlens=cu)
    assert out.shape == x.shape
    out.square().mean().backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"{name}: no gradient for {pname}"


def test_straight_through_head_leaves_forward_unchanged():
    cfg = tiny_cfg(eviction_head="s_dma")
    head = build_eviction_head("s_dma", num_q_heads=4, num_kv_heads=2, head_dim=8).double()
    with torch.no_grad():
        head.A.fill_(1.0)
    q, k, v, _ = random_qkvs(1, 120, 4, 2, 8)
    ev = head(q, k, v)
    out = nosa_attention(q, k, v, ev.score, cfg, attn_bias=ev.bias)
    unbiased = nosa_attention(q, k, v, ev.score.detach(), cfg, attn_bias=None)
    torch.testing.assert_close(out, unbiased, rtol=0, atol=0)


def test_checkpoint_parameter_names_and_shapes():
    shapes = {n: tuple(p.shape) for n, p in build_eviction_head(
        "ed_dma", num_q_heads=32, num_kv_heads=2, head_dim=128).named_parameters()}
    assert shapes == {"A": (2,), "delta.weight": (2, 256)}
    shapes = {n: tuple(p.shape) for n, p in build_eviction_head(
        "locret", num_q_heads=4, num_kv_heads=2, head_dim=8).named_parameters()}
    assert shapes == {"fc1.weight": (1024, 64), "fc2.weight": (2, 1024)}
    assert list(build_eviction_head("none", num_q_heads=4, num_kv_heads=2, head_dim=8).parameters()) == []


def test_backend_choice():
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 40, 4, 2, 8)
    torch.testing.assert_close(nosa_attention(q, k, v, s, cfg, backend="auto"), nosa_attention(q, k, v, s, cfg))
    with pytest.raises(ValueError, match="unknown NOSA backend"):
        nosa_attention(q, k, v, s, cfg, backend="cuda-magic")


def test_precomputed_selection_is_used_as_given():
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 150, 4, 2, 8)
    sel = select_blocks(q, k, s, cfg)
    torch.testing.assert_close(nosa_attention(q, k, v, s, cfg, selected=sel), nosa_attention(q, k, v, s, cfg),
                               rtol=0, atol=0)
    dense = torch.ones_like(sel)  # every block selected: dense causal attention with the bias
    torch.testing.assert_close(nosa_attention(q, k, v, s, cfg, selected=dense), dense_causal_with_bias(q, k, v, s),
                               rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="selected must be"):
        nosa_attention(q, k, v, s, cfg, selected=sel[:, :1])


@pytest.mark.parametrize("name", sorted(EVICTION_HEADS))
def test_heads_declare_their_inputs(name):
    """``reads_qk`` is what callers rely on to skip gathering q/k (megatron TP) and to recompute
    scores from the value cache (HF decode): a head that leaves it False must not read q or k."""
    head = build_eviction_head(name, num_q_heads=4, num_kv_heads=2, head_dim=8).double()
    for p in head.parameters():
        torch.nn.init.uniform_(p, 0.5, 1.0)
    q, k, v, _ = random_qkvs(1, 20, 4, 2, 8, seed=0)
    ev = head(q, k, v)
    if not head.has_score:
        assert ev.score is None and ev.bias is None
        return
    moved = head(q + 1.0, k - 1.0, v)
    if head.reads_qk:
        assert not torch.allclose(moved.score, ev.score), f"{name} declares reads_qk but ignores q and k"
    else:
        torch.testing.assert_close(head(None, None, v).score, ev.score, rtol=0, atol=0)
        torch.testing.assert_close(moved.score, ev.score, rtol=0, atol=0)
