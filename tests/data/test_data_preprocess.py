"""python -m data.preprocess: .bin/.idx round-trip, bad-input accounting, other input formats."""

import json

import numpy as np
import pytest

from data.indexed import read_indexed
from data.preprocess import main, preprocess
from data.sources import BadInputError

DOCS = ["def f(x):\n    return x + 1\n", "GNU GENERAL PUBLIC LICENSE\n\nVersion 3, 29 June 2007",
        "literal <|endoftext|> in text stays text", "ünïcödé — ok"]


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_round_trip(tmp_path, tok):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t, "meta": i} for i, t in enumerate(DOCS)])
    s = preprocess(str(src), tok.path, str(tmp_path / "out"), progress=False)
    ds = read_indexed(str(tmp_path / "out"))
    assert len(ds) == s["documents"] == len(DOCS)
    assert s["tokens"] == int(ds.sequence_lengths.sum())
    for i, text in enumerate(DOCS):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]  # literal special-token text is not EOD
        assert tok.decode(ids[:-1]) == text
    assert ds[0].dtype == np.uint16  # vocab < 65536 -> smallest dtype
    assert json.loads((tmp_path / "out.summary.json").read_text())["documents"] == len(DOCS)


def test_bad_rows_are_counted_with_reason_and_line(tmp_path, tok):
    src = tmp_path / "bad.jsonl"
    _write_jsonl(src, [{"text": "good one"}, "{not json", "[1, 2]", {"body": "no text key"},
                       {"text": 5}, {"text": "   \n"}, {"text": "good two"}, ""])
    s = preprocess(str(src), tok.path, str(tmp_path / "o"), progress=False)
    rej = s["read"]["rejected"]
    assert s["documents"] == 2 and s["read"]["rows"] == 7
    assert rej == {"malformed JSON": 1, "JSON value is not an object": 1, "missing field 'text'": 1,
                   "field 'text' is not a string": 1, "empty document": 1}
    assert s["read"]["first_at"]["malformed JSON"].endswith("bad.jsonl:2")
    assert s["read"]["first_at"]["empty document"].endswith("bad.jsonl:6")
    with pytest.raises(BadInputError, match=r"bad.jsonl:2: malformed JSON"):
        preprocess(str(src), tok.path, str(tmp_path / "o2"), strict=True, progress=False)


