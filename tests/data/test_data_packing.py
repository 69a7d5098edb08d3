"""Packing keeps every token once, cu_seqlens mark documents, labels never cross documents."""

import numpy as np
import pytest
import torch

from data.packing import assemble_row, best_fit, collate, flat_cu_seqlens, row_cu_seqlens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_places_every_item_once_within_capacity(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=500).tolist()
    bins = best_fit(lengths, 128)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # order inside a bin follows input order, and best-fit is near the lower bound
    assert all(b == sorted(b) for b in bins)
    assert len(bins) <= int(np.ceil(sum(lengths) / 128) * 1.15) + 1


def test_best_fit_rejects_overlong():
    with pytest.raises(ValueError, match="truncate or drop"):
        best_fit([10, 200], 128)


def test_assemble_row_boundaries_labels_and_positions():
    rng = np.random.default_rng(0)
    docs = [rng.integers(10, 1000, size=n) for n in (5, 1, 7, 3)]
    masks = [rng.integers(0, 2, size=len(d)).astype(np.uint8) for d in docs]
    S = 20
    row = assemble_row(docs, masks, S, pad_id=3)
    cu = row["cu_seqlens"]
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == S
    ends = np.cumsum([len(d) for d in docs])
    assert cu[1:5].tolist() == ends.tolist() and len(cu) == 6  # 4 docs + 1 padding segment
    assert np.array_equal(row["tokens"][: ends[-1]], np.concatenate(docs))
    for k, d in enumerate(docs):
        a, b = cu[k], cu[k + 1]
        assert row["position_ids"][a:b].tolist() == list(range(len(d)))
        assert np.array_equal(row["labels"][a:b - 1], d[1:])
        assert np.array_equal(row["loss_mask"][a:b - 1], masks[k][1:].astype(np.float32))
        assert row["loss_mask"][b - 1] == 0  # the last token of a document predicts nothing
    assert row["loss_mask"][ends[-1]:].sum() == 0 and (row["tokens"][ends[-1]:] == 3).all()


def test_assemble_row_exact_fill_has_no_padding_segment():
    docs = [np.arange(1, 9), np.arange(20, 28)]
    row = assemble_row(docs, None, 16, pad_id=0)
    assert row["cu_seqlens"].tolist() == [0, 8, 16]
    assert row["loss_mask"].sum() == 14
    with pytest.raises(ValueError):
        assemble_row(docs, None, 15, pad_id=0)


def test_collate_pads_cu_seqlens_and_flattens():
    r1 = assemble_row([np.arange(1, 4), np.arange(5, 10)], None, 10, 0)
    r2 = assemble_row([np.arange(1, 11)], None, 10, 0)
    b = collate([r1, r2])
    assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].shape == (2, 4)
    assert b["cu_seqlens_len"].tolist() == [4, 2]
    assert row_cu_seqlens(b, 0).tolist() == [0, 3, 8, 10]
    assert b["cu_seqlens"][1].tolist() == [0, 10, 10, 10]
    assert row_cu_seqlens(b, 1).tolist() == [0, 10]
    assert flat_cu_seqlens(b).tolist() == [0, 3, 8, 10, 20]
    assert b["max_seqlen"] == 10


def _best_fit_brute_force(lengths, capacity):
    """The definition, written out: scan every open bin for the least room that fits (lowest id first)."""
    bins, room = [], []
    for i, n in enumerate(lengths):
        fits = [b for b in range(len(bins)) if 0 < n <= room[b]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
            bins[b].append(i)
            room[b] -= n
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_best_fit_matches_its_definition(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(16, 300))
    lengths = rng.integers(1, cap + 1, size=int(rng.integers(50, 400))).tolist()
    assert best_fit(lengths, cap) == _best_fit_brute_force(lengths, cap)
