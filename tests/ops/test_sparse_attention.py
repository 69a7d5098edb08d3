"""Block-sparse attention kernels (forward, dQ, dK/dV/db) vs the PyTorch reference, on ``dev``
(compiled on a GPU, the Triton interpreter on CPU), fresh seeds, odd lengths, GQA ratios, packed
documents, every query-tile layout and list splitting."""

import os
import subprocess
import sys

import pytest
import torch

from nosa_layers import document_spans, nosa_attention, select_blocks
from nosa_layers.ops import build_sparse_index, sparse_attention
from tests.nosa.common import random_qkvs, tiny_cfg
from tests.ops.conftest import fp32_tol
from tests.ops.helpers import reference_grads


def _run(dev, B, T, Hq, Hkv, D, dtype=torch.float32, cu=None, bias=True, seed=0, cfg=None, **index_kw):
    cfg = cfg or tiny_cfg()
    q, k, v, s = (x.to(dev) for x in random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=seed))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    sel = select_blocks(q, k, s, cfg, cu_seqlens=cu_t)  # the reference selection, fed to both
    xs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    b = s.clone().requires_grad_(True) if bias else None
    index = build_sparse_index(sel, cfg, T, cu_t, num_q_heads=Hq, **index_kw)
    out = sparse_attention(*xs, index, bias=b)
    do = torch.randn_like(out)
    ins = xs + ([b] if bias else [])
    grads = torch.autograd.grad(out, ins, do)
    ref_out, ref_grads = reference_grads(*xs, b, sel, cfg, do, document_spans(cu_t, T))
    return (out, *grads), (ref_out, *ref_grads)