def test_cli_summary_and_one_line_errors(tmp_path, tok, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"content": t} for t in DOCS] + ["oops"])
    assert main(["--input", str(src), "--tokenizer", tok.path, "--out", str(tmp_path / "c"),
                 "--text-key", "content"]) == 0
    out = capsys.readouterr().out
    assert f"{len(DOCS)} documents" in out and "skipped 1 row(s): malformed JSON" in out
    # tokenizer vocabulary larger than the model's: refused, one line
    rc = main(["--input", str(src), "--tokenizer", tok.path, "--out", str(tmp_path / "d"), "--model-vocab-size", "100"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "model's vocabulary is 100" in err
    # all rows rejected (wrong key): an error, not an empty dataset
    assert main(["--input", str(src), "--tokenizer", tok.path, "--out", str(tmp_path / "e")]) == 2
    assert "no usable documents" in capsys.readouterr().err


def test_parquet_and_hf_dir_match_jsonl(tmp_path, tok):
    import datasets

    rows = [{"text": t} for t in DOCS]
    _write_jsonl(tmp_path / "a.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "hfdir"))
    out = {}
    for name, path in [("j", "a.jsonl"), ("p", "a.parquet"), ("h", "hfdir")]:
        preprocess(str(tmp_path / path), tok.path, str(tmp_path / name), progress=False)
        r = read_indexed(str(tmp_path / name))
        out[name] = [r[i].tolist() for i in range(len(r))]
    assert out["j"] == out["p"] == out["h"] and len(out["j"]) == len(DOCS)


def _files(prefix):
    return {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}


def test_failed_or_interrupted_runs_leave_an_existing_dataset_untouched(tmp_path, tok, monkeypatch):
    import data.preprocess as pre

    good = tmp_path / "good.jsonl"
    _write_jsonl(good, [{"text": t} for t in DOCS])
    out = str(tmp_path / "ds")
    preprocess(str(good), tok.path, out, progress=False)
    before = _files(out)
    (tmp_path / "empty.jsonl").write_text("")
    bad = tmp_path / "bad.jsonl"
    _write_jsonl(bad, [{"text": "fine"}, "{oops"])
    failing = [(str(tmp_path / "empty.jsonl"), {}, ValueError, "no usable documents"),  # empty input
               (str(good), {"text_key": "body"}, ValueError, "nothing was written"),  # wrong text key
               (str(bad), {"strict": True}, BadInputError, "malformed JSON")]  # --strict stop
    for src, kw, exc, msg in failing:
        with pytest.raises(exc, match=msg):
            preprocess(src, tok.path, out, progress=False, **kw)
        assert _files(out) == before

    def interrupted(*a, **k):  # Ctrl-C after the first document
        yield DOCS[0]
        raise KeyboardInterrupt

    monkeypatch.setattr(pre, "iter_texts", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(str(good), tok.path, out, progress=False)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds")) == \
        ["ds.bin", "ds.idx", "ds.summary.json"]  # no temporary files left


def test_disk_full_ctrl_c_and_sigterm_are_one_line_and_leave_no_temporary_files(tmp_path, tok, monkeypatch, capsys):
    import errno
    import os
    import signal

    import data.preprocess as pre
    from data.indexed import IndexedWriter

    good = tmp_path / "good.jsonl"
    _write_jsonl(good, [{"text": t} for t in DOCS * 50])
    out = str(tmp_path / "ds")
    preprocess(str(good), tok.path, out, progress=False)
    before = _files(out)
    argv = ["--input", str(good), "--tokenizer", tok.path, "--out", out]

    def left():
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds"))

    add = IndexedWriter.add

    def disk_fills(self, ids):  # the .bin gets some bytes, then the disk is full
        if self.documents == 20:
            self._builder.data_file.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        add(self, ids)

    monkeypatch.setattr(IndexedWriter, "add", disk_fills)
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("preprocess:")]
    assert len(err) == 1 and err[0].startswith(f"[preprocess] error: disk full writing {out}.bin in {tmp_path} ("), err
    assert "the temporary files were removed and an existing" in err[0] and "; free about " in err[0]
    assert _files(out) == before and left() == ["ds.bin", "ds.idx", "ds.summary.json"]
    monkeypatch.undo()

    def texts(*a, **k):  # Ctrl-C, then SIGTERM after the first document
        yield DOCS[0]
        if stop == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), stop)
        yield DOCS[1]

    def unhandled(signum, frame):
        raise AssertionError("data.preprocess left SIGTERM to its default action (the process dies, temp files stay)")

    monkeypatch.setattr(pre, "iter_texts", texts)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        for stop, rc, how in ((signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")):
            assert main(argv) == rc
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("preprocess:")]
            assert err == [f"[preprocess] interrupted ({how}): the temporary files were removed and an existing "
                           f"{out}.* is untouched"], err
            assert _files(out) == before and left() == ["ds.bin", "ds.idx", "ds.summary.json"]
        assert signal.getsignal(signal.SIGTERM) is unhandled  # main() puts the previous handler back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, tok, monkeypatch, capsys):
    """``--out`` on a read-only file system (simulated: root writes anywhere else)."""
    import errno
    import os

    from data.indexed import IndexedWriter

    good = tmp_path / "good.jsonl"
    _write_jsonl(good, [{"text": t} for t in DOCS])
    out = str(tmp_path / "ro" / "ds")

    def read_only(self, prefix, vocab_size):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), prefix + ".bin")

    monkeypatch.setattr(IndexedWriter, "__init__", read_only)
    assert main(["--input", str(good), "--tokenizer", tok.path, "--out", out]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("preprocess:")]
    assert len(err) == 1 and err[0].startswith(f"[preprocess] error: --out {out}: cannot write {out}.tmp-"), err
    assert err[0].endswith(".bin (Read-only file system); give an --out where files can be written"), err


