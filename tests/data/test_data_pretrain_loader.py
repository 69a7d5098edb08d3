"""megatron-core GPT datasets through PretrainLoader: document boundaries, coverage, resume, blends."""

import numpy as np
import pytest
import torch

from data.config import DataConfig
from data.loader import build_pretrain_loaders
from data.packing import row_cu_seqlens

EOD = 0  # the synthetic datasets' EOD id (tests/data/conftest.py)


def _cfg(paths, demo, tmp_path, **kw):
    base = dict(paths=paths, tokenizer=demo["tokenizer"], seq_length=64, micro_batch_size=2, split="100,0,0",
                cache_dir=str(tmp_path / "idx"), seed=7)
    base.update(kw)
    return DataConfig(**base)


def _loaders(cfg, rank=0, dp=1):
    from types import SimpleNamespace

    fake = SimpleNamespace(vocab_size=1 << 20, eod=EOD, pad=-1, path="synthetic", check_model_vocab=lambda v: None)
    return build_pretrain_loaders(cfg, rank, dp, tokenizer=fake)


def test_document_mode_cu_seqlens_match_eod_boundaries(synth, demo, tmp_path):
    a, docs_a, _, _ = synth
    tl, _ = _loaders(_cfg([a], demo, tmp_path))
    S = 64
    for _ in range(20):
        b = next(tl)
        assert b["tokens"].shape == (2, S) and b["tokens"].dtype == torch.int64
        for r in range(2):
            cu = row_cu_seqlens(b, r).tolist()
            tok, lab, pos, lm = b["tokens"][r], b["labels"][r], b["position_ids"][r], b["loss_mask"][r]
            assert cu[0] == 0 and cu[-1] == S
            eods = torch.nonzero(tok == EOD).flatten().tolist()
            # every interior boundary sits right after an EOD, and every EOD (but a final one) ends a segment
            assert [c - 1 for c in cu[1:-1]] == [e for e in eods if e != S - 1]
            for s, e in zip(cu[:-1], cu[1:]):
                assert pos[s:e].tolist() == list(range(e - s))
                seg = tok[s:e]
                assert (seg[:-1] != EOD).all()
                assert torch.equal(lab[s:e - 1], seg[1:])  # labels stay inside the document
            assert torch.equal(lm, (tok != EOD).float())


def test_eod_mode_has_running_positions_and_no_boundaries(synth, demo, tmp_path):
    a, *_ = synth
    tl, _ = _loaders(_cfg([a], demo, tmp_path, packing="eod"))
    b = next(tl)
    assert "cu_seqlens" not in b
    assert torch.equal(b["position_ids"], torch.arange(64).expand(2, 64))
    assert torch.equal(b["loss_mask"], (b["tokens"] != EOD).float())


def test_one_epoch_reads_every_token_exactly_once(synth, demo, tmp_path):
    a, docs_a, _, _ = synth
    tl, _ = _loaders(_cfg([a], demo, tmp_path, micro_batch_size=1))
    n = len(tl)
    seen = torch.cat([next(tl)["tokens"][0] for _ in range(n)])
    stream = np.concatenate(docs_a)
    real = seen[seen != EOD].numpy()
    assert len(np.unique(real)) == len(real)  # no document token twice
    assert set(real.tolist()) <= set(stream[stream != EOD].tolist())
    assert len(stream) - len(seen) <= 64  # only the final partial sample is left out
    assert (seen == EOD).sum() >= len(docs_a) - 2


def test_resume_mid_epoch_gives_the_same_next_batches(synth, demo, tmp_path):
    a, *_ = synth
    cfg = _cfg([a], demo, tmp_path)
    ref, _ = _loaders(cfg)
    for _ in range(5):
        next(ref)
    state = ref.state_dict()
    expected = [next(ref) for _ in range(4)]
    fresh, _ = _loaders(cfg)
    fresh.load_state_dict(state)
    for e in expected:
        got = next(fresh)
        assert got.keys() == e.keys()
        for k in e:
            assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(e[k])), k
    other, _ = _loaders(_cfg([a], demo, tmp_path, seed=8))
    with pytest.raises(ValueError, match="resume"):
        other.load_state_dict(state)


