"""Triton kernels under the interpreter (CPU CI) vs the PyTorch reference, tiny shapes."""

import subprocess
import sys

import pytest
import torch

from nosa_layers import NOSAConfig, nosa_attention, select_blocks
from nosa_layers.selection import document_spans
from tests.nosa.common import random_qkvs, tiny_cfg
from tests.ops.helpers import assert_topk_tie_aware, reference_block_scores, reference_grads

from tests.ops import conftest as _cf


def _run_attention(B, T, Hq, Hkv, D, dtype, cu=None, bias=True, cfg=None, seed=0):
    from nosa_layers.ops import sparse_attention_from_selection

    cfg = cfg or tiny_cfg()
    q, k, v, s = random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=seed)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    sel = select_blocks(q, k, s, cfg, cu_seqlens=cu_t)  # same selection for both
    xs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    b = s.clone().requires_grad_(True) if bias else None
    out = sparse_attention_from_selection(*xs, sel, cfg, cu_seqlens=cu_t, bias=b)
    do = torch.randn_like(out)
    ins = xs + ([b] if bias else [])
    grads = torch.autograd.grad(out, ins, do)
    ref_out, ref_grads = reference_grads(*xs, b, sel, cfg, do, document_spans(cu_t, T))
    return out, grads, ref_out, ref_grads


def _close(a, ref, rel):
    err = (a.double() - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.1e} x {scale:.3e}"


CASES = [  # B, T, Hq, Hkv, D, cu_seqlens
    pytest.param(1, 100, 16, 2, 16, None, id="G8-T100"),
    pytest.param(1, 75, 16, 1, 16, None, id="G16-T75"),
    pytest.param(2, 67, 4, 2, 32, None, id="B2-G2-T67-D32"),
    pytest.param(1, 150, 8, 1, 16, [0, 37, 37, 101, 150], id="varlen-G8"),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu", CASES)
@pytest.mark.usefixtures("interp")
def test_attention_fp32_matches_reference(B, T, Hq, Hkv, D, cu):
    out, grads, ref_out, ref_grads = _run_attention(B, T, Hq, Hkv, D, torch.float32, cu)
    _close(out, ref_out, 1e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        _close(g, r, 1e-5), name


@pytest.mark.usefixtures("interp")
def test_attention_fp16_and_no_bias():
    out, grads, ref_out, ref_grads = _run_attention(1, 90, 8, 1, 16, torch.float16, bias=True, seed=3)
    _close(out, ref_out, 5e-3)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 1e-2)
    out, grads, ref_out, ref_grads = _run_attention(1, 53, 4, 2, 16, torch.float32, bias=False, seed=4)
    assert len(grads) == 3
    _close(out, ref_out, 1e-5)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 1e-5)


@pytest.mark.parametrize("B,T,Hq,Hkv,cu,tma,pair", [
    pytest.param(1, 100, 16, 2, None, True, False, id="G8-tma"),
    pytest.param(2, 75, 8, 1, None, True, True, id="B2-G8-T75-tma-pair"),
    pytest.param(1, 150, 8, 2, [0, 37, 37, 101, 150], True, False, id="varlen-tma"),
    pytest.param(1, 150, 8, 2, [0, 37, 37, 101, 150], False, True, id="varlen-pair"),
])
@pytest.mark.usefixtures("interp")
def test_kernel_variants(monkeypatch, B, T, Hq, Hkv, cu, tma, pair):
    """TMA descriptor loads (rows past a document end or past the tensor end zeroed) and paired key
    blocks in the forward equal the reference, including on the last, partial tiles and odd lists."""
    from nosa_layers.ops import CONFIG

    for kern in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(CONFIG, kern, dict(CONFIG[kern], TMA=tma))
    monkeypatch.setitem(CONFIG, "fwd", dict(CONFIG["fwd"], PAIR=pair))
    out, grads, ref_out, ref_grads = _run_attention(B, T, Hq, Hkv, 16, torch.float32, cu, seed=12)
    _close(out, ref_out, 1e-5)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 1e-5)


@pytest.mark.parametrize("chunk,tma", [(1, False), (3, True)])
@pytest.mark.usefixtures("interp")
def test_split_inverse_lists(monkeypatch, chunk, tma):
    """dK/dV programs over pieces of the inverse lists (fp32 partials + ordered reduction) equal the
    reference; chunk 1 splits every list with more than one entry."""
    from nosa_layers.ops import CONFIG

    monkeypatch.setitem(CONFIG, "dkdv", dict(CONFIG["dkdv"], CHUNK=chunk, TMA=tma))
    out, grads, ref_out, ref_grads = _run_attention(1, 150, 8, 2, 16, torch.float32, [0, 37, 37, 150], seed=13)
    _close(out, ref_out, 1e-5)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 1e-5)


