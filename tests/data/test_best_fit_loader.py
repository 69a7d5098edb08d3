"""data.packing=best_fit: documents stay whole, blends follow token shares, resume and DP sharding exact."""

import numpy as np
import pytest

from data.best_fit_loader import BestFitLoader, document_pieces, repetitions, split_ranges
from data.indexed import read_indexed, write_indexed
from data.packing import row_cu_seqlens

EOD = 0


def _dataset(tmp_path, name, lengths, base):
    """Documents whose tokens name them: doc i holds ``base + i`` repeated, then EOD."""
    docs = [np.append(np.full(n - 1, base + i), EOD) for i, n in enumerate(lengths)]
    write_indexed(str(tmp_path / name), docs, vocab_size=5000)
    return read_indexed(str(tmp_path / name))


def _rows_of_epoch(loader):
    """Every row of one epoch as a list of (first token, length) per document."""
    out = []
    for _ in range(len(loader)):
        b = next(loader)
        for r in range(b["tokens"].shape[0]):
            cu = row_cu_seqlens(b, r).tolist()
            toks = b["tokens"][r]
            docs = []
            for a, e in zip(cu[:-1], cu[1:]):
                if b["loss_mask"][r, a:e].sum() == 0 and (toks[a:e] == EOD).all():
                    continue  # padding segment
                docs.append((int(toks[a]), e - a))
            out.append(docs)
    return out


def test_split_ranges_match_megatron():
    r = split_ranges("95,5,0", 100)
    assert (r["train"], r["valid"], r["test"]) == (range(0, 95), range(95, 100), range(0))
    assert split_ranges("90,10", 7)["valid"] == range(6, 7)


def test_whole_documents_and_pieces(tmp_path):
    rng = np.random.default_rng(11)
    S = 64
    lengths = rng.integers(3, 60, size=41).tolist() + [150, 64, 65]  # three that need cutting or fit exactly
    ds = _dataset(tmp_path, "a", lengths, 1000)
    pieces = document_pieces([ds], "train", "100,0,0", S)
    assert pieces.length.max() <= S and int(pieces.length.sum()) == sum(lengths)
    assert sorted(pieces.length[pieces.doc == 41].tolist()) == [22, 64, 64]  # 150 = 64 + 64 + 22
    loader = BestFitLoader([ds], pieces, [1.0], S, 2, pad_id=EOD, seed=3)
    seen = {}
    for docs in _rows_of_epoch(loader):
        assert sum(n for _, n in docs) <= S
        for first, n in docs:
            seen.setdefault(first - 1000, []).append(n)
    short = [i for i, n in enumerate(lengths) if n <= S]
    # every document of at most S tokens was placed whole, once (a dropped tail of < B*D rows aside)
    placed = [i for i in short if i in seen]
    assert len(placed) >= len(short) - 2 * 3
    assert all(seen[i] == [lengths[i]] for i in placed)
    assert loader.fill() > 0.8


def test_rows_keep_document_tokens_in_order(tmp_path):
    """Labels never cross a document and positions restart at each one."""
    ds = _dataset(tmp_path, "a", [5, 9, 17, 30, 7, 12], 100)
    loader = BestFitLoader([ds], document_pieces([ds], "train", "100,0,0", 32), [1.0], 32, 1, EOD, seed=0)
    b = next(loader)
    cu = row_cu_seqlens(b, 0).tolist()
    for a, e in zip(cu[:-1], cu[1:]):
        assert b["position_ids"][0, a:e].tolist() == list(range(e - a))
        assert b["loss_mask"][0, e - 1] == 0


def test_blend_follows_token_shares(tmp_path):
    a = _dataset(tmp_path, "a", [20] * 200, 1000)   # 4,000 tokens
    b = _dataset(tmp_path, "b", [40] * 25, 3000)    # 1,000 tokens
    pieces = document_pieces([a, b], "train", "100,0,0", 128)
    reps = repetitions(pieces.tokens, [0.5, 0.5])
    assert reps == pytest.approx([0.625, 2.5])
    loader = BestFitLoader([a, b], pieces, reps, 128, 1, EOD, seed=5)
    toks = {"a": 0, "b": 0}
    for docs in _rows_of_epoch(loader):
        for first, n in docs:
            toks["a" if first < 3000 else "b"] += n
    share = toks["b"] / (toks["a"] + toks["b"])
    assert share == pytest.approx(0.5, abs=0.03)


def test_resume_and_data_parallel_shards_are_exact(tmp_path):
    rng = np.random.default_rng(2)
    ds = _dataset(tmp_path, "a", rng.integers(2, 50, size=300).tolist(), 10)
    pieces = document_pieces([ds], "train", "100,0,0", 64)

    def make(rank=0, size=1):
        return BestFitLoader([ds], pieces, [1.0], 64, 2, EOD, rank, size, seed=9)

    ref = make()
    batches = [next(ref) for _ in range(len(ref) + 3)]  # crosses into the second epoch
    first_epoch = [b["tokens"] for b in batches[:2]]
    assert not all(np.array_equal(x, y) for x, y in zip(first_epoch, [b["tokens"] for b in batches[len(ref):]]))

    resumed = make()
    for _ in range(5):
        next(resumed)
    state = resumed.state_dict()
    again = make()
    again.load_state_dict(state)
    for k in range(5, len(batches)):
        assert np.array_equal(next(again)["tokens"], batches[k]["tokens"])

    r0, r1 = make(0, 2), make(1, 2)
    one = make(0, 1)
    for _ in range(3):  # ranks 0 and 1 of a step together read the rows the single rank reads in one step
        x0, x1 = next(r0)["tokens"], next(r1)["tokens"]
        whole = np.concatenate([next(one)["tokens"], next(one)["tokens"]])
        assert np.array_equal(np.concatenate([x0, x1]), whole)
    with pytest.raises(ValueError, match="best_fit"):
        make().load_state_dict({"kind": "pretrain"})


def test_loss_starts_limit_the_targets(tmp_path):
    """A path with loss starts trains each document only from its start on (pieces keep their offset)."""
    from data.loss_spans import read_loss_from, write_loss_from

    lengths = [10, 20, 90]
    a = _dataset(tmp_path, "a", lengths, 100)
    write_loss_from(str(tmp_path / "a"), [4, 0, 70])
    starts = read_loss_from(str(tmp_path / "a"), 3)
    b = _dataset(tmp_path, "b", [12], 900)
    pieces = document_pieces([a, b], "train", "100,0,0", 64)
    loader = BestFitLoader([a, b], pieces, [1.0, 1.0], 64, 1, EOD, seed=1, loss_from=[starts, None])
    trained = {}
    for _ in range(len(loader)):
        batch = next(loader)
        cu = row_cu_seqlens(batch, 0).tolist()
        for lo, hi in zip(cu[:-1], cu[1:]):
            first = int(batch["tokens"][0, lo])
            trained.setdefault(first, []).append(int(batch["loss_mask"][0, lo:hi].sum()))
    # doc 0 (10 tokens, from 4): targets are tokens 4..9 = 6 labels at positions 3..8
    assert trained[100] == [6] and trained[101] == [19] and trained[900] == [11]
    # doc 2 (90 tokens) is cut into 64 + 26: only its second piece holds tokens >= 70
    assert sorted(trained[102]) == [0, 20]
    with pytest.raises(ValueError, match="loss starts for"):
        read_loss_from(str(tmp_path / "b"), 1) if write_loss_from(str(tmp_path / "b"), [1, 2]) else None
