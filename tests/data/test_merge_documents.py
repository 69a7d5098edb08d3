"""``data.merge_documents``: long-document copies of an indexed dataset (same tokens, merged boundaries)."""

from __future__ import annotations

import numpy as np
import pytest

from data.indexed import read_indexed, write_indexed
from data.merge_documents import main, merge_documents, merged_spans


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spans_are_minimal_and_cover_everything(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 50, size=int(rng.integers(1, 40)))
    m = int(rng.integers(1, 120))
    spans = merged_spans(lengths, m)
    assert spans[0][0] == 0 and spans[-1][1] == len(lengths)
    assert all(a < b and b == c for (a, b), (c, _) in zip(spans, spans[1:] + [(len(lengths), None)]))
    for a, b in spans[:-1]:  # reaches the minimum, and would not without its last document
        assert lengths[a:b].sum() >= m > lengths[a:b - 1].sum()
    a, b = spans[-1]
    assert lengths[a:b - 1].sum() < m


def test_merge_keeps_the_token_stream(tmp_path):
    docs = [np.arange(n, dtype=np.int64) + 100 * i for i, n in enumerate([3, 7, 2, 9, 1, 4, 5, 2])]
    src, out = str(tmp_path / "src"), str(tmp_path / "long")
    write_indexed(src, docs, vocab_size=1000)
    before = {ext: (tmp_path / f"src{ext}").read_bytes() for ext in (".bin", ".idx")}
    s = merge_documents(src, out, 10)
    merged = read_indexed(out)
    assert [len(merged[i]) for i in range(len(merged))] == [10, 11, 10, 2]  # 3+7, 2+9, 1+4+5, the rest
    assert np.array_equal(np.concatenate([merged[i] for i in range(len(merged))]), np.concatenate(docs))
    assert merged[0].dtype == read_indexed(src)[0].dtype
    assert s["documents_in"] == 8 and s["documents_out"] == 4 and s["tokens"] == s["tokens_out"] == 33
    assert {ext: (tmp_path / f"src{ext}").read_bytes() for ext in (".bin", ".idx")} == before
    assert not list(tmp_path.glob("*.tmp-*"))


def test_bad_input_is_refused(tmp_path, capsys):
    src = str(tmp_path / "src")
    write_indexed(src, [np.arange(5)], vocab_size=100)
    with pytest.raises(ValueError, match="must differ"):
        merge_documents(src, src, 10)
    with pytest.raises(ValueError, match=">= 1"):
        merge_documents(src, str(tmp_path / "o"), 0)
    assert main(["--src", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--min-tokens", "4"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o.bin").exists()