def test_dp_ranks_partition_the_global_batch_and_resume_across_dp_sizes(synth, demo, tmp_path):
    a, *_ = synth
    one, _ = _loaders(_cfg([a], demo, tmp_path, micro_batch_size=4))
    r0, _ = _loaders(_cfg([a], demo, tmp_path), 0, 2)
    r1, _ = _loaders(_cfg([a], demo, tmp_path), 1, 2)
    for _ in range(3):
        g = next(one)["tokens"]
        assert torch.equal(torch.cat([next(r0)["tokens"], next(r1)["tokens"]]), g)
    # a run saved with dp=2 resumes on dp=1 at the same global sample
    single, _ = _loaders(_cfg([a], demo, tmp_path, micro_batch_size=4))
    single.load_state_dict(r0.state_dict())
    assert torch.equal(next(single)["tokens"], next(one)["tokens"])


def test_blend_ratios_and_disjoint_valid_split(synth, demo, tmp_path):
    a, docs_a, b, docs_b = synth
    cfg = _cfg([a, b], demo, tmp_path, weights=[0.3, 0.7], split="90,10,0", seq_length=32,
               micro_batch_size=50, train_samples=4000, valid_samples=200)
    tl, vl = _loaders(cfg)
    ids, toks = [], []
    for _ in range(40):
        x = next(tl)
        ids.append(x["dataset_id"])
        toks.append(x["tokens"])
    ids, toks = torch.cat(ids), torch.cat(toks)
    frac_a = (ids == 0).float().mean().item()
    assert abs(frac_a - 0.3) < 0.03, frac_a
    # dataset_id agrees with the token ranges of the two corpora
    from_a = ((toks > 0) & (toks < 1_000_000)).any(1)
    assert torch.equal(from_a, ids == 0)
    assert vl is not None
    v = torch.cat([next(vl)["tokens"] for _ in range(len(vl))])
    train_vals = set(toks[toks != EOD].tolist())
    assert not train_vals & set(v[v != EOD].tolist())  # valid documents never appear in train


@pytest.mark.parametrize("S", [4096, 16384])
def test_demo_corpus_long_samples(demo, tok, tmp_path, S):
    cfg = DataConfig(paths=[demo["indexed_prefix"]], tokenizer=demo["tokenizer"], seq_length=S, split="100,0,0",
                     cache_dir=str(tmp_path / "idx"))
    tl, _ = build_pretrain_loaders(cfg)
    b = next(tl)
    assert b["tokens"].shape == (1, S) and int(b["tokens"].max()) < tok.vocab_size
    cu = row_cu_seqlens(b, 0)
    assert cu[0] == 0 and cu[-1] == S and b["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert torch.equal(b["tokens"][0, cu[1:-1] - 1], torch.full((len(cu) - 2,), tok.eod))


def test_weighted_blend_without_sizes_and_single_path_weight(synth, demo, tmp_path):
    a, docs_a, b, docs_b = synth
    tl, vl = _loaders(_cfg([a, b], demo, tmp_path, weights=[1.0, 1.0], split="100,0,0", seq_length=32))
    total = sum(len(d) for d in docs_a + docs_b)
    assert vl is None and abs(len(tl.dataset) - total // 32) <= 0.01 * total // 32 + 2  # one pass by default
    one, _ = _loaders(_cfg([a], demo, tmp_path, weights=[3.0]))
    plain, _ = _loaders(_cfg([a], demo, tmp_path))
    assert torch.equal(next(one)["tokens"], next(plain)["tokens"])


def test_boundaries_without_eod_still_mask_cross_document_labels(demo, tmp_path):
    from data.indexed import write_indexed

    # foreign .bin written without EOD after each document (megatron preprocess without --append-eod)
    docs = [np.arange(1 + 1000 * i, 1 + 1000 * i + n) for i, n in enumerate([5, 9, 3, 20, 7, 11, 4, 30] * 10)]
    write_indexed(str(tmp_path / "noeod"), docs, vocab_size=1 << 20)
    tl, _ = _loaders(_cfg([str(tmp_path / "noeod")], demo, tmp_path, seq_length=32, micro_batch_size=1))
    for _ in range(len(tl)):
        b = next(tl)
        cu = row_cu_seqlens(b, 0)
        lm, tok, lab = b["loss_mask"][0], b["tokens"][0], b["labels"][0]
        for s, e in zip(cu[:-2].tolist(), cu[1:-1].tolist()):
            assert lm[e - 1] == 0 and tok[e - 1] // 1000 != lab[e - 1] // 1000  # cross-doc label is masked
            assert (lm[s:e - 1] == 1).all()  # everything inside the document trains
