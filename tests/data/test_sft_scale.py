"""SFT at scale: tokenized once into a content-hash cache (rank 0 builds, the others read), several
inputs with per-epoch weights, a validation split, and one-line errors for bad settings."""

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch.multiprocessing as mp

from data.config import SFTConfig, validate
from data.loader import build_sft_loaders
from data.file_hashes import hash_files
from data.sft_cache import cache_key, cache_root, load_sft_cached


def _write(path, n, tag, seed):
    rng = np.random.default_rng(seed)
    rows = [{"messages": [{"role": "user", "content": f"{tag} question {i} " + "x " * int(rng.integers(1, 30))},
                          {"role": "assistant", "content": f"{tag} answer {i}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _same(a, b):
    return len(a.ids) == len(b.ids) and all(np.array_equal(x, y) for x, y in zip(a.ids, b.ids)) and \
        all(np.array_equal(x, y) for x, y in zip(a.masks, b.masks)) and list(a.sources) == list(b.sources)


def test_cache_is_built_once_keyed_by_content_and_settings(tmp_path, tok, monkeypatch):
    a = _write(tmp_path / "a.jsonl", 40, "a", 0)
    cfg = SFTConfig(path=a, tokenizer=tok.path, seq_length=128, cache_dir=str(tmp_path / "cache"))
    first = load_sft_cached(cfg, tok)
    assert first.origin.startswith("tokenized, cached in") and len(first.ids) == 40
    entries = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert entries == [f"sft-{cache_key(cfg, tok.path)}"]  # no temporary leftovers

    import data.sft_cache as sc

    monkeypatch.setattr(sc, "tokenize_inputs", lambda *a, **k: pytest.fail("re-tokenized a cached set"))
    again = load_sft_cached(cfg, tok)
    assert again.origin.startswith("from cache") and _same(first, again) and again.stats == first.stats
    monkeypatch.undo()

    key = cache_key(cfg, tok.path)
    assert cache_key(SFTConfig(**{**cfg.__dict__, "seq_length": 64}), tok.path) != key
    assert cache_key(SFTConfig(**{**cfg.__dict__, "chat_template": "tokenizer"}), tok.path) != key
    assert cache_key(SFTConfig(**{**cfg.__dict__, "val_fraction": 0.1, "seed": 7}), tok.path) == key  # split after
    with open(a, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "r"}]}) + "\n")
    assert cache_key(cfg, tok.path) != key  # content changed
    # default location: next to the (first) input
    assert cache_root(SFTConfig(path=a)) == tmp_path / ".sft_cache"


