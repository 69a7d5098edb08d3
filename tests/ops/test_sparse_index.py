"""The block-sparse index (``nosa_layers/ops/sparse_index.py``) against a brute-force construction
from the selection mask, on ``dev``: forward lists, inverse lists, dK/dV pieces and slots."""

import pytest
import torch

from nosa_layers.ops import build_sparse_index
from nosa_layers.ops.sparse_index import _SlotCountRing, chunk_units, query_tile, union_inflation
from tests.nosa.common import tiny_cfg


def _random_selection(B, Hkv, T, spans, bs, g, p=0.3):
    """Causal random block selection per row (own block always), zero past each document."""
    nb = max(-(-(e - s) // bs) for s, e in spans)
    sel = torch.zeros(B, Hkv, T, nb, dtype=torch.bool)
    for s, e in spans:
        for t in range(s, e):
            qb = (t - s) // bs
            sel[:, :, t, :qb + 1] = torch.rand(B, Hkv, qb + 1, generator=g) < p
            sel[:, :, t, qb] = True
    return sel


def _brute_force(sel, spans, bs, qt, kb=1):
    """{(b, tile start, h): [(key start, word)]} and {(b, key start, h): [(tile start, words)]}: a
    forward entry holds the tile's word of one block, the inverse list of a key group of ``kb``
    blocks (first block index a multiple of it) the tiles' words of its blocks, listed when any is
    non-zero."""
    fwd, inv = {}, {}
    B, Hkv = sel.shape[:2]
    for b in range(B):
        for s, e in spans:
            for q0 in range(s, e, qt):
                for h in range(Hkv):
                    own = (q0 - s) // bs

                    def words(g, n):
                        return tuple(sum(int(sel[b, h, t, m]) << (t - q0) for t in range(q0, min(q0 + qt, e)))
                                     if m <= own else 0 for m in range(g, g + n))

                    for g in range(0, own + 1):
                        if any(words(g, 1)):
                            fwd.setdefault((b, q0, h), []).append((s + g * bs, words(g, 1)[0]))
                    for g in range(0, own + 1, kb):
                        if any(words(g, kb)):
                            inv.setdefault((b, s + g * bs, h), []).append((q0, words(g, kb)))
    return fwd, inv


@pytest.mark.parametrize("B,T,Hkv,cu,qt,chunk,slots,kb", [
    pytest.param(2, 70, 2, None, 4, 3, 100, 1, id="B2-qt4"),
    pytest.param(1, 150, 1, [0, 37, 37, 101, 150], 16, 2, 3, 1, id="varlen-slot-budget"),
    pytest.param(1, 90, 2, [0, 1, 90], 1, 1000, 0, 1, id="qt1-whole-lists"),
    pytest.param(1, 150, 2, [0, 37, 37, 101, 150], 4, 2, 5, 2, id="key-pairs-varlen"),
    pytest.param(2, 83, 1, None, 16, 1000, 0, 2, id="key-pairs-B2-qt16"),
    pytest.param(1, 150, 1, [0, 37, 37, 101, 150], 8, 3, 4, 2, id="key-pairs-qt8-slot-budget"),
])
def test_index_equals_brute_force(dev, B, T, Hkv, cu, qt, chunk, slots, kb):
    cfg = tiny_cfg()
    bs = cfg.block_size
    spans = [(0, T)] if cu is None else [(a, b) for a, b in zip(cu, cu[1:]) if b > a]
    sel = _random_selection(B, Hkv, T, spans, bs, torch.Generator().manual_seed(T + qt))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    idx = build_sparse_index(sel.to(dev), cfg, T, cu_t, num_q_heads=Hkv, qt=qt, chunk=chunk, max_slots=slots, kb=kb)
    fwd, inv = _brute_force(sel, spans, bs, qt, kb)
    blocks = idx.layout.blocks.cpu().tolist()
    count, ks, word = idx.fwd_count.cpu(), idx.fwd_ks.cpu(), idx.fwd_word.cpu()
    S = bs // qt
    for i in range(idx.n_tiles):
        b, k0, _, de = blocks[i // S]
        q0 = k0 + (i % S) * qt
        for h in range(Hkv):
            w = i * Hkv + h
            got = [(int(ks[w, e]), int(word[w, e]) & ((1 << qt) - 1)) for e in range(int(count[w]))]
            assert got == (fwd.get((b, q0, h), []) if q0 < de else []), (i, h)
    ptr, qs, iw = idx.inv_ptr.cpu(), idx.inv_qs.cpu(), idx.inv_word.cpu()
    pieces, plist, slot = idx.piece_ptr.cpu(), idx.piece_list.cpu(), idx.slot_ptr.cpu()
    used_slots = []
    lead = [(k0 - d0) // bs % kb == 0 for _, k0, d0, _ in blocks]
    for c, (b, k0, _, _) in enumerate(blocks):
        for h in range(Hkv):
            lst = c * Hkv + h
            got = [(int(qs[e]), tuple(int(w) & ((1 << qt) - 1) for w in iw[e]))
                   for e in range(int(ptr[lst]), int(ptr[lst + 1]))]
            assert got == (inv.get((b, k0, h), []) if lead[c] else []), (c, h)
            n_pieces = int(pieces[lst + 1] - pieces[lst])
            if not lead[c]:  # inside a key group: its group's program covers it
                assert n_pieces == 0 and int(slot[lst]) < 0
                continue
            assert plist[int(pieces[lst]):int(pieces[lst + 1])].tolist() == [lst] * n_pieces
            if int(slot[lst]) >= 0:
                assert n_pieces == -(-len(got) // chunk) > 1
                used_slots += list(range(int(slot[lst]), int(slot[lst]) + n_pieces))
            else:
                assert n_pieces == 1
    assert used_slots == list(range(len(used_slots))) and len(used_slots) <= slots  # consecutive, in order
    # the backward's workspace holds the slots the lists use (their count reaches the host), not the budget
    tagged = int(slot[idx.n_lists])  # tagged with the build's ring entry on a GPU
    assert tagged % _SlotCountRing.TAG_UNIT == len(used_slots) == idx.workspace_slots()
    assert idx.workspace_shape() == (max(len(used_slots), 1), kb * bs)
    assert int(pieces[-1]) <= idx.max_pieces


def test_query_tile_takes_a_kv_groups_heads():
    assert query_tile(8, 64) == (8, 8) and query_tile(16, 64) == (4, 16) and query_tile(1, 64) == (64, 1)
    assert query_tile(2, 16) == (16, 2) and query_tile(128, 64) == (1, 64) and query_tile(6, 64) == (8, 6)


def test_union_inflation_counts_union_blocks_and_bitmask_fill(dev):
    """Tiles of 16 rows over 4 blocks: rows that agree give inflation 1 and a full bitmask; two row
    halves with disjoint picks double the union and half-fill each listed block's word."""
    cfg = tiny_cfg()
    T, bs = 64, cfg.block_size
    sel = torch.zeros(1, 1, T, 4, dtype=torch.bool)
    for t in range(T):
        sel[0, 0, t, t // bs] = True
    st = union_inflation(build_sparse_index(sel.to(dev), cfg, T, num_q_heads=1), sel.to(dev))
    assert st["inflation"] == pytest.approx(1.0) and st["bitmask_fill"] == pytest.approx(1.0) and st["nnz"] == 4
    sel[0, 0, 48:56, 0] = True  # last tile: first half adds block 0, second half block 1
    sel[0, 0, 56:64, 1] = True
    st = union_inflation(build_sparse_index(sel.to(dev), cfg, T, num_q_heads=1), sel.to(dev))
    assert st["mean_union_blocks_per_tile"] == pytest.approx((1 + 1 + 1 + 3) / 4)
    assert st["mean_blocks_per_token"] == pytest.approx((48 + 16 * 2) / 64)
    assert st["bitmask_fill"] == pytest.approx((4 * 16 + 8 + 8) / (6 * 16))
    st8 = union_inflation(build_sparse_index(sel.to(dev), cfg, T, num_q_heads=1, qt=8), sel.to(dev))
    assert st8["inflation"] == pytest.approx(1.0)  # 8-token tiles separate the two halves


def test_dkdv_pieces_hold_the_same_work_for_every_query_tile(dev):
    """The default dK/dV piece is CHUNK units of 64 query rows x one KV block: an entry of a qt-token
    tile of a G-head group is qt x G rows x kb blocks, so 64-token tiles get pieces G times shorter
    than 8-token ones, and two-block key groups pieces half as long."""
    from nosa_layers.ops.attention_op import launch_config

    cfg = tiny_cfg()
    sel = _random_selection(1, 2, 40, [(0, 40)], cfg.block_size, torch.Generator().manual_seed(3)).to(dev)
    units = launch_config(dev)["dkdv"]["CHUNK"]
    if units == "auto":  # sized from the attention's work: 40 tokens x 16 heads x every block
        units = chunk_units(40 * 16 * sel.shape[-1] // 64, dev)
    for qt in (16, 4):
        for kb in (1, 2):
            idx = build_sparse_index(sel, cfg, 40, num_q_heads=16, qt=qt, kb=kb)  # G = 8
            assert idx.chunk == units * 64 // (qt * 8 * kb)


def _ring_without_pinning():
    ring = object.__new__(_SlotCountRing)  # no CUDA here: an unpinned host buffer
    ring.host = torch.full((_SlotCountRing.SIZE,), -1, dtype=torch.int32)
    ring.view, ring.builds = ring.host.numpy(), 0
    return ring


def _land_later(ring, i, value, delay_s=0.05):
    """Write ``value`` to entry ``i`` after ``delay_s``, as the device-to-host copy would."""
    import threading
    import time

    t = threading.Thread(target=lambda: (time.sleep(delay_s), ring.view.__setitem__(i, value)))
    t.start()
    return t


def test_slot_count_ring_waits_for_its_own_count():
    """The host ring that slot counts reach without blocking: reading an entry whose copy has not
    landed waits for it; another build's count in the entry (a stale copy landing late) is not
    taken; an entry reused ``SIZE`` builds later is not trusted at all (None: the budget)."""
    ring = _ring_without_pinning()
    a = ring.next_entry()
    t = _land_later(ring, a, ring.tagged(a, 37))  # what the scan kernel writes and the copy brings
    assert ring.read(a) == 37
    t.join()
    assert ring.read(a) == 37  # landed: no wait
    for _ in range(ring.SIZE):
        b = ring.next_entry()
    assert b % ring.SIZE == a and ring.read(a) is None  # reused: no longer trusted
    ring.view[a] = ring.tagged(a, 37)  # a late copy of the old build lands in the new entry
    t = _land_later(ring, a, ring.tagged(b, 5))
    assert ring.read(b) == 5  # waited past the stale value for its own
    t.join()


def test_slot_budget_must_fit_below_the_tag(dev):
    cfg = tiny_cfg()
    sel = _random_selection(1, 1, 40, [(0, 40)], cfg.block_size, torch.Generator().manual_seed(3)).to(dev)
    with pytest.raises(ValueError, match="max_slots"):
        build_sparse_index(sel, cfg, 40, num_q_heads=1, max_slots=_SlotCountRing.TAG_UNIT)


def test_auto_chunk_aims_at_a_few_pieces_per_sm():
    """"auto" dK/dV pieces: about CHUNK_WAVES per SM of the estimated work (64-row x one-block
    units), a power of two in 256..1024: 512 for the 1B shape at 16K/16 (topk 64) on 132 SMs,
    1024 at 32K/32, 256 for short sequences."""
    from nosa_layers.ops.sparse_index import CHUNK_WAVES, _sm_count

    cpu = torch.device("cpu")
    assert _sm_count(cpu) == 132 and CHUNK_WAVES == 4
    assert chunk_units(16384 * 16 * 64 // 64, cpu) == 512
    assert chunk_units(32768 * 32 * 64 // 64, cpu) == 1024
    assert chunk_units(4096 * 16 * 64 // 64, cpu) == 256 and chunk_units(0, cpu) == 256
