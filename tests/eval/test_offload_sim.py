"""The offloading-decoder simulator on hand-computed cases, and against nosa_layers' own cache model."""

import numpy as np
import pytest
import torch

from eval import offload_sim as sim


def _sets(T, nb, steps):
    s = np.zeros((1, T, nb), dtype=bool)
    for t, blocks in enumerate(steps):
        s[0, t, list(blocks)] = True
    return s


# block_size 1: the own block of step t is block t (always in S_t, as in NOSA)
STEPS = [{0}, {0, 1}, {0, 2}, {1, 3}, {0, 4}, {1, 5}]


def test_lru_hand_computed():
    # t3: cache {0,1,2,3} > 3 -> evict LRU among {0,2} (both last used at t2: lower index 0) -> {1,2,3}
    # t4: need {0,4}: 0 missing (fetch); cache {0,1,2,3,4} -> evict 2 (t2), then 1 (t3, tie with 3) -> {0,3,4}
    # t5: need {1,5}: 1 missing (fetch); cache {0,1,3,4,5} -> evict 3 (t3), then 0 (t4, tie with 4)
    tr = sim.simulate_cache(_sets(6, 6, STEPS), block_size=1, capacity=3, policy="lru")
    assert tr.needed.tolist() == [[1, 2, 2, 2, 2, 2]]
    assert tr.hits.tolist() == [[1, 2, 2, 2, 1, 1]]
    assert tr.fetched.tolist() == [[0, 0, 0, 0, 1, 1]]


def test_score_policy_hand_computed():
    scores = np.array([[5.0, 1.0, 4.0, 2.0, 3.0, 0.0]])
    # t3: evict the lower score of {0: 5, 2: 4} -> 2; t4: need {0,4} both resident, evict 1 (score 1 < 2)
    # t5: need {1,5}: fetch 1; evict 3 (2.0) then 4 (3.0) -> {0,1,5}
    tr = sim.simulate_cache(_sets(6, 6, STEPS), block_size=1, capacity=3, policy="score", block_scores=scores)
    assert tr.hits.tolist() == [[1, 2, 2, 2, 2, 1]]
    assert tr.fetched.tolist() == [[0, 0, 0, 0, 0, 1]]
    hit_rate = tr.hits.sum() / tr.needed.sum()
    assert hit_rate == pytest.approx(10 / 11)


def test_previous_policy_keeps_only_the_last_selection():
    tr = sim.simulate_cache(_sets(6, 6, STEPS), block_size=1, capacity=0, policy="previous")
    assert tr.fetched.tolist() == [[0, 0, 0, 1, 1, 1]]


def test_capacity_below_one_selection_is_refused():
    with pytest.raises(ValueError, match="capacity 1 blocks is below"):
        sim.simulate_cache(_sets(6, 6, STEPS), block_size=1, capacity=1, policy="lru")


def test_bytes_and_throughput_hand_computed():
    geo = sim.KVGeometry(num_kv_heads=2, head_dim=64, block_size=64)
    assert geo.block_bytes == 64 * 64 * 2 * 2 == 16384  # 64 tokens x D x (K, V) x bf16
    out = sim.offload_summary(np.array([2, 4]), np.array([10, 10]), geo, bandwidth_gb_s=55.0)
    assert out["bytes_per_token"] == 3 * 16384
    assert out["dense_bytes_per_token"] == 10 * 16384
    assert out["decode_tokens_per_s"] == pytest.approx(55e9 / (3 * 16384))
    assert out["throughput_ratio_vs_dense"] == pytest.approx(10 / 3)
    assert sim.offload_summary(np.zeros(3), np.zeros(3), geo, 55.0)["decode_tokens_per_s"] is None
    # dense: whole prefix less the pinned blocks; blocks of 4 tokens, 2 pinned
    assert sim.dense_fetched_per_head(13, block_size=4, capacity=2).tolist() == [0] * 8 + [1] * 4 + [2]