def _close(a, ref, rel, name=""):
    err = (a.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item() + 1e-6
    assert err <= rel * scale, f"{name}: max error {err:.3e} > {rel:.1e} x {scale:.3e}"


def _all_close(got, ref, rel):
    for name, a, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
        _close(a, r, rel, name)


CASES = [  # B, T, Hq, Hkv, D, cu_seqlens
    pytest.param(1, 100, 16, 2, 16, None, id="G8-T100"),
    pytest.param(1, 75, 16, 1, 16, None, id="G16-T75"),
    pytest.param(2, 67, 4, 2, 32, None, id="B2-G2-T67-D32"),
    pytest.param(1, 150, 8, 1, 16, [0, 37, 37, 101, 150], id="varlen-G8"),
    pytest.param(1, 129, 2, 2, 16, [0, 1, 65, 129], id="G1-one-token-doc"),
    # groups that are not powers of two (SmolLM2 9 / 3, Qwen2.5 14 / 2, 12 / 2): padded query tiles
    pytest.param(1, 100, 6, 2, 16, None, id="G3-T100"),
    pytest.param(1, 150, 9, 1, 16, [0, 37, 150], id="varlen-G9"),
]


@pytest.mark.parametrize("G", [5, 6, 7])
def test_any_group_size(dev, G):
    """Every group size runs, its padding heads' rows masked (tiles of 8 tokens x 8 head rows)."""
    _all_close(*_run(dev, 1, 90, G, 1, 16, seed=G), fp32_tol(dev))


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu", CASES)
def test_fp32_matches_reference(dev, B, T, Hq, Hkv, D, cu):
    _all_close(*_run(dev, B, T, Hq, Hkv, D, cu=cu, seed=T + Hq), fp32_tol(dev))


@pytest.mark.parametrize("qt", [1, 4, 16], ids=lambda x: f"qt{x}")
def test_query_tile_layouts(dev, qt):
    """Any query tile (1 token x 8 heads up to a whole 16-token block x 1 head per program) computes
    the same attention; qt 1 is only an interpreter case (tl.dot needs 16 rows compiled)."""
    if dev.type == "cuda" and qt * 8 < 16:
        pytest.skip("M < 16 rows does not compile")
    _all_close(*_run(dev, 1, 101, 8, 1, 16, cu=[0, 37, 37, 82, 101], seed=qt, qt=qt), fp32_tol(dev))


@pytest.mark.parametrize("chunk,slots", [(1, 1000), (3, 4), (2, 0)], ids=["chunk1", "chunk3-4slots", "no-slots"])
def test_split_inverse_lists(dev, chunk, slots):
    """dK/dV over pieces of the inverse lists (fp32 partials + ordered reduction), with the slot
    budget running out part-way (later lists stay whole) or absent, equals the reference."""
    _all_close(*_run(dev, 1, 150, 8, 2, 16, cu=[0, 37, 37, 150], seed=13, chunk=chunk, max_slots=slots),
               fp32_tol(dev))


@pytest.mark.parametrize("kb", [1, 2], ids=["kb1", "dkdv-kb2"])
def test_key_groups(dev, kb):
    """dK/dV over key groups of one or two KV blocks (documents with odd and even block counts, a
    group cut by its document's end, split lists with a slot budget; 3 of up to 9 blocks per row, so
    a tile often selects one block of a pair and not the other) equals the reference."""
    cfg = tiny_cfg(topk=3, local_blocks=1, select_blocks=1)
    _all_close(*_run(dev, 1, 200, 8, 2, 16, cu=[0, 37, 37, 101, 200], seed=29 + kb, cfg=cfg, kb=kb,
                     chunk=2, max_slots=5), fp32_tol(dev))


def test_fp16_and_no_bias(dev):
    got, ref = _run(dev, 1, 90, 8, 1, 16, dtype=torch.float16, seed=3)
    _close(got[0], ref[0], 5e-3, "out")
    for a, r in zip(got[1:], ref[1:]):
        _close(a, r, 1e-2)
    got, ref = _run(dev, 1, 53, 4, 2, 16, bias=False, seed=4)
    assert len(got) == 4
    _all_close(got, ref, fp32_tol(dev))


def test_row_budget_bounds_the_lists(dev):
    """NOSA selections take at most topk blocks per row: lists capped at qt * topk hold every
    union block (the full count stays in fwd_count)."""
    cfg = tiny_cfg(topk=3, local_blocks=1, select_blocks=1)
    q, k, v, s = (x.to(dev) for x in random_qkvs(1, 160, 8, 2, 16, dtype=torch.float32, seed=21))
    sel = select_blocks(q, k, s, cfg)
    idx = build_sparse_index(sel, cfg, 160, num_q_heads=8, qt=2, row_budget=cfg.topk)
    assert idx.cap == 6 < sel.shape[-1] and int(idx.fwd_count.max()) <= idx.cap
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg, selected=sel)
    _close(sparse_attention(q, k, v, idx, bias=s), ref, fp32_tol(dev))


def test_dispatch_end_to_end_with_triton_selection(dev):
    """``nosa_attention(backend="triton")``: kernel selection + index + attention == reference."""
    cfg = tiny_cfg()
    q, k, v, s = (x.to(dev) for x in random_qkvs(1, 140, 8, 2, 16, dtype=torch.float32, seed=5))
    cu = torch.tensor([0, 60, 61, 140], dtype=torch.int32, device=dev)
    out = nosa_attention(q, k, v, s, cfg, cu_seqlens=cu, backend="triton")
    sel = select_blocks(q, k, s, cfg, cu_seqlens=cu, backend="triton")
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg, cu_seqlens=cu, selected=sel)
    _close(out, ref, fp32_tol(dev))
    if dev.type == "cpu":  # fp32 selection under the interpreter is the reference's
        assert torch.equal(sel, select_blocks(q, k, s, cfg, cu_seqlens=cu))


