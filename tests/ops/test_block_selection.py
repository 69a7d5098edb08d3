"""GPU selection (``select_blocks_triton``: compression, scoring, fused top-k) vs the reference
selection, on ``dev``; packed batches of many documents in one launch."""

import pytest
import torch

from nosa_layers import NOSAConfig, document_spans
from nosa_layers.ops import select_blocks_triton
from nosa_layers.ops.block_selection import block_scores_triton, compress
from nosa_layers.ops.layout import block_layout
from nosa_layers.selection import select_blocks_reference, topk_mask
from tests.nosa.common import random_qkvs, tiny_cfg
from tests.ops.conftest import fp32_tol
from tests.ops.helpers import assert_topk_tie_aware, reference_block_scores


def _scores(q, k, cfg, cu=None):
    layout = block_layout(q.shape[0], q.shape[1], cu, cfg.block_size, q.device)
    kc, _ = compress(k, None, layout, cfg, q.dtype)
    return block_scores_triton(q, kc, layout, cfg)


def _assert_matches_reference(q, k, s, cfg, cu, tol):
    """Equal to the reference selection, or different only where fp64 block scores are within ``tol``
    of a tie in the query-aware stage."""
    got = select_blocks_triton(q, k, s, cfg, cu_seqlens=cu)
    ref = select_blocks_reference(q, k, s, cfg, cu_seqlens=cu)
    assert got.shape == ref.shape and got.dtype == torch.bool
    if torch.equal(got, ref):
        return
    bt = _scores(q, k, cfg, cu)
    for a, e in document_spans(cu, q.shape[1]):
        bref = reference_block_scores(q[:, a:e].cpu(), k[:, a:e].cpu(), cfg)
        nb = bref.shape[-1]
        seen = torch.arange(nb)[None, :] <= (torch.arange(e - a) // cfg.block_size)[:, None]
        bd = bt[:, :, a:e, :nb].cpu().double().masked_fill(~seen, float("-inf"))
        fin = bref.isfinite()
        assert torch.equal(fin, bd.isfinite())
        assert (bd - bref)[fin].abs().max() < tol
        n = min(cfg.topk if s is None else cfg.query_aware_blocks, nb)
        assert_topk_tie_aware(topk_mask(bd.float(), n), topk_mask(bref.float(), n), bref, tol)


CASES = [
    pytest.param(tiny_cfg(), 1, 150, 16, 2, 16, None, True, id="tiny-G8"),
    pytest.param(tiny_cfg(), 1, 150, 9, 3, 16, None, True, id="tiny-G3"),
    pytest.param(tiny_cfg(), 1, 170, 9, 1, 16, [0, 30, 170], True, id="tiny-G9-varlen"),
    pytest.param(tiny_cfg(), 1, 130, 6, 1, 16, None, True, id="tiny-G6"),
    pytest.param(tiny_cfg(), 2, 97, 16, 1, 16, None, True, id="tiny-G16-B2-odd"),
    pytest.param(tiny_cfg(), 1, 200, 4, 2, 16, [0, 37, 37, 150, 200], True, id="tiny-varlen"),
    pytest.param(tiny_cfg(), 1, 120, 4, 2, 16, None, False, id="tiny-no-evict"),
    pytest.param(tiny_cfg(local_blocks=0, select_blocks=3), 1, 130, 4, 2, 16, None, True, id="tiny-local0"),
    pytest.param(tiny_cfg(kernel_size=16, kernel_stride=8), 1, 170, 4, 1, 32, [0, 5, 170], True,
                 id="kernel16-short-doc"),
    pytest.param(NOSAConfig(topk=6, local_blocks=2, select_blocks=2), 1, 700, 8, 1, 16, None, True, id="default-geom"),
    pytest.param(tiny_cfg(), 1, 112, 4, 2, 16, [0, 37, 37, 100, 112], True, id="all-docs-fit-the-budget"),
    pytest.param(tiny_cfg(kernel_size=4), 1, 180, 4, 2, 16, None, True, id="no-trailing-window"),
    pytest.param(tiny_cfg(kernel_size=16), 1, 180, 4, 2, 16, [0, 70, 180], True, id="three-trailing-windows"),
]


@pytest.mark.parametrize("cfg,B,T,Hq,Hkv,D,cu,evict", CASES)
def test_selection_matches_reference(dev, cfg, B, T, Hq, Hkv, D, cu, evict):
    q, k, _, s = (x.to(dev) for x in random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float32, seed=T + D))
    cu_t = None if cu is None else torch.tensor(cu, device=dev)
    _assert_matches_reference(q, k, s if evict else None, cfg, cu_t, fp32_tol(dev))


