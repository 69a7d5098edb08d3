"""Decode step == parallel row; locality (gamma, cache hits) and the paper's bound on every step."""

import pytest
import torch

from nosa_layers import NOSAConfig, measure_locality, nosa_attention, nosa_decode_step, select_blocks
from nosa_layers.locality import locality_from_selections, step_selections
from tests.nosa.common import random_qkvs, tiny_cfg


@pytest.mark.parametrize("evict", [True, False], ids=["ed_dma", "none"])
def test_decode_step_equals_parallel_row(evict):
    cfg = tiny_cfg()
    T = 181
    q, k, v, s = random_qkvs(1, T, 8, 1, 8)  # G = 8
    s = s if evict else None
    par = nosa_attention(q, k, v, s, cfg)
    sel = select_blocks(q, k, s, cfg)
    for t in range(T):
        step = nosa_decode_step(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1],
                                None if s is None else s[:, :t + 1], cfg)
        nb = step.selected.shape[-1]
        assert torch.equal(step.selected, sel[:, :, t, :nb]), t
        torch.testing.assert_close(step.out, par[:, t:t + 1], rtol=1e-12, atol=1e-12)


def test_decode_batch_with_different_cache_lengths():
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(3, 150, 4, 2, 8)
    lens = torch.tensor([150, 67, 101])
    qn = torch.stack([q[b, L - 1] for b, L in enumerate(lens.tolist())])[:, None]
    step = nosa_decode_step(qn, k, v, s, cfg, cache_seqlens=lens)
    for b, L in enumerate(lens.tolist()):
        alone = nosa_attention(q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], s[b:b + 1, :L], cfg)
        torch.testing.assert_close(step.out[b], alone[0, -1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cache_seqlens"):
        nosa_decode_step(qn, k, v, s, cfg, cache_seqlens=torch.tensor([151, 1, 1]))


def test_locality_walk_matches_parallel_rows():
    cfg = tiny_cfg()
    q, k, _, s = random_qkvs(1, 200, 4, 2, 8)
    assert torch.equal(step_selections(q, k, s, cfg, "decode"), step_selections(q, k, s, cfg, "parallel"))


def test_locality_statistics_by_hand():
    """One head, three steps, blocks of 2 tokens: gamma, hits and fetches counted by hand."""
    sel = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    sel[0, 0, 0, [0]] = True
    sel[0, 0, 1, [0]] = True        # t=1: same set -> gamma 1, no fetch
    sel[0, 0, 2, [1, 2]] = True     # t=2: own block 1 is new (on device); block 2 would be a fetch
    st = locality_from_selections(sel, block_size=2)
    assert st.gamma[0, 0, 1] == 1.0 and st.gamma[0, 0, 2] == 0.0
    assert st.fetched[0, 0].tolist() == [0, 0, 1]
    assert st.summary(from_step=0)["hit_rate"] == pytest.approx(3 / 4)  # 3 of 4 lookups resident
    assert st.summary()["hit_rate"] == pytest.approx(2 / 3)  # steps t >= 1 only


@pytest.mark.parametrize("geometry", [
    dict(),                                                        # tiny: k_e = 2, budget 7
    dict(local_blocks=1, select_blocks=1, topk=6),                 # one-block window: k_e = 3
    dict(block_size=8, kernel_size=8, kernel_stride=4, topk=9),    # k_e = 4
])
def test_paper_locality_bound_on_every_step(geometry):
    """gamma(t) >= k_e / k with k_e = topk - (init + local + select), k = topk.

    Holds on every step once the prefix has at least k_e non-forced candidate blocks (before
    that everything causal is selected). The proof (nosa_layers/README.md) also gives the tighter
    per-step bound |S_t ∩ S_{t-1}| >= |forced_t| - [new block] + |E_t|, checked on every step.
    It needs local_blocks >= 1: without a window the newest candidate's pooled score still grows
    while its last windows fill, and E_t can change inside a block.
    """
    cfg = tiny_cfg(**geometry)
    T = 700
    q, k, _, s = random_qkvs(1, T, 4, 2, 8, score_scale=3.0)
    sel = step_selections(q, k, s, cfg, "parallel")
    st = locality_from_selections(sel, cfg.block_size)
    k_e, bs = cfg.query_agnostic_blocks, cfg.block_size
    kept = (sel[:, :, 1:] & sel[:, :, :-1]).sum(-1)
    checked = 0
    for t in range(1, T):
        qb = t // bs
        forced = len(set(range(min(cfg.init_blocks, qb + 1))) | set(range(max(0, qb - cfg.local_blocks), qb + 1)))
        candidates = qb + 1 - forced
        e_t = min(k_e, candidates)
        tight = forced - (1 if t % bs == 0 else 0) + e_t
        assert (kept[:, :, t - 1] >= tight).all(), t
        if candidates >= k_e:
            assert (st.gamma[:, :, t] >= k_e / cfg.topk).all(), t
            checked += 1
    assert checked > T // 2


def test_measure_locality_reports_per_head():
    cfg = tiny_cfg()
    q, k, _, s = random_qkvs(1, 300, 4, 2, 8)
    st = measure_locality(q, k, s, cfg)
    rows = st.per_head()
    assert [r["head"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 < r["gamma_min"] <= r["gamma_mean"] <= 1 and 0 < r["hit_rate"] <= 1
        assert r["selected_per_step"] <= cfg.topk


def test_default_geometry_locality_bound_long_sequence():
    """Released geometry (k_e = 31 of 64) on a sparse 5K-token sequence, parallel rows."""
    cfg = NOSAConfig()
    T = 64 * 80
    q, k, _, s = random_qkvs(1, T, 4, 2, 16, dtype=torch.float32)
    st = measure_locality(q, k, s, cfg, walk="parallel")
    sparse_rows = st.gamma[:, :, 64 * 65:]
    assert (st.selected[:, :, 64 * 65:] == 64).all()
    assert (sparse_rows >= cfg.query_agnostic_blocks / cfg.topk).all()


def test_locality_of_a_packed_sequence_uses_positions_inside_documents():
    """Packed rows: block indices restart per document, so the resident own block is found from the
    position inside the document. Regression: a last document shorter than the longest one indexed
    past the selection's blocks (IndexError during training at step 15 of a 1B run)."""
    from nosa_layers import select_blocks

    cfg = tiny_cfg()
    cu = [0, 150, 190]  # second document shorter than the first: nb comes from the first
    q, k, _, s = random_qkvs(1, 190, 4, 2, 8, seed=3)
    sel = select_blocks(q, k, s, cfg, cu_seqlens=torch.tensor(cu))
    pos = torch.cat([torch.arange(e - a) for a, e in zip(cu[:-1], cu[1:])])
    with pytest.raises(ValueError, match="positions inside each document"):
        locality_from_selections(sel, cfg.block_size)
    st = locality_from_selections(sel, cfg.block_size, positions=pos)
    for a, e in zip(cu[:-1], cu[1:]):  # each document alone gives the same per-row statistics
        one = locality_from_selections(sel[:, :, a:e], cfg.block_size)
        assert torch.equal(st.fetched[..., a + 1:e], one.fetched[..., 1:])
        assert torch.equal(st.gamma[..., a + 1:e], one.gamma[..., 1:])
    st2 = locality_from_selections(sel.expand(2, -1, -1, -1), cfg.block_size, positions=pos.expand(2, -1))
    assert torch.equal(st2.fetched[0], st.fetched[0]) and torch.equal(st2.fetched[1], st.fetched[0])


def test_training_summary_of_packed_layers_equals_per_document_stats():
    from nosa_layers import select_blocks
    from nosa_layers.locality import packed_locality_summary

    cfg = tiny_cfg()
    cu = [0, 150, 190]
    q, k, _, s = random_qkvs(1, 190, 4, 2, 8, seed=4)
    sel = select_blocks(q, k, s, cfg, cu_seqlens=torch.tensor(cu))
    pos = torch.cat([torch.arange(e - a) for a, e in zip(cu[:-1], cu[1:])])[None]
    got = packed_locality_summary([(sel, cfg.block_size), (sel, cfg.block_size)], pos)
    docs = [locality_from_selections(sel[:, :, a:e], cfg.block_size) for a, e in zip(cu[:-1], cu[1:])]
    g = torch.cat([d.gamma[..., 1:].flatten() for d in docs])
    f = torch.cat([d.fetched[..., 1:].float().flatten() for d in docs])
    assert got["nosa_gamma_mean"] == pytest.approx(float(g.mean()))
    assert got["nosa_gamma_min"] == pytest.approx(float(g.min()))
    assert got["nosa_fetched_per_step"] == pytest.approx(float(f.mean()))
    assert packed_locality_summary([], pos) == {}