def test_split_lists_cover_every_entry_once():
    from nosa_layers.ops._index import split_lists

    counts = torch.tensor([0, 5, 1, 12, 3, 0, 7])
    col_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    for chunk in (0, 1, 3, 5, 100):
        items, order, n_slots, red = split_lists(counts, chunk)
        assert sorted(order.tolist()) == list(range(items.shape[0]))
        lens = (items[order.long(), 2] - items[order.long(), 1]).tolist()
        assert lens == sorted(lens, reverse=True)
        for w, c in enumerate(counts.tolist()):
            mine = items[items[:, 0] == w]
            assert mine.shape[0] >= 1 and (chunk <= 0 or (mine[:, 2] - mine[:, 1]).max() <= max(chunk, 0))
            covered = [e for a, b in mine[:, 1:3].tolist() for e in range(a, b)]
            assert covered == list(range(int(col_ptr[w]), int(col_ptr[w + 1])))
            slots = mine[:, 3].tolist()
            if mine.shape[0] == 1:
                assert slots == [-1] and w not in red[:, 0].tolist()
            else:
                r = red[red[:, 0] == w][0].tolist()
                assert slots == list(range(r[1], r[1] + r[2])) and r[2] == mine.shape[0]
        assert n_slots == int((items[:, 3] >= 0).sum())


@pytest.mark.usefixtures("interp")
def test_end_to_end_with_triton_selection():
    """Triton selection + attention equals the reference end to end (short: dense causal)."""
    from nosa_layers.ops import nosa_attention_triton

    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 60, 4, 2, 16, dtype=torch.float32, seed=5)
    out = nosa_attention_triton(q, k, v, s, cfg, bias=s)
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg)
    _close(out, ref, 1e-5)


SEL_CASES = [
    pytest.param(tiny_cfg(), 1, 150, 16, 2, 16, None, True, id="tiny-G8"),
    pytest.param(tiny_cfg(), 2, 97, 16, 1, 16, None, True, id="tiny-G16-B2-odd"),
    pytest.param(tiny_cfg(), 1, 200, 4, 2, 16, [0, 37, 37, 150, 200], True, id="tiny-varlen"),
    pytest.param(tiny_cfg(), 1, 120, 4, 2, 16, None, False, id="tiny-no-evict"),
    pytest.param(tiny_cfg(local_blocks=0, select_blocks=3), 1, 130, 4, 2, 16, None, True, id="tiny-local0"),
    pytest.param(NOSAConfig(topk=6, local_blocks=2, select_blocks=2), 1, 700, 8, 1, 16, None, True, id="default-geom"),
]


@pytest.mark.parametrize("cfg,B,T,Hq,Hkv,D,cu,evict", SEL_CASES)
@pytest.mark.usefixtures("interp")
def test_selection_matches_reference(cfg, B, T, Hq, Hkv, D, cu, evict):
    from nosa_layers.ops.selection import block_scores_triton, select_blocks_triton
    from nosa_layers.ops.topk import _topk_mask

    q, k, _, s = random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=7)
    s = s if evict else None
    cu_t = None if cu is None else torch.tensor(cu)
    got = select_blocks_triton(q, k, s, cfg, cu_seqlens=cu_t)
    ref = select_blocks(q, k, s, cfg, cu_seqlens=cu_t)
    assert got.shape == ref.shape and got.dtype == torch.bool
    if torch.equal(got, ref):
        return
    # near ties only: check each document's query-aware stage against fp64 reference scores
    for a, e in document_spans(cu_t, T):
        bref = reference_block_scores(q[:, a:e], k[:, a:e], cfg)
        bt = block_scores_triton(q[:, a:e], k[:, a:e], cfg)
        fin = bref.isfinite()
        assert torch.equal(fin, bt.isfinite()) and torch.equal(bref[~fin], bt[~fin].double())
        assert (bt.double() - bref)[fin].abs().max() < 1e-5
        n = min(cfg.topk if s is None else cfg.query_aware_blocks, bref.shape[-1])
        assert_topk_tie_aware(_topk_mask(bt, n), _topk_mask(bref.float(), n), bref, 1e-5)


@pytest.mark.usefixtures("interp")
def test_block_scores_match_reference_values():
    from nosa_layers.ops.selection import block_scores_triton

    cfg = tiny_cfg()
    q, k, _, _ = random_qkvs(1, 133, 8, 2, 16, dtype=torch.float32, seed=9)
    bref = reference_block_scores(q, k, cfg)
    bt = block_scores_triton(q, k, cfg).double()
    fin = bref.isfinite()
    assert torch.equal(fin, bt.isfinite()) and torch.equal(bref[~fin], bt[~fin])
    assert (bt - bref)[fin].abs().max() < 1e-5


