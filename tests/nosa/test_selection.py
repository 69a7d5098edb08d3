"""Block selection: spec fidelity (independent brute force), causality, budget, geometry."""

import pytest
import torch

from nosa_layers import NOSAConfig, select_blocks
from nosa_layers.selection import block_window_index, select_blocks_reference
from tests.nosa.brute_force import brute_force_selection
from tests.nosa.common import random_qkvs, tiny_cfg


def selected_sets(sel, b, t):
    return {h: set(torch.nonzero(sel[b, h, t]).flatten().tolist()) for h in range(sel.shape[1])}


@pytest.mark.parametrize("T,Hq,Hkv,evict,geometry", [
    (157, 4, 2, True, {}),    # odd length, G=2
    (130, 8, 1, True, {}),    # G=8
    (97, 6, 3, False, {}),    # query-aware only (InfLLM-V2), G=2
    (203, 16, 1, True, {}),   # G=16
    (150, 4, 2, True, dict(local_blocks=0, select_blocks=1, topk=5)),  # no window: causal fill
    (140, 4, 2, True, dict(init_blocks=0, kernel_size=16, kernel_stride=8)),  # no sink, 16/8 windows
], ids=["T157-G2", "T130-G8", "T97-G2-none", "T203-G16", "no-window", "no-sink-k16s8"])
def test_selection_equals_brute_force_on_every_prefix(T, Hq, Hkv, evict, geometry):
    q, k, _, s = random_qkvs(2, T, Hq, Hkv, 8)
    cfg = tiny_cfg(**geometry)
    sel = select_blocks(q, k, s if evict else None, cfg)
    for b in range(2):
        for t in range(T):
            assert selected_sets(sel, b, t) == brute_force_selection(q, k, s if evict else None, cfg, b, t), (b, t)


def _two_stage_by_loops(b_qa, b_qg, forced, future, cfg):
    """The two stages of one row written out: rank by (-score, index), stage-1 and forced blocks first."""
    nb, inf = len(b_qa), float("inf")
    a = {m: b_qa[m] if not future[m] else -inf for m in range(nb)}
    if b_qg is None:
        ranked = a
    else:
        stage1 = set(sorted(range(nb), key=lambda m: (-a[m], m))[:min(cfg.query_aware_blocks, nb)])
        ranked = {m: -inf if future[m] else (inf if forced[m] or m in stage1 else b_qg[m]) for m in range(nb)}
    return sorted(range(nb), key=lambda m: (-ranked[m], m))[:min(cfg.topk, nb)]


@pytest.mark.parametrize("geometry", [{}, dict(topk=12, select_blocks=5), dict(init_blocks=0, local_blocks=0,
                                                                            select_blocks=1, topk=3)])
@pytest.mark.parametrize("evict", [True, False])
def test_two_stages_on_tied_block_scores_follow_the_rule(geometry, evict):
    """``two_stage_blocks`` (the one rule behind ``select_rows``, the top-k kernel's torch reference and the
    exported model's decode) against the rule written as loops, on integer scores with +-inf and many ties."""
    from nosa_layers.selection import two_stage_blocks

    cfg = tiny_cfg(**geometry)
    g = torch.Generator().manual_seed(len(geometry) * 2 + evict)
    rows, nb = 40, 13
    qb = torch.randint(0, nb, (rows, 1), generator=g)
    blk = torch.arange(nb)
    forced = (blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb))
    future = blk > qb
    special = torch.tensor([float("inf"), float("-inf"), 0.0])

    def scores():
        x = torch.randint(0, 3, (2, rows, nb), generator=g).double()
        pick = torch.rand(x.shape, generator=g) < 0.2
        return torch.where(pick, special[torch.randint(0, 3, x.shape, generator=g)], x)

    b_qa = scores().masked_fill(forced, float("inf"))
    b_qg = scores() if evict else None
    got = two_stage_blocks(b_qa, b_qg, forced, future, cfg)
    assert got.shape == (2, rows, min(cfg.topk, nb))
    for h in range(2):
        for r in range(rows):
            want = _two_stage_by_loops(b_qa[h, r].tolist(), None if b_qg is None else b_qg[h, r].tolist(),
                                       forced[r].tolist(), future[r].tolist(), cfg)
            assert got[h, r].tolist() == want, (h, r)


