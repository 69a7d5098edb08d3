"""The hand-scheduled Hopper forward (one list entry per step, ``attention_sm90``, and two,
``attention_sm90_pairs``, the default), dQ and dK/dV (Gluon: async loads into rings of slots +
overlapped wgmma) against the PyTorch reference and the Triton kernels, on an sm90 GPU only (wgmma is Hopper-only and
Gluon has no interpreter): bf16 / fp16, head dims 64 and 128, GQA ratios 1-16 (3, 6 and 9 too), odd lengths, packed
documents, two batch rows (a block past the last row's end is zero-filled by TMA, one past the
first row's end reads the next row's first keys, masked), ring depths 2-4, A operands from shared
memory or registers. The sm90 compile check of ``test_arch`` covers these kernels on CPU."""

import sys

import pytest
import torch

from nosa_layers import NOSAConfig, document_spans, nosa_attention, select_blocks
from nosa_layers.ops import attention_op, build_sparse_index, launch, sparse_attention
from nosa_layers.ops.sparse_index import query_tile
from tests.nosa.common import random_qkvs
from tests.ops.helpers import reference_grads


@pytest.fixture
def hopper(cuda):
    if torch.cuda.get_device_capability(cuda) != (9, 0):
        pytest.skip("needs an sm90 (Hopper) GPU")
    return cuda


def _config(monkeypatch, kernel, **over):
    cfg = launch.CONFIG["sm90"]
    monkeypatch.setitem(cfg, kernel, dict(cfg[kernel], **over))


CFG = NOSAConfig(topk=12, local_blocks=2, select_blocks=6).validate()  # partial selections at T ~ 2-3K
CASES = [  # B, T, Hq, Hkv, D, cu_seqlens, dtype
    pytest.param(1, 3000, 16, 2, 128, None, torch.bfloat16, id="G8-T3000-D128"),
    pytest.param(1, 2113, 16, 1, 128, [0, 700, 701, 2113], torch.bfloat16, id="G16-docs"),
    pytest.param(2, 1100, 16, 2, 128, None, torch.bfloat16, id="B2-G8"),
    pytest.param(1, 2500, 8, 2, 64, [0, 1000, 2500], torch.float16, id="G4-D64-fp16"),
    pytest.param(1, 1999, 2, 2, 128, None, torch.bfloat16, id="G1-T1999"),
    # groups that are not powers of two: query tiles padded to 4 / 8 / 16 head rows (SmolLM2 is 9 / 3, D 64)
    pytest.param(1, 2200, 9, 3, 64, [0, 900, 2200], torch.bfloat16, id="G3-D64-docs"),
    pytest.param(1, 1700, 6, 1, 128, None, torch.bfloat16, id="G6-T1700"),
    pytest.param(1, 1800, 9, 1, 64, None, torch.float16, id="G9-D64-fp16"),
]


