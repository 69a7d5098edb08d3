"""The decode step's selection kernel (``nosa_layers.ops.decode_selection``, one launch per layer) against
``inference.decode_select.select_decode_fast`` (itself tested against the plain batched reference):

* random inputs: the same blocks in the same order, except where the scores in fp64 are within a rounding of
  a tie (then only such swaps: see ``_assert_valid``); odd positions, sequences of one batch at different
  lengths, some with no complete window or shorter than the budget; the tiny and the released geometry (at a
  small capacity), G in {1, 3, 5, 7, 9, 16}, D in {16, 64}, fp32 / bf16 / fp16 compressed keys, with and
  without window scores, one or several chunks of blocks, a strided ``q``, a finite garbage sink column;
* exact ties (equal compressed keys, window scores with duplicates and signed zeros, a constant window score,
  capacities below the budget): identical results.

The end-to-end check (a cache decode with the kernel = with the PyTorch selection) is in
``tests/convert/test_block_cache.py``.
"""

from __future__ import annotations

import pytest
import torch

from inference.decode_select import decode_masks, select_decode_fast
from nosa_layers.config import NOSAConfig, tiny_geometry
from nosa_layers.ops import decode_selection
from nosa_layers.selection import block_window_index

NEG_INF = float("-inf")


def _inputs(cfg, cap, B, Hkv, G, D, dtype, with_wsc, g, strided_q=False):
    """Cache-shaped selection state of capacity ``cap`` tokens and positions: the last token of the capacity,
    one before the first complete window, one shorter than the budget, the rest random."""
    NW, NB = cfg.num_windows(cap), -(-cap // cfg.block_size)
    pos = torch.randint(0, cap, (B,), generator=g)
    pos[0] = cap - 1
    if B > 1:
        pos[1] = cfg.kernel_size - 2
    if B > 2:
        pos[2] = min(cap - 1, cfg.dense_len - 1 - int(torch.randint(0, cfg.block_size, (1,), generator=g)))
    kc = torch.randn(B, Hkv, NW + 1, D, generator=g)
    kc[:, :, NW] = 1e3  # the sink column: finite, never seen
    wsc = torch.randn(B, Hkv, NW + 1, generator=g) if with_wsc else None
    if with_wsc:
        wsc[:, :, NW] = 1e3
    if strided_q:
        q = (2 * torch.randn(B, G, Hkv, D, generator=g)).transpose(1, 2)
    else:
        q = 2 * torch.randn(B, Hkv, G, D, generator=g)
    return q.to(dtype), kc.to(dtype), wsc, pos, block_window_index(cfg, NB, NW)


def _reference(q, kc, wsc, pos, cfg, index, scale):
    masks = decode_masks(pos, cfg, index.shape[0], kc.shape[2])
    return select_decode_fast(q, kc, wsc, cfg, index, scale, masks)


def _stage_scores(q, kc, wsc, pos, cfg, index, scale):
    """The query-aware block scores in fp64 (forced +inf, future -inf) ``[B, Hkv, NB]``, the pooled window
    scores (fp32, or None) and ``decode_masks``."""
    m = decode_masks(pos, cfg, index.shape[0], kc.shape[2])
    logits = q.double() @ kc.double().transpose(-1, -2) * scale
    probs = torch.softmax(torch.where(m["hidden"][:, :, None], NEG_INF, logits), dim=-1)
    s_qa = torch.where(m["hidden"], NEG_INF, probs.sum(dim=2))
    r1 = torch.where(m["pinned"], m["pin_value"], s_qa[..., index].amax(dim=-1))
    b_qg = None if wsc is None else torch.where(m["hidden"], NEG_INF, wsc)[..., index].amax(dim=-1)
    return r1, b_qg, m


def _assert_valid(got, got_ok, q, kc, wsc, pos, cfg, index, scale, tol) -> int:
    """``got`` is a selection of the reference algorithm on the fp64 scores, up to swaps of blocks whose
    query-aware scores are within ``tol``: equal to ``select_decode_fast`` (fp32) wherever its margins are
    larger. Exact ties (pinned blocks, equal scores) must be broken towards the lower block index, and the
    query-agnostic stage (window scores: no arithmetic) must be exact given the query-aware picks. Returns the
    number of (sequence, KV head) rows that differ from ``select_decode_fast``."""
    want, want_ok = _reference(q, kc, wsc, pos, cfg, index, scale)
    assert got.shape == want.shape and got.dtype == torch.int64 and got_ok.dtype == torch.bool
    NB = index.shape[0]
    qb = pos // cfg.block_size
    assert torch.equal(got_ok, got <= qb[:, None, None])
    if torch.equal(got, want):
        return 0
    r1, b_qg, m = _stage_scores(q, kc, wsc, pos, cfg, index, scale)
    K = got.shape[-1]
    rows = (got != want).any(-1).nonzero().tolist()
    for b, h in rows:
        sel, r, n_valid = got[b, h], r1[b, h], min(int(qb[b]) + 1, NB)
        assert len(set(sel.tolist())) == K

        def before(x, y):  # block x may rank above block y (stage-1 scores, tolerance, ties to the lower index)
            return r[x] > r[y] - tol if r[x] != r[y] else x < y

        if b_qg is None:
            rest = sorted(set(range(NB)) - set(sel.tolist()))
            assert all(before(int(x), int(y)) for x, y in zip(sel[:-1], sel[1:])), (b, h, sel, r[sel])
            assert all(before(int(sel[-1]), y) for y in rest), (b, h, sel, r[sel])
            continue
        n = min(cfg.query_aware_blocks, n_valid)
        picked = sel[:n].tolist()  # the query-aware picks that are not future: ranked +inf, by block index
        assert picked == sorted(picked) and max(picked) < n_valid
        forced, future = m["forced"][b, 0], m["future"][b, 0]
        assert all(int(x) in picked for x in (forced & ~future).nonzero().flatten())
        others = [y for y in range(n_valid) if y not in picked]
        assert all(before(x, y) for x in picked if not forced[x] for y in others), (b, h, picked)
        chosen = torch.zeros(NB, dtype=torch.bool)
        chosen[picked] = True
        ranked = torch.where(future, NEG_INF, torch.where(forced | chosen, float("inf"), b_qg[b, h]))
        assert torch.equal(sel, torch.sort(ranked, descending=True, stable=True).indices[:K]), (b, h)
    return len(rows)


CASES = [
    pytest.param(tiny_geometry(), 333, 4, 2, 1, 16, torch.float32, True, 256, False, id="tiny-G1"),
    pytest.param(tiny_geometry(), 333, 4, 2, 3, 16, torch.bfloat16, False, 256, True, id="tiny-G3-bf16-no-wsc"),
    pytest.param(tiny_geometry(), 301, 4, 2, 5, 64, torch.float32, True, 16, False, id="tiny-G5-D64-chunks"),
    pytest.param(tiny_geometry(init_blocks=3, topk=10), 250, 4, 2, 7, 16, torch.bfloat16, True, 256, False,
                 id="tiny-G7-init3-topk10-bf16"),
    pytest.param(tiny_geometry(), 333, 3, 2, 9, 16, torch.float32, False, 16, True, id="tiny-G9-no-wsc-chunks"),
    pytest.param(tiny_geometry(), 203, 3, 2, 16, 16, torch.float16, True, 256, False, id="tiny-G16-fp16"),
    pytest.param(NOSAConfig(), 64 * 81 + 7, 3, 2, 5, 64, torch.bfloat16, True, 64, False,
                 id="released-G5-bf16-chunks"),
    pytest.param(NOSAConfig(), 64 * 70 + 13, 3, 1, 3, 64, torch.float32, False, 256, False, id="released-G3-no-wsc"),
]


@pytest.mark.parametrize("cfg,cap,B,Hkv,G,D,dtype,with_wsc,chunk,strided_q", CASES)
def test_kernel_equals_select_decode_fast(dev, request, cfg, cap, B, Hkv, G, D, dtype, with_wsc, chunk, strided_q):
    seed = sum(map(ord, request.node.callspec.id))  # a seed of its own per case
    g = torch.Generator().manual_seed(seed)
    q, kc, wsc, pos, index = _inputs(cfg, cap, B, Hkv, G, D, dtype, with_wsc, g, strided_q)
    scale = D ** -0.5
    on = {"device": dev}
    assert decode_selection.supported(q, kc, wsc, index)
    got, ok = decode_selection.select_decode_kernel(q.to(**on), kc.to(**on), None if wsc is None else wsc.to(**on),
                                                    pos.to(**on), cfg, index.to(**on), scale, chunk_blocks=chunk)
    differ = _assert_valid(got.cpu(), ok.cpu(), q.float(), kc, wsc, pos, cfg, index, scale, tol=2e-5 * G)
    assert differ <= B * Hkv // 4  # near ties are rare: most rows are exact


@pytest.mark.parametrize("with_wsc", [False, True])
def test_tie_aware_check_accepts_only_near_tie_swaps(with_wsc):
    """The check of the random cases (no kernel): a swap at the cut (no wsc: the last two blocks; with wsc: the
    weakest query-aware pick for the best block left out) passes with a tolerance above the two blocks' score
    gap and fails below it; a swap of exactly equal scores fails at any tolerance (ties: lower index first)."""
    cfg = tiny_geometry(topk=8)  # 5 query-aware blocks, 3 by wsc
    g = torch.Generator().manual_seed(5 + with_wsc)
    q, kc, wsc, pos, index = _inputs(cfg, 333, 1, 1, 3, 16, torch.float32, with_wsc, g)
    scale, qb = 0.25, pos // cfg.block_size
    for zero_keys in (False, True):
        if zero_keys:
            kc = torch.zeros_like(kc)  # every block with a window scores the same
        want, _ = _reference(q, kc, wsc, pos, cfg, index, scale)
        r1, b_qg, m = _stage_scores(q, kc, wsc, pos, cfg, index, scale)
        r, got = r1[0, 0], want.clone()
        if wsc is None:
            x, y = int(want[0, 0, -2]), int(want[0, 0, -1])
            got[0, 0, -2:] = torch.tensor([y, x])
        else:
            n = cfg.query_aware_blocks
            forced = m["forced"][0, 0]
            picked = want[0, 0, :n].tolist()
            x = min((p for p in picked if not forced[p]), key=lambda p: (r[p], -p))  # the weakest pick
            y = max((p for p in range(int(qb[0]) + 1) if p not in picked), key=lambda p: (r[p], -p))
            chosen = torch.zeros_like(forced)
            chosen[[p for p in picked if p != x] + [y]] = True
            ranked = torch.where(m["future"][0, 0], NEG_INF, torch.where(forced | chosen, float("inf"), b_qg[0, 0]))
            got[0, 0] = torch.sort(ranked, descending=True, stable=True).indices[:got.shape[-1]]
        gap = float(r[x] - r[y])
        args = (got, got <= qb[:, None, None], q, kc, wsc, pos, cfg, index, scale)
        if zero_keys:
            assert gap == 0
            with pytest.raises(AssertionError):
                _assert_valid(*args, tol=1.0)
        else:
            assert 0 < gap < 0.5
            assert _assert_valid(*args, tol=2 * gap) == 1
            with pytest.raises(AssertionError):
                _assert_valid(*args, tol=gap / 2)


def _patterns(B, Hkv, NW, D, g, period=5):
    """Compressed keys that repeat three patterns of -1 / 0 / 1 (runs of ``period`` windows): exact logits in
    any summation order, so equal windows score exactly equal, in the kernel as in torch."""
    base = torch.randint(-1, 2, (B, Hkv, 3, D), generator=g).float()
    return base[:, :, (torch.arange(NW + 1) // period) % 3]


@pytest.mark.parametrize("case", ["zero-keys-signed-zero-wsc", "patterns-no-wsc", "patterns-constant-wsc",
                                  "below-the-budget"])
def test_exact_ties_give_identical_results(dev, case):
    """Equal scores everywhere they can be: the kernel must return select_decode_fast's blocks and order."""
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    cfg, cap, B, Hkv, G, D, chunk = tiny_geometry(init_blocks=2, topk=9), 333, 6, 2, 3, 16, 256  # 3 by wsc
    if case == "below-the-budget":
        cap = 40  # 3 blocks of capacity: fewer than topk and than the query-aware blocks
    NW, NB = cfg.num_windows(cap), -(-cap // cfg.block_size)
    pos = torch.tensor([cap - 1, 0, 5, 6, 16, 47 if cap > 47 else cap - 2])
    q = torch.randint(-1, 2, (B, Hkv, G, D), generator=g).float()
    wsc = torch.randn(B, Hkv, NW + 1, generator=g)
    if case == "zero-keys-signed-zero-wsc":
        kc = torch.zeros(B, Hkv, NW + 1, D)
        # runs of 4 windows of -1, -0.0 or +0.0: blocks (5-6 windows) whose max is -0.0 against ones at +0.0
        runs = torch.tensor([-1.0, -0.0, 0.0])[torch.randint(0, 3, (B, Hkv, NW // 4 + 1), generator=g)]
        wsc = runs[..., torch.arange(NW + 1) // 4]
    elif case == "patterns-no-wsc":
        kc, wsc, G = _patterns(B, Hkv, NW, D, g), None, 5
        q = torch.randint(-1, 2, (B, Hkv, G, D), generator=g).float()
    elif case == "patterns-constant-wsc":
        kc, chunk = _patterns(B, Hkv, NW, D, g, period=3), 16
        wsc = torch.full((B, Hkv, NW + 1), 0.5)
    else:
        kc = _patterns(B, Hkv, NW, D, g, period=1)
    index = block_window_index(cfg, NB, NW)
    scale = 0.25  # D ** -0.5: exact
    want = _reference(q, kc, wsc, pos, cfg, index, scale)
    on = {"device": dev}
    got = decode_selection.select_decode_kernel(q.to(**on), kc.to(**on), None if wsc is None else wsc.to(**on),
                                                pos.to(**on), cfg, index.to(**on), scale, chunk_blocks=chunk)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_supported_shapes(monkeypatch):
    """Head dims that ``tl.dot`` takes, fp32 window scores, float compressed keys; no Triton, no kernel."""
    pytest.importorskip("triton")
    q, kc, wsc = torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 9, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 9)
    index = torch.zeros(4, 6, dtype=torch.long)
    ok = decode_selection.supported
    assert ok(q, kc, wsc, index) and ok(q, kc, None, index)
    assert not ok(torch.zeros(1, 2, 3, 24), torch.zeros(1, 2, 9, 24), wsc, index)  # D not a power of two
    assert not ok(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 9, 8), wsc, index)  # D < 16
    assert not ok(q, kc, wsc.double(), index) and not ok(q, kc.double(), wsc, index)
    assert not ok(torch.zeros(1, 2, 65, 64), kc, wsc, index)
    with pytest.raises(ValueError, match="power of two"):
        decode_selection.select_decode_kernel(q, kc, wsc, torch.zeros(1, dtype=torch.long), tiny_geometry(), index,
                                              0.125, chunk_blocks=48)
    monkeypatch.setattr(decode_selection, "triton", None)
    assert not ok(q, kc, wsc, index) and not decode_selection.available()
