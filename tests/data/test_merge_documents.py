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


def test_a_damaged_source_or_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    """A 0-byte or short ``--src`` .bin names the file (megatron-core's reader failed inside, then twice in
    ``__del__``); a disk that fills up leaves no temporary file and the earlier output as it was."""
    import errno
    import os
    import shutil

    from data.indexed import IndexedWriter

    src, out = str(tmp_path / "src"), str(tmp_path / "long")
    write_indexed(src, [np.arange(n) for n in (30, 50, 20, 40)], vocab_size=100)
    good = (tmp_path / "src.bin").read_bytes()
    argv = ["--src", src, "--out", out, "--min-tokens", "60"]
    for damaged in (b"", good[:-2]):
        (tmp_path / "src.bin").write_bytes(damaged)
        assert main(argv) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err == [f"error: {src}.bin holds {len(damaged)} bytes but {src}.idx describes 4 documents of 140 tokens "
                       f"(280 bytes): the dataset is damaged or incomplete; rebuild it with `python -m "
                       f"data.preprocess`"], err
    (tmp_path / "src.bin").write_bytes(good)
    assert main(argv) == 0
    capsys.readouterr()
    before = {ext: (tmp_path / f"long{ext}").read_bytes() for ext in (".bin", ".idx")}
    add, usage = IndexedWriter.add, shutil.disk_usage

    def disk_fills(self, ids):  # the .bin gets some bytes, then the disk is full
        if self.documents == 1:
            self._builder.data_file.write(b"\0" * 64)
            monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=0))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        add(self, ids)

    monkeypatch.setattr(IndexedWriter, "add", disk_fills)
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"error: disk full writing {out}.bin in {tmp_path} (0 B free) after "), err
    assert f"the temporary files were removed and an existing {out}.* is untouched; free about " in err[0]
    assert err[0].endswith(" there and run again"), err
    assert {ext: (tmp_path / f"long{ext}").read_bytes() for ext in (".bin", ".idx")} == before
    assert not list(tmp_path.glob("*.tmp-*"))