def _inputs(dev, B, T, Hq, Hkv, D, cu, dtype, seed, **index_kw):
    q, k, v, s = (x.to(dev) for x in random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=seed))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    sel = select_blocks(q, k, s, CFG, cu_seqlens=cu_t)
    idx = build_sparse_index(sel, CFG, T, cu_t, num_q_heads=Hq, **index_kw)
    return q.to(dtype), k.to(dtype), v.to(dtype), s, sel, idx, cu_t


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _assert_forward_matches(got_o, got_lse, want_o, want_lse, qkvs, sel, cu_t):
    """A Hopper forward's output and LSE against the Triton forward's and the fp64 reference's."""
    valid = torch.isfinite(want_lse)
    assert torch.equal(valid, torch.isfinite(got_lse))
    assert (got_lse[valid] - want_lse[valid]).abs().max().item() < 2e-3
    assert _max_err(got_o, want_o) < 2e-2
    ref = nosa_attention(*(x.double() for x in qkvs), CFG, selected=sel, cu_seqlens=cu_t)
    assert _max_err(got_o, ref) < 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("stages,regs", [(2, False), (3, True), (4, False)], ids=["s2", "s3-regs", "s4"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", CASES)
def test_hopper_forward_matches_reference_and_triton(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype, stages, regs):
    q, k, v, s, sel, idx, cu_t = _inputs(hopper, B, T, Hq, Hkv, D, cu, dtype, seed=T + Hq + stages)
    _config(monkeypatch, "fwd", impl="triton")
    want_o, want_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    _config(monkeypatch, "fwd", impl="gluon", num_stages=stages, regs=regs, keys_per_step=64)
    assert attention_op.hopper_kernel(q, idx, attention_op.heads_per_program(Hq // Hkv, idx.qt, 64),
                                      launch.CONFIG["sm90"]["fwd"])
    got_o, got_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    assert torch.isfinite(got_o).all()
    _assert_forward_matches(got_o, got_lse, want_o, want_lse, (q, k, v, s), sel, cu_t)


PAIR_CASES = CASES + [  # 33 single-tile lists: odd and even list lengths
    pytest.param(1, 2100, 1, 1, 128, None, torch.bfloat16, id="G1-T2100")]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", PAIR_CASES)
def test_pair_forward_matches_reference_and_triton(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype):
    """The default Hopper forward, two list entries (128 keys) per step (``attention_sm90_pairs``; odd
    and even list lengths, an odd list's last pair half empty): output and LSE as the Triton forward's
    and the reference's, every row written."""
    q, k, v, s, sel, idx, cu_t = _inputs(hopper, B, T, Hq, Hkv, D, cu, dtype, seed=7 * T + Hq)
    assert (idx.fwd_count % 2 == 1).any() and (idx.fwd_count % 2 == 0).any()
    _config(monkeypatch, "fwd", impl="triton")
    want_o, want_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    monkeypatch.setattr(attention_op, "POISON_OUTPUTS", True)  # rows the kernel missed stay NaN
    _config(monkeypatch, "fwd", impl="gluon", keys_per_step=128)
    got_o, got_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    torch.cuda.synchronize()
    assert torch.isfinite(got_o).all()
    _assert_forward_matches(got_o, got_lse, want_o, want_lse, (q, k, v, s), sel, cu_t)


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", CASES[:4])
def test_hopper_forward_and_dq_over_128_row_tiles(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype):
    """Query tiles of 128 rows (two warpgroups sharing each K / V block the ring loads): output, LSE
    and dQ as the Triton kernels' on the same index, and the reference's."""
    G = Hq // Hkv
    qt = query_tile(G, 64, 128)[0]
    q, k, v, s, sel, idx, cu_t = _inputs(hopper, B, T, Hq, Hkv, D, cu, dtype, seed=11 * T + Hq, qt=qt)
    hp = attention_op.heads_per_program(G, qt, 128)
    assert hp * qt == 128
    for kernel in ("fwd", "dq"):
        _config(monkeypatch, kernel, impl="triton", rows=128)
    want_o, want_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    do = torch.randn_like(want_o)
    want = attention_op.attention_backward(q, k, v, s, want_o, want_lse, do, idx, D ** -0.5, True)
    for kernel in ("fwd", "dq"):
        _config(monkeypatch, kernel, impl="gluon", rows=128)
        assert attention_op.hopper_kernel(q, idx, hp, launch.CONFIG["sm90"][kernel])
    got_o, got_lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    _assert_forward_matches(got_o, got_lse, want_o, want_lse, (q, k, v, s), sel, cu_t)
    got = attention_op.attention_backward(q, k, v, s, want_o, want_lse, do, idx, D ** -0.5, True)
    assert torch.isfinite(got[0]).all()
    assert _max_err(got[0], want[0]) <= 2e-2 * want[0].abs().max().item()
    for a, b in zip(got[1:], want[1:]):  # dK, dV, db: the same kernels
        assert torch.equal(a, b)


@pytest.mark.parametrize("stages,regs", [(2, False), (2, True), (3, False)], ids=["s2", "s2-regs", "s3"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", CASES)
def test_hopper_dq_matches_reference_and_triton(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype, stages, regs):
    q, k, v, s, sel, idx, cu_t = _inputs(hopper, B, T, Hq, Hkv, D, cu, dtype, seed=3 * T + Hq + stages)
    o, lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    do = torch.randn_like(o)
    _config(monkeypatch, "dq", impl="triton")
    want = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, D ** -0.5, True)
    _config(monkeypatch, "dq", impl="gluon", num_stages=stages, regs=regs)
    got = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, D ** -0.5, True)
    assert torch.isfinite(got[0]).all()
    assert _max_err(got[0], want[0]) <= 2e-2 * want[0].abs().max().item()
    for a, b in zip(got[1:], want[1:]):  # dK, dV, db: the same kernels
        assert torch.equal(a, b)
    xs = [x.double().requires_grad_(True) for x in (q, k, v)]
    _, ref = reference_grads(*xs, s.double().requires_grad_(True), sel, CFG, do.double(), document_spans(cu_t, T))
    assert _max_err(got[0], ref[0]) <= 3e-2 * ref[0].abs().max().item()


@pytest.mark.parametrize("kb,rows,stages,chunk", [(2, 32, 4, None), (1, 64, 3, None), (2, 32, 2, 3), (2, 16, 3, 5)],
                         ids=["kb2-r32-s4", "kb1-r64-s3", "kb2-s2-split", "kb2-r16-split"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,cu,dtype", CASES)
def test_hopper_dkdv_matches_reference_and_triton(hopper, monkeypatch, B, T, Hq, Hkv, D, cu, dtype, kb, rows, stages,
                                                  chunk):
    """dK, dV, db of one- and two-block key groups, whole lists and lists split into pieces (fp32
    partials + the ordered reduction), 16-64 query rows per step."""
    q, k, v, s, sel, idx, cu_t = _inputs(hopper, B, T, Hq, Hkv, D, cu, dtype, seed=5 * T + Hq + kb, kb=kb, chunk=chunk,
                                         max_slots=None if chunk is None else 1000)
    o, lse, _ = attention_op.attention_forward(q, k, v, s, idx, D ** -0.5)
    do = torch.randn_like(o)
    _config(monkeypatch, "dkdv", impl="triton", rows=rows, num_warps=4 * kb, num_stages=2)
    want = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, D ** -0.5, True)
    _config(monkeypatch, "dkdv", impl="gluon", num_stages=stages)
    got = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, D ** -0.5, True)
    assert torch.equal(got[0], want[0])  # dQ: the same kernel
    xs = [x.double().requires_grad_(True) for x in (q, k, v)]
    _, ref = reference_grads(*xs, s.double().requires_grad_(True), sel, CFG, do.double(), document_spans(cu_t, T))
    for name, a, b, r in zip(("dk", "dv", "db"), got[1:], want[1:], ref[1:]):
        assert torch.isfinite(a).all(), name
        assert _max_err(a, b) <= 2e-2 * b.float().abs().max().item(), name
        assert _max_err(a, r) <= 3e-2 * r.abs().max().item(), name


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_hopper_kernels_train_like_triton(hopper, monkeypatch, bias):
    """Training through the Hopper kernels, with and without a bias: output and every gradient match
    the Triton kernels'."""
    q, k, v, s, sel, idx, _ = _inputs(hopper, 1, 2300, 16, 2, 128, None, torch.bfloat16, seed=7)
    do = torch.randn_like(q)
    grads = {}
    for impl in ("triton", "gluon"):
        for kernel in ("fwd", "dq", "dkdv"):
            _config(monkeypatch, kernel, impl=impl)
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        b = [s.clone().requires_grad_(True)] if bias else []
        out = sparse_attention(*xs, idx, bias=b[0] if bias else None)
        grads[impl] = (out, *torch.autograd.grad(out, [*xs, *b], do))
    assert len(grads["gluon"]) == (5 if bias else 4)
    for name, a, w in zip(("out", "dq", "dk", "dv", "db"), grads["gluon"], grads["triton"]):
        assert _max_err(a, w) <= 2e-2 * w.float().abs().max().item(), name


def test_the_dq_takes_the_forwards_key_major_bias(hopper, monkeypatch):
    """A training step builds the key-major bias once: the Hopper forward's copy goes to the dQ (one
    ``key_major_bias`` call per step, not two), and the gradients equal those of a dQ that builds its own."""
    q, k, v, s, sel, idx, _ = _inputs(hopper, 1, 2300, 16, 2, 128, [0, 900, 2300], torch.bfloat16, seed=11)
    do = torch.randn_like(q)
    o, lse, kbias = attention_op.attention_forward(q, k, v, s, idx, 128 ** -0.5)
    assert torch.equal(kbias, launch.sm90_kernels().key_major_bias(s, idx.block))
    own = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, 128 ** -0.5, True)
    given = attention_op.attention_backward(q, k, v, s, o, lse, do, idx, 128 ** -0.5, True, kbias)
    for a, b in zip(own, given):
        assert torch.equal(a, b)
    sm90 = launch.sm90_kernels()
    calls = []
    build = sm90.key_major_bias
    monkeypatch.setattr(sm90, "key_major_bias", lambda *a: calls.append(1) or build(*a))
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
    out = sparse_attention(*xs[:3], idx, bias=xs[3])
    grads = torch.autograd.grad(out, xs, do)
    assert len(calls) == 1
    for a, b in zip(grads, own):
        assert torch.equal(a, b.to(a.dtype))


def test_impl_is_checked(monkeypatch):
    _config(monkeypatch, "fwd", impl="cuda")
    with pytest.raises(ValueError, match="impl must be"):
        attention_op.hopper_kernel(torch.zeros(1, 64, 8, 128), None, 8, launch.CONFIG["sm90"]["fwd"])


@pytest.fixture
def no_sm90_module(monkeypatch):
    """``attention_sm90`` cannot be imported, and ``sm90_kernels`` looks again (cache cleared around)."""
    monkeypatch.setitem(sys.modules, "nosa_layers.ops.attention_sm90", None)  # the import now fails
    monkeypatch.delattr(sys.modules["nosa_layers.ops"], "attention_sm90", raising=False)
    launch.sm90_kernels.cache_clear()
    yield
    launch.sm90_kernels.cache_clear()


def test_without_gluon_the_triton_kernels_run(no_sm90_module):
    """A triton without the Gluon Hopper API: one warning, and every kernel takes the Triton path."""
    with pytest.warns(UserWarning, match="need Gluon"):
        assert launch.sm90_kernels() is None


def test_an_older_triton_takes_the_triton_kernels(no_sm90_module, monkeypatch):
    """A triton older than the Gluon API the Hopper kernels are written for: one warning, no import."""
    monkeypatch.setattr(launch.triton, "__version__", "3.4.0")
    with pytest.warns(UserWarning, match="older than 3.6"):
        assert launch.sm90_kernels() is None


def test_dkdv_groups_follow_the_kernel_that_runs(monkeypatch):
    """The index's dK/dV key groups are the Hopper kernel's (one block) where it can run, else the
    Triton kernel's own (two blocks, four stages): the interpreter / CPU here."""
    cpu = torch.device("cpu")
    assert launch.hopper_device(cpu) is False
    triton_cfg = launch.launch_config(cpu)["dkdv"]
    assert (triton_cfg["blocks"], triton_cfg["num_stages"]) == (2, 4)
    monkeypatch.setattr(launch, "hopper_device", lambda device: True)
    hopper_cfg = launch.launch_config(cpu)["dkdv"]
    assert (hopper_cfg["blocks"], hopper_cfg["num_stages"], hopper_cfg["impl"]) == (1, 3, "gluon")


@pytest.mark.skipif(launch.sm90_kernels() is None, reason="needs a triton with Gluon")
@pytest.mark.parametrize("dtype,D,block,hopper", [(torch.bfloat16, 128, 64, True), (torch.float16, 64, 64, True),
                                                  (torch.bfloat16, 256, 64, False), (torch.float32, 128, 64, False),
                                                  (torch.bfloat16, 128, 32, False)])
def test_a_shape_the_hopper_dkdv_does_not_cover_keeps_the_triton_groups(monkeypatch, dev, dtype, D, block, hopper):
    """On a Hopper GPU (stood in for here), an index built for queries the Hopper dK/dV does not cover
    (head dim 256, fp32, 32-key blocks) gets the Triton kernel's two-block groups, as that kernel runs."""
    monkeypatch.setattr(launch, "hopper_device", lambda device: True)
    T, Hq, Hkv = 300, 4, 2
    q = torch.zeros(1, T, Hq, D, dtype=dtype, device=dev)
    assert launch.launch_config(dev, q, block)["dkdv"]["blocks"] == (1 if hopper else 2)
    cfg = NOSAConfig(block_size=block, kernel_size=block // 2, kernel_stride=block // 4, topk=4, local_blocks=1,
                     select_blocks=2).validate()
    own = torch.arange(T, device=dev)[:, None] // block  # every block up to the token's own (causal)
    sel = (torch.arange(-(-T // block), device=dev)[None, :] <= own).expand(1, Hkv, T, -1).contiguous()
    idx = build_sparse_index(sel, cfg, T, None, num_q_heads=Hq, q=q)
    assert idx.kb == (1 if hopper else 2)


@pytest.mark.skipif(launch.sm90_kernels() is None, reason="needs a triton with Gluon")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hopper_bias_layout(dtype):
    """The forward / dQ read a list entry's bias as ``block`` unmasked consecutive values of the key-major
    copy: each head's keys in a row, in log2 units, with ``block`` zeros past the end (a block starting at
    any key, however close to the end, stays inside its row)."""
    B, T, Hkv, block = 2, 37, 3, 64
    bias = torch.randn(B, T, Hkv).to(dtype)
    got = launch.sm90_kernels().key_major_bias(bias, block)
    assert got.dtype == torch.float32 and got.shape == (B, Hkv, T + block) and got.stride(-1) == 1
    want = bias.float().permute(0, 2, 1) * attention_op.LOG2E
    assert torch.equal(got[..., :T], want)
    assert not got[..., T:].any()
    assert launch.sm90_kernels().key_major_bias(None, block) is None


def test_the_triton_forward_keeps_its_own_stages(monkeypatch):
    """The Hopper forward's 3 K/V slots are its own: where the Triton forward runs instead (here on
    CPU / the interpreter; on a Hopper GPU for queries the Hopper kernels do not cover, e.g. head dim
    256, where 3 stages take 225 KB of shared memory against 160 KB, one program per SM) it keeps the
    2 stages measured for it."""
    cpu = torch.device("cpu")
    assert launch.launch_config(cpu)["fwd"]["num_stages"] == 2
    monkeypatch.setattr(launch, "hopper_device", lambda device: True)
    assert launch.launch_config(cpu)["fwd"]["num_stages"] == 3
    if launch.sm90_kernels() is not None:
        q256 = torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16)
        assert launch.launch_config(cpu, q256, 64)["fwd"]["num_stages"] == 2
        assert launch.launch_config(cpu, q256[..., :128], 64)["fwd"]["num_stages"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_major_bias_layout(dtype):
    """``key_major_bias``: fp32 ``[B, Hkv, T + block]``, each head's keys contiguous in log2 units (the
    bias upcast before the product), ``block`` zeros past the end (runs anywhere: plain torch ops)."""
    from nosa_layers.ops._common import LOG2E
    from nosa_layers.ops.attention_sm90 import key_major_bias

    g = torch.Generator().manual_seed(11)
    bias = torch.randn(2, 37, 3, generator=g).to(dtype)
    out = key_major_bias(bias, 64)
    assert out.shape == (2, 3, 37 + 64) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out[..., :37], bias.float().permute(0, 2, 1) * LOG2E)
    assert torch.equal(out[..., 37:], torch.zeros(2, 3, 64))
    assert key_major_bias(None, 64) is None