@pytest.mark.parametrize("T", [133, 390], ids=["one-chunk", "two-chunks"])  # chunks of 16 blocks on CPU
def test_block_scores_match_reference_values(dev, T):
    cfg = tiny_cfg()
    q, k, _, _ = (x.to(dev) for x in random_qkvs(1, T, 8, 2, 16, dtype=torch.float32, seed=9))
    bref = reference_block_scores(q.cpu(), k.cpu(), cfg)
    seen = torch.arange(bref.shape[-1])[None, :] <= (torch.arange(T) // cfg.block_size)[:, None]
    bt = _scores(q, k, cfg).cpu().double().masked_fill(~seen, float("-inf"))
    fin = bref.isfinite()
    assert torch.equal(fin, bt.isfinite()) and torch.equal(bref[~fin], bt[~fin])
    assert (bt - bref)[fin].abs().max() < fp32_tol(dev)


@pytest.mark.parametrize("bw", [16, 32])
def test_lse_chunks_seen_by_every_row_skip_the_mask_and_score_the_same(dev, monkeypatch, bw):
    """The LSE kernel masks only the chunks of windows that some row of a block cannot see yet; with
    narrow chunks most chunks are fully visible (the unmasked loop) in documents that start mid-batch,
    and the block scores still equal the reference's."""
    from nosa_layers.ops.launch import SEL_CONFIG

    cfg = tiny_cfg()
    monkeypatch.setitem(SEL_CONFIG, "lse", dict(SEL_CONFIG["lse"], BW=bw))
    spans = [(0, 61), (61, 61), (61, 330)]
    cu = torch.tensor([0, 61, 61, 330], device=dev)
    q, k, _, _ = (x.to(dev) for x in random_qkvs(1, 330, 8, 2, 16, dtype=torch.float32, seed=50 + bw))
    bt = _scores(q, k, cfg, cu).cpu().double()
    for a, e in spans:
        if e == a:
            continue
        bref = reference_block_scores(q[:, a:e].cpu(), k[:, a:e].cpu(), cfg)
        nb = bref.shape[-1]
        seen = torch.arange(nb)[None, :] <= (torch.arange(e - a) // cfg.block_size)[:, None]
        bd = bt[:, :, a:e, :nb].masked_fill(~seen, float("-inf"))
        fin = bref.isfinite()
        assert torch.equal(fin, bd.isfinite()) and torch.equal(bref[~fin], bd[~fin])
        if e - a > 200:  # (the short document's blocks are all forced: no finite score)
            assert (bd - bref)[fin].abs().max() < fp32_tol(dev)


@pytest.mark.parametrize("hp", [2, 3, 4])
def test_lse_heads_packed_per_program_give_the_same_scores(dev, monkeypatch, hp):
    """The LSE kernel with ``HP`` query heads of a KV group per program (3 -> 2: a divisor of G = 4)
    scores like one head per program, on a packed batch with a document past the budget."""
    from nosa_layers.ops.launch import SEL_CONFIG

    cfg = tiny_cfg()
    cu = torch.tensor([0, 29, 29, 190], device=dev)
    q, k, _, _ = (x.to(dev) for x in random_qkvs(1, 190, 8, 2, 16, dtype=torch.float32, seed=40 + hp))
    one = _scores(q, k, cfg, cu)
    monkeypatch.setitem(SEL_CONFIG, "lse", dict(SEL_CONFIG["lse"], HP=hp))
    packed = _scores(q, k, cfg, cu)
    t = torch.arange(190, device=dev)
    qb = (t - torch.where(t < 29, 0, 29)) // cfg.block_size  # block of each row in its document
    seen = torch.arange(one.shape[-1], device=dev)[None, :] <= qb[:, None]  # the scored columns
    assert torch.allclose(one[:, :, seen], packed[:, :, seen], rtol=1e-5, atol=1e-6)


def test_many_documents_in_one_launch_equal_each_document_alone(dev):
    """A packed sample of 24 documents (lengths 1..40 tokens and longer) selects per document exactly
    what each document selects alone, with every kernel launched once for the whole batch."""
    cfg = tiny_cfg()
    g = torch.Generator().manual_seed(31)
    lens = torch.randint(1, 41, (24,), generator=g).tolist() + [150]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev)
    q, k, _, s = (x.to(dev) for x in random_qkvs(1, T, 4, 2, 16, dtype=torch.float32, seed=32))
    packed = select_blocks_triton(q, k, s, cfg, cu_seqlens=cu)
    for a, e in document_spans(cu, T):
        alone = select_blocks_triton(q[:, a:e], k[:, a:e], s[:, a:e], cfg)
        assert torch.equal(packed[:, :, a:e, :alone.shape[-1]], alone)
        assert not packed[:, :, a:e, alone.shape[-1]:].any()