def test_long_documents_are_encoded_in_pieces_with_the_same_tokens(demo, tok):
    from data.preprocess import encode_documents, split_for_encoding

    texts = [r["text"] for r in map(json.loads, open(demo["corpus"]))][:6]
    texts.append("x" * 1000)  # no boundary at all: hard cuts
    whole = [np.asarray(ids) for ids in tok.encode_plain(texts)]
    for piece_chars in (300, 3000):
        for text in texts:
            pieces = split_for_encoding(text, piece_chars)
            assert "".join(pieces) == text and max(map(len, pieces)) <= piece_chars
        got = encode_documents(tok, texts, piece_chars)
        for g, w, text in zip(got[:-1], whole[:-1], texts):  # cuts at line / word starts: identical ids
            assert np.array_equal(g, w), text[:80]
        assert tok.decode(got[-1]) == texts[-1]


def test_invalid_utf8_rows_are_counted_not_repaired(tmp_path, tok):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'{"text": "good"}\n{"text": "caf\xe9"}\n{"text": "also good"}\n')
    s = preprocess(str(src), tok.path, str(tmp_path / "o"), progress=False)
    assert s["documents"] == 2 and s["read"]["rejected"] == {"invalid UTF-8": 1}
    assert s["read"]["first_at"]["invalid UTF-8"].endswith("latin1.jsonl:2")
    with pytest.raises(BadInputError, match="latin1.jsonl:2: invalid UTF-8"):
        preprocess(str(src), tok.path, str(tmp_path / "o2"), strict=True, progress=False)


def test_the_token_id_range_is_recorded_once_and_read_again_only_when_the_data_changed(tmp_path, tok, monkeypatch):
    """A run checks every token id against the model's vocabulary at its start: for a dataset this tool wrote,
    from the range recorded in ``<prefix>.summary.json`` (no pass over the tokens, which on a cluster's corpus
    is minutes per start); a ``.bin`` changed since is read again, and its new ids are seen."""
    import os

    from data import indexed

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t} for t in DOCS])
    preprocess(str(src), tok.path, str(tmp_path / "out"), progress=False)
    prefix = str(tmp_path / "out")
    ds = read_indexed(prefix)
    ids = np.concatenate([ds[i] for i in range(len(ds))])
    del ds
    want = (int(ids.min()), int(ids.max()))
    assert json.loads((tmp_path / "out.summary.json").read_text())["token_id_range"] == list(want)
    monkeypatch.setattr(np, "memmap", None)  # the recorded range is used: the tokens are not mapped
    assert indexed.token_id_range(prefix) == want
    monkeypatch.undo()
    raw = bytearray((tmp_path / "out.bin").read_bytes())
    raw[0:2] = (60000).to_bytes(2, "little")  # a damaged first token, same size
    (tmp_path / "out.bin").write_bytes(bytes(raw))
    os.utime(tmp_path / "out.bin", ns=(0, 1))  # a new modification time even on a coarse clock
    assert indexed.token_id_range(prefix)[1] == 60000  # read again: the record describes another file
    with pytest.raises(ValueError, match="token id 60000"):
        indexed.check_token_ids(prefix, tok.vocab_size, "data.paths entry")


def test_the_command_folds_megatron_cores_import_warnings_into_one_note(tmp_path):
    """``python -m data.preprocess`` imports megatron-core (its indexed writer), which warns once per module
    without Transformer Engine / Apex and logs that no CUDA runtime is found: one note line on stdout instead;
    stderr keeps only the progress bar."""
    import subprocess
    import sys

    from data.third_party_noise import missing_optional, note_line
    from data.tokenizer import train_bpe
    from tests.subproc import REPO, child_env

    tok = train_bpe(DOCS * 10, 300, str(tmp_path / "tok"), min_frequency=1)
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t} for t in DOCS])
    p = subprocess.run([sys.executable, "-m", "data.preprocess", "--input", str(src), "--tokenizer", tok, "--out",
                        str(tmp_path / "out")], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    out, note = p.stdout.splitlines(), [note_line()] if missing_optional() else []
    assert out[:len(note)] == note and out.count(note_line()) == len(note), out
    assert f"{len(DOCS)} documents" in out[len(note)]
    noise = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("preprocess:")]
    assert noise == [], noise  # was 9 lines: 4 UserWarnings (2 lines each) and torch's CUDA runtime line