def test_strided_views_of_a_fused_qkv_buffer(dev):
    """q, k, v as megatron hands them over: non-contiguous views of one fused projection, and a
    strided dO. Regression: gradient buffers that reused the input strides wrote out of bounds."""
    cfg = tiny_cfg()
    B, T, Hq, Hkv, D = 1, 90, 8, 2, 16
    G = Hq // Hkv
    fused = torch.randn(T, B, Hkv, G + 2, D, generator=torch.Generator().manual_seed(7)).to(dev)
    fused.requires_grad_(True)
    q = fused[:, :, :, :G].reshape(T, B, Hq, D).transpose(0, 1)
    k = fused[:, :, :, G].transpose(0, 1)
    v = fused[:, :, :, G + 1].transpose(0, 1)
    assert not k.is_contiguous() and not v.is_contiguous()
    s = torch.randn(B, T, Hkv, device=dev, requires_grad=True)
    out = nosa_attention(q, k, v, s, cfg, backend="triton")
    do = torch.randn(B, T, Hq, 2 * D, generator=torch.Generator().manual_seed(8)).to(dev)[..., :D]
    assert not do.is_contiguous()
    g_fused, g_s = torch.autograd.grad(out, (fused, s), do)
    sel = select_blocks(q.detach(), k.detach(), s.detach(), cfg, backend="triton")
    ref = nosa_attention(q.double(), k.double(), v.double(), s.double(), cfg, selected=sel)
    r_fused, r_s = torch.autograd.grad(ref, (fused, s), do.double())
    _close(out, ref.detach(), fp32_tol(dev), "out")
    _close(g_fused, r_fused, fp32_tol(dev), "d(fused qkv)")
    _close(g_s, r_s, fp32_tol(dev), "dbias")


def test_poisoned_outputs_determinism_and_causality(dev, monkeypatch):
    """Every output element is written (buffers pre-filled with NaN), two runs are bitwise equal, and
    perturbing tokens from t0 on (dO zero from their tile on) leaves out and dQ of every earlier query
    tile bitwise unchanged and the key-side gradients of earlier tokens unchanged up to rounding (the
    perturbed tiles' entries move the dK/dV piece boundaries and the partial-slot budget)."""
    import nosa_layers.ops.attention_op as sa

    monkeypatch.setattr(sa, "POISON_OUTPUTS", True)
    cfg = tiny_cfg()
    T, t0 = (181, 100) if dev.type == "cpu" else (3001, 1700)  # 12 blocks, 6 of them from t0 on
    q, k, v, s = (x.to(dev) for x in random_qkvs(1, T, 8, 2, 16, dtype=torch.float32, seed=17))
    sel = select_blocks(q, k, s, cfg)
    idx = build_sparse_index(sel, cfg, T, num_q_heads=8, chunk=2)
    t_tile = t0 // idx.qt * idx.qt
    do = torch.randn_like(q)
    do[:, t_tile:] = 0

    def run(q, k, v, s, sel):
        index = build_sparse_index(sel, cfg, T, num_q_heads=8, chunk=2)
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
        out = sparse_attention(*xs[:3], index, bias=xs[3])
        return (out, *torch.autograd.grad(out, xs, do))

    a, b = run(q, k, v, s, sel), run(q, k, v, s, sel)
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbias"), a, b):
        assert torch.isfinite(x).all(), f"{name} has unwritten (NaN) entries"
        assert torch.equal(x, y), f"{name} is not bitwise deterministic"
    q2, k2, v2, s2 = (x.clone() for x in (q, k, v, s))
    for x in (q2, k2, v2, s2):
        x[:, t0:] = torch.randn_like(x[:, t0:]) * 3
    sel2 = select_blocks(q2, k2, s2, cfg)
    assert torch.equal(sel2[:, :, :t0], sel[:, :, :t0])  # the selection itself is causal
    c = run(q2, k2, v2, s2, sel2)
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbias"), a, c):
        if name in ("out", "dq"):
            assert torch.equal(x[:, :t_tile], y[:, :t_tile]), f"{name}: rows before {t_tile} changed"
        else:  # later tiles change the list lengths, hence the dK/dV pieces: rounding may move
            _close(y[:, :t_tile], x[:, :t_tile], fp32_tol(dev), name)


def test_cpu_without_interpreter_raises_one_line_error():
    code = ("import torch\nfrom nosa_layers import NOSAConfig\nfrom nosa_layers.ops import select_blocks_triton\n"
            "q = torch.randn(1, 8, 2, 16); k = torch.randn(1, 8, 1, 16)\n"
            "try:\n    select_blocks_triton(q, k, None, NOSAConfig())\n"
            "except RuntimeError as e:\n    assert '\\n' not in str(e); print('OK', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