def test_a_damaged_cache_entry_is_rebuilt_in_one_line_and_never_trained_on(tmp_path, tok):
    import re

    a = _write(tmp_path / "a.jsonl", 40, "a", 5)
    cfg = SFTConfig(path=a, tokenizer=tok.path, seq_length=128, cache_dir=str(tmp_path / "cache"))
    entry = tmp_path / "cache" / f"sft-{cache_key(cfg, tok.path)}"
    first = load_sft_cached(cfg, tok)
    assert first.origin == f"tokenized, cached in {entry}"
    again = load_sft_cached(cfg, tok)
    assert re.fullmatch(rf"from cache {re.escape(str(entry))}, \d+\.\d MiB verified in \d+\.\d\ds", again.origin)
    pristine = {f.name: f.read_bytes() for f in entry.iterdir()}

    def flip(name):
        data = bytearray((entry / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (entry / name).write_bytes(bytes(data))

    def halve(name):
        (entry / name).write_bytes((entry / name).read_bytes()[:len(pristine[name]) // 2])

    def edit_meta(fn):
        meta = json.loads((entry / "meta.json").read_text())
        fn(meta)
        (entry / "meta.json").write_text(json.dumps(meta))

    def out_of_range():
        tokens = np.load(entry / "tokens.npy")
        tokens[len(tokens) // 2] = tok.vocab_size + 5
        np.save(entry / "tokens.npy", tokens)
        edit_meta(lambda m: m["files"].update(hash_files(entry, ["tokens.npy"])))

    size = len(pristine["offsets.npy"])
    damages = [
        (lambda: flip("tokens.npy"), "tokens.npy does not match its checksum"),
        (lambda: halve("offsets.npy"), f"offsets.npy has {size // 2} bytes, the manifest says {size}"),
        (lambda: edit_meta(lambda m: m.pop("read")), "meta.json lacks read"),
        (lambda: (entry / "meta.json").write_text("{"), "meta.json is unreadable (JSONDecodeError)"),
        (lambda: (entry / "masks.npy").unlink(), "masks.npy is missing"),
        (lambda: edit_meta(lambda m: m.update(version=1)), "written by cache version 1, this is version 2"),
        (out_of_range, f"tokens.npy holds token id {tok.vocab_size + 5}, outside the tokenizer's {tok.vocab_size} "
                       f"ids"),  # its hash recomputed: only the range check finds it
    ]
    for damage, problem in damages:
        damage()
        logs = []
        data = load_sft_cached(cfg, tok, log=logs.append)
        assert [ln for ln in logs if ln.startswith("warning:")] == [
            f"warning: SFT cache entry {entry} is damaged ({problem}): tokenizing again to replace it"], problem
        assert data.origin == f"tokenized, rebuilt in {entry}" and _same(data, first)
        assert {f.name: f.read_bytes() for f in entry.iterdir()} == pristine  # replaced by a whole entry
        assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]


def test_a_disk_that_fills_while_the_cache_is_written_is_one_line_and_leaves_no_entry(tmp_path, tok, monkeypatch):
    import shutil

    import data.sft_cache as sc

    a = _write(tmp_path / "a.jsonl", 40, "a", 6)
    cfg = SFTConfig(path=a, tokenizer=tok.path, seq_length=128, cache_dir=str(tmp_path / "cache"))
    usage = shutil.disk_usage

    def full(path):
        return usage(path)._replace(free=0)

    def fills(file, arr, *args, **kwargs):  # numpy's writer reports a full disk without an errno
        with open(file, "wb") as f:
            f.write(b"\0" * 16)
        monkeypatch.setattr(shutil, "disk_usage", full)
        raise OSError(f"{arr.size} requested and 4 written")

    monkeypatch.setattr(sc.np, "save", fills)
    logs = []
    data = load_sft_cached(cfg, tok, log=logs.append)
    assert [ln for ln in logs if ln.startswith("warning:")] == [
        f"warning: cannot write the SFT cache in {tmp_path / 'cache'} (disk full, 0 B free); tokenized without a "
        f"cache (set sft.cache_dir to a writable directory shared by all nodes)"]
    assert data.origin == "tokenized, not cached" and len(data.ids) == 40
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"sft-{cache_key(cfg, tok.path)}.lock"]


def test_weights_repeat_or_subsample_each_input_per_epoch(tmp_path, tok):
    a, b = _write(tmp_path / "a.jsonl", 30, "a", 1), _write(tmp_path / "b.jsonl", 20, "b", 2)
    cfg = SFTConfig(paths=[a, b], weights=[2.0, 0.5], tokenizer=tok.path, seq_length=128, micro_batch_size=1)
    train, valid = build_sft_loaders(cfg, log=lambda m: None)
    assert valid is None and Counter(train.data.sources) == {0: 30, 1: 20}
    for epoch in (0, 1):
        train.epoch = epoch
        order = [i for row in train._epoch_rows() for i in row]
        per_conv = Counter(order)
        assert all(per_conv[i] == 2 for i in range(30))  # input a twice
        assert sum(1 for i in range(30, 50) if per_conv[i] == 1) == 10 and max(per_conv[i] for i in range(30, 50)) == 1
    train.epoch = 0
    half0 = {i for row in train._epoch_rows() for i in row if i >= 30}
    train.epoch = 1
    assert half0 != {i for row in train._epoch_rows() for i in row if i >= 30}  # drawn anew per epoch
    assert "weights" in train.state_dict()["fingerprint"]


def test_validation_split_is_disjoint_deterministic_and_evaluable(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", 50, "a", 3)
    cfg = SFTConfig(path=a, tokenizer=tok.path, seq_length=128, micro_batch_size=1, val_fraction=0.2, seed=5)
    train, valid = build_sft_loaders(cfg, log=lambda m: None)
    def key(x):
        return tuple(np.asarray(x).tolist())

    tr, va = {key(x) for x in train.data.ids}, {key(x) for x in valid.data.ids}
    assert len(va) == 10 and len(tr) == 40 and not tr & va
    _, valid2 = build_sft_loaders(cfg, log=lambda m: None)
    assert {key(x) for x in valid2.data.ids} == va
    first = next(valid)
    next(valid)
    valid.reset()
    assert all((first[k] == v).all() for k, v in next(valid).items() if hasattr(v, "shape"))


@pytest.mark.parametrize("change,msg", [
    ({"paths": ["x.jsonl"]}, "sft.path and sft.paths are both set"),
    ({"path": "", "paths": ["a", "b"], "weights": [1.0]}, "sft.weights has 1 entries but there are 2 inputs"),
    ({"weights": [-1.0]}, "must be non-negative"),
    ({"val_fraction": 1.0}, "sft.val_fraction=1.0 must be in [0, 1)"),
    ({"path": "", "paths": ["/nonexistent/b.jsonl"]}, "sft.paths entry='/nonexistent/b.jsonl' does not exist"),
])
def test_bad_sft_settings_are_one_line(tmp_path, tok, change, msg):
    a = _write(tmp_path / "a.jsonl", 3, "a", 0)
    cfg = SFTConfig(**{**SFTConfig(path=a, tokenizer=tok.path).__dict__, **change})
    with pytest.raises(ValueError) as e:
        validate(cfg)
    assert msg in str(e.value) and "\n" not in str(e.value)


def _rank(rank, path, bad, tok_dir, cache, init, out):
    import torch.distributed as dist

    from data.sources import BadInputError
    from data.tokenizer import Tokenizer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cfg = SFTConfig(path=path, tokenizer=tok_dir, seq_length=128, cache_dir=cache)
    data = load_sft_cached(cfg, Tokenizer(tok_dir))
    try:  # unusable data: rank 0's one line reaches every rank
        load_sft_cached(SFTConfig(path=bad, tokenizer=tok_dir, seq_length=128, cache_dir=cache), Tokenizer(tok_dir))
        error = None
    except BadInputError as e:
        error = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"origin": data.origin, "n": len(data.ids), "tokens": int(sum(len(x) for x in data.ids)),
                   "error": error}, f)
    dist.destroy_process_group()


def test_rank0_tokenizes_and_the_other_rank_reads_the_cache(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", 30, "a", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    cache = str(tmp_path / "cache")
    mp.start_processes(_rank, args=(a, str(bad), tok.path, cache, f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["origin"].startswith("tokenized, cached in") and r1["origin"].startswith("from cache")
    assert (r0["n"], r0["tokens"]) == (r1["n"], r1["tokens"]) and r0["n"] == 30
    assert r0["error"] == r1["error"] and r1["error"].startswith("no usable conversations in") and \
        "no assistant turn" in r1["error"]