def test_selection_budget_forced_and_causal():
    cfg = tiny_cfg()
    T = 300
    q, k, _, s = random_qkvs(1, T, 4, 2, 8)
    sel = select_blocks(q, k, s, cfg)
    nb = sel.shape[-1]
    for t in range(T):
        qb = t // cfg.block_size
        row = sel[0, :, t]
        assert not row[:, qb + 1:].any(), "future block selected"
        assert row[:, :cfg.init_blocks].all() and row[:, max(0, qb - cfg.local_blocks):qb + 1].all()
        assert (row.sum(-1) == min(cfg.topk, qb + 1)).all(), "budget not used exactly"
    assert nb == -(-T // cfg.block_size)


def test_query_agnostic_fill_follows_eviction_score():
    """With one candidate block given a huge score it is always kept once it leaves the window."""
    cfg = tiny_cfg()
    T = 320
    q, k, _, s = random_qkvs(1, T, 4, 2, 8)
    s[:, 16 * 3:16 * 4] = 100.0  # block 3 (all its windows) dominates the eviction score
    sel = select_blocks(q, k, s, cfg)
    rows = torch.arange(16 * 7, T)  # block 3 is out of the forced window from block 6 on
    assert sel[0, :, rows, 3].all()
    sel_none = select_blocks(q, k, None, cfg)  # without the score it is not always kept
    assert not sel_none[0, :, rows, 3].all()


def test_reference_window_pooling_geometry():
    """For 64/32/16 block m pools windows 4m-1 .. 4m+3 (those overlapping its tokens)."""
    cfg = NOSAConfig()
    nw = cfg.num_windows(64 * 10)
    idx = block_window_index(cfg, 10, nw)
    for m in range(10):
        expect = [w for w in range(4 * m - 1, 4 * m + 4) if 0 <= w < nw]
        assert sorted(i for i in idx[m].tolist() if i < nw) == expect


@pytest.mark.parametrize("T", [1, 7, 31, 33, 64, 65, 200])
def test_default_geometry_short_sequences_select_every_causal_block(T):
    """Below 64 blocks everything causal is selected, including T < 32 (no compressed window)."""
    cfg = NOSAConfig()
    q, k, _, s = random_qkvs(2, T, 4, 2, 16)
    sel = select_blocks(q, k, s, cfg)
    t = torch.arange(T)
    expect = torch.arange(sel.shape[-1])[None, :] <= (t // 64)[:, None]
    assert torch.equal(sel, expect.expand_as(sel))


def test_packed_selection_restarts_per_document():
    cfg = tiny_cfg()
    lens = [70, 1, 133, 40]
    T = sum(lens)
    q, k, _, s = random_qkvs(1, T, 4, 2, 8)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    sel = select_blocks(q, k, s, cfg, cu_seqlens=cu)
    for a, e in zip(cu.tolist(), cu[1:].tolist()):
        alone = select_blocks(q[:, a:e], k[:, a:e], s[:, a:e], cfg)
        assert torch.equal(sel[:, :, a:e, :alone.shape[-1]], alone)
        assert not sel[:, :, a:e, alone.shape[-1]:].any()


def test_selection_ignores_padding_of_shorter_sequences():
    """B > 1, right-padded: each row's selection depends only on its own prefix."""
    cfg = tiny_cfg()
    q, k, _, s = random_qkvs(3, 180, 4, 2, 8)
    sel = select_blocks(q, k, s, cfg)
    for b, L in enumerate([180, 77, 129]):
        alone = select_blocks(q[b:b + 1, :L], k[b:b + 1, :L], s[b:b + 1, :L], cfg)
        assert torch.equal(sel[b:b + 1, :, :L, :alone.shape[-1]], alone)


def test_query_chunking_does_not_change_the_selection():
    cfg = tiny_cfg()
    q, k, _, s = random_qkvs(1, 250, 4, 2, 8)
    assert torch.equal(select_blocks_reference(q, k, s, cfg, chunk_size=37), select_blocks(q, k, s, cfg))


@pytest.mark.parametrize("bad,msg", [
    (dict(kernel_stride=12), "kernel_stride"),
    (dict(kernel_size=32), "kernel_size"),
    (dict(block_size=18), "multiple of kernel_stride"),
    (dict(select_blocks=0), "select_blocks"),
    (dict(topk=4), "topk"),
    (dict(eviction_head="magic"), "unknown eviction_head"),
    (dict(block_size=0), "block_size"),
])
def test_config_validation_messages(bad, msg):
    with pytest.raises(ValueError, match=msg) as e:
        tiny_cfg(**bad)
    assert "\n" not in str(e.value)


def test_input_validation():
    cfg = tiny_cfg()
    q, k, _, s = random_qkvs(2, 40, 4, 2, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        select_blocks(q, k, s, cfg, cu_seqlens=torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        select_blocks(q[:, :, :3], k, s, cfg)
    with pytest.raises(ValueError, match="evict_score"):
        select_blocks(q, k, s[:, :, :1], cfg)
    with pytest.raises(ValueError, match="cu_seqlens"):
        select_blocks(q[:1], k[:1], s[:1], cfg, cu_seqlens=torch.tensor([0, 50]))