def test_pooled_block_scores_hand_computed():
    # block 4, windows of 2 every 2: means 2, 6, 0, 2; block 0 pools windows 0-1, block 1 windows 2-3
    score = np.array([1, 3, 5, 7, 0, 0, 2, 2], dtype=float)[:, None]
    assert sim.pooled_block_scores(score, 4, 2, 2).tolist() == [[6.0, 2.0]]
    assert np.isneginf(sim.pooled_block_scores(score[:1], 4, 2, 2)).all()


def test_pooled_scores_rank_blocks_as_the_selection_does():
    """Every step's top k_e non-forced blocks by the pooled score are selected (the locality lemma of
    nosa_layers/README.md), so the pooling is the selection's query-agnostic ranking."""
    from nosa_layers import NOSAConfig, select_blocks

    cfg = NOSAConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2, select_blocks=2,
                     topk=9).validate()
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 320, 4, 2, 8
    q, k = torch.randn(1, T, Hq, D, generator=g), torch.randn(1, T, Hkv, D, generator=g)
    score = torch.rand(1, T, Hkv, generator=g)
    sel = select_blocks(q, k, score, cfg)[0].numpy()  # [Hkv, T, nb]
    blocks = sim.pooled_block_scores(score[0].numpy(), cfg.block_size, cfg.kernel_size, cfg.kernel_stride)
    k_e, checked = cfg.query_agnostic_blocks, 0
    for h in range(Hkv):
        for t in range(T):
            qb = t // cfg.block_size
            cand = [m for m in range(qb + 1) if m >= cfg.init_blocks and m < qb - cfg.local_blocks]
            if len(cand) < k_e:
                continue
            top = sorted(cand, key=lambda m: (-blocks[h, m], m))[:k_e]
            assert sel[h, t, top].all(), (h, t, top)
            checked += 1
    assert checked > 300


def test_previous_policy_equals_measure_locality():
    from nosa_layers import NOSAConfig, measure_locality, select_blocks

    cfg = NOSAConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2, select_blocks=2,
                     topk=6, eviction_head="ed_dma").validate()
    g = torch.Generator().manual_seed(1)
    q, k, score = torch.randn(1, 256, 4, 8, generator=g), torch.randn(1, 256, 2, 8, generator=g), torch.rand(1, 256, 2)
    stats = measure_locality(q, k, score, cfg, walk="parallel")
    sel = select_blocks(q, k, score, cfg)[0].numpy()
    tr = sim.simulate_cache(sel, cfg.block_size, 0, "previous")
    assert (tr.fetched == stats.fetched[0].numpy()).all() and (tr.hits == stats.hits[0].numpy()).all()
    # a cache as large as the budget + window never does worse than keeping only the last selection
    lru = sim.simulate_cache(sel, cfg.block_size, cfg.topk + cfg.local_blocks, "lru")
    assert lru.fetched.sum() <= tr.fetched.sum()


def test_locality_says_when_it_measured_nothing():
    """At the released geometry (budget 64 x 64 tokens, cache 64 + 16 blocks) 1024 tokens select nothing and
    5120 tokens evict nothing: the result and its line say so with the length that would; 8192 measures both."""
    from eval.locality import measured_nothing, summary_line
    from nosa_layers.config import NOSAConfig

    n = NOSAConfig()
    (short,) = measured_nothing(n, 1024, 80, sparse=True)
    assert short.startswith("nothing sparse: 1024 tokens") and "--length 4097" in short
    (fits,) = measured_nothing(n, 5120, 80, sparse=True)
    assert fits.startswith("nothing evicted: the whole document (80 blocks)") and "--length 5121" in fits
    assert measured_nothing(n, 5121, 80, sparse=True) == []  # 81 blocks: one eviction per step
    assert measured_nothing(n, 8192, 80, sparse=True) == []
    assert measured_nothing(n, 1024, 80, sparse=False)[0].startswith("nothing evicted")  # a dense model
    offload = {"bytes_per_token": 0.0, "dense_bytes_per_token": 0.0, "decode_tokens_per_s": None,
               "throughput_ratio_vs_dense": 1.0, "bandwidth_gb_s": 55.0}
    r = {"dense": True, "summary": {**offload, "warnings": [fits]}}
    assert summary_line(r).endswith(f"(1.00x dense); warning: {fits}")