@pytest.mark.usefixtures("interp")
def test_topk_keys_break_ties_to_lower_index():
    from nosa_layers.ops.topk import _topk_mask
    from nosa_layers.selection import topk_mask

    x = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, float("inf"), float("-inf"), 3.0, float("inf"), -2.0]])
    for k in range(1, 11):
        assert torch.equal(_topk_mask(x, k), topk_mask(x, k)), k
    x = torch.randint(0, 4, (64, 37)).float()
    for k in (1, 5, 20, 37):
        assert torch.equal(_topk_mask(x, k), topk_mask(x, k))


@pytest.mark.usefixtures("interp")
def test_backend_switch_dispatches_to_triton():
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(1, 70, 4, 2, 16, dtype=torch.float32, seed=11)
    ref = nosa_attention(q, k, v, s, cfg)
    out = nosa_attention(q, k, v, s, cfg, backend="triton")
    _close(out, ref.double(), 1e-5)
    assert torch.equal(select_blocks(q, k, s, cfg, backend="triton"), select_blocks(q, k, s, cfg))


@pytest.mark.usefixtures("interp")
def test_cpu_without_interpreter_raises_one_line_error():
    code = ("import torch\nfrom nosa_layers import NOSAConfig\nfrom nosa_layers.ops import nosa_attention_triton\n"
            "q = torch.randn(1, 8, 2, 16); k = torch.randn(1, 8, 1, 16)\n"
            "try:\n    nosa_attention_triton(q, k, k, None, NOSAConfig())\n"
            "except RuntimeError as e:\n    assert '\\n' not in str(e); print('OK', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr


@pytest.mark.skipif(_cf.INTERP_IN_PROCESS or _cf.HAS_CUDA or not _cf.HAS_TRITON,
                    reason="the interpreter tests run in this process")
def test_interp_in_subprocess():
    """triton was imported before tests/ops could choose the interpreter: run them in a fresh process."""
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.usefixtures("interp")
def test_attention_on_strided_views_of_a_fused_qkv_buffer(monkeypatch, tma):
    """q, k, v as megatron hands them over: non-contiguous views of one fused projection.

    Regression: the gradient buffers reused the input strides; with strided views the backward
    wrote out of bounds (an illegal memory access on the GPU during 1B training).
    """
    from nosa_layers.ops import CONFIG, sparse_attention_from_selection

    for kern in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(CONFIG, kern, dict(CONFIG[kern], TMA=tma))
    cfg = tiny_cfg()
    B, T, Hq, Hkv, D = 1, 90, 8, 2, 16
    G = Hq // Hkv
    fused = torch.randn(T, B, Hkv, G + 2, D, generator=torch.Generator().manual_seed(7))  # [s, b, groups, ...]
    fused.requires_grad_(True)
    q = fused[:, :, :, :G].reshape(T, B, Hq, D).transpose(0, 1)      # [b, s, h, d] views, strided
    k = fused[:, :, :, G].transpose(0, 1)
    v = fused[:, :, :, G + 1].transpose(0, 1)
    assert not k.is_contiguous() and not v.is_contiguous()
    s = torch.randn(B, T, Hkv, requires_grad=True)
    sel = select_blocks(q.detach(), k.detach(), s.detach(), cfg)
    out = sparse_attention_from_selection(q, k, v, sel, cfg, bias=s)
    do = torch.randn(B, T, Hq, 2 * D, generator=torch.Generator().manual_seed(8))[..., :D]  # strided dO too
    assert not do.is_contiguous()
    g_fused, g_s = torch.autograd.grad(out, (fused, s), do)
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg, selected=sel)
    r_fused, r_s = torch.autograd.grad(ref, (fused, s), do.double())
    _close(out, ref.detach(), 1e-5)
    _close(g_fused, r_fused, 1e-5)
    _close(g_s, r_s, 1e-5)


@pytest.mark.usefixtures("interp")
def test_union_inflation_counts_union_blocks_and_bitmask_fill():
    """Tiles of 16 rows over 4 blocks: rows that agree give inflation 1 and a full bitmask; two row
    halves with disjoint picks double the union and half-fill each listed block's word."""
    from nosa_layers.ops._index import build_index, union_inflation

    T, bs = 64, 16
    sel = torch.zeros(1, 1, T, 4, dtype=torch.bool)
    for t in range(T):
        sel[0, 0, t, t // bs] = True  # own block only: every row of a tile agrees
    st = union_inflation(build_index(sel, [(0, T)], bs), sel)
    assert st["inflation"] == pytest.approx(1.0) and st["bitmask_fill"] == pytest.approx(1.0) and st["nnz"] == 4
    sel[0, 0, 48:56, 0] = True  # last tile: first half adds block 0, second half block 1
    sel[0, 0, 56:64, 1] = True
    st = union_inflation(build_index(sel, [(0, T)], bs), sel)
    assert st["mean_union_blocks_per_tile"] == pytest.approx((1 + 1 + 1 + 3) / 4)
    assert st["mean_blocks_per_token"] == pytest.approx((48 + 16 * 2) / 64)
    assert st["bitmask_fill"] == pytest.approx((4 * 16 + 8 + 8) / (6 * 16))
