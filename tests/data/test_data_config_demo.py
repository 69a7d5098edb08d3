"""Config validation (one-line errors) and the offline demo build (content, caching)."""

import ast
import json
import os
import sysconfig
import time

import pytest

from data.config import DataConfig, SFTConfig, validate
from data.demo_corpus import SMALL, build_demo, sft_examples_from_source
from data.sft import check_conversation


@pytest.mark.parametrize("kw, msg", [
    (dict(paths=[]), "data.paths is empty"),
    (dict(weights=[1.0, 2.0]), "one weight per path"),
    (dict(weights=[-1.0]), "non-negative"),
    (dict(packing="thd"), "data.packing='thd'"),
    (dict(eod_mask_loss=False), "across documents"),
    (dict(split="90,x"), "comma-separated numbers"),
    (dict(seq_length=0), "seq_length=0"),
    (dict(train_samples=0), "train_samples=0"),
    (dict(paths=["/nonexistent/prefix"]), "python -m data.preprocess"),
])
def test_data_config_errors_are_one_line(demo, kw, msg):
    base = dict(paths=[demo["indexed_prefix"]], tokenizer=demo["tokenizer"])
    validate(DataConfig(**base))  # the base is valid
    with pytest.raises(ValueError, match=msg) as e:
        validate(DataConfig(**{**base, **kw}))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, msg", [
    (dict(chat_template="llama"), "chat_template"), (dict(overlong="cut"), "overlong"),
    (dict(on_bad_example="ignore"), "on_bad_example"), (dict(path="/no/such.jsonl"), "does not exist"),
    (dict(tokenizer="/tmp"), "no tokenizer.json"), (dict(micro_batch_size=0), "micro_batch_size"),
])
def test_sft_config_errors(demo, kw, msg):
    base = dict(path=demo["sft"], tokenizer=demo["tokenizer"])
    validate(SFTConfig(**base))
    with pytest.raises(ValueError, match=msg):
        validate(SFTConfig(**{**base, **kw}))


def test_empty_dataset_and_oversized_tokenizer_are_one_line_errors(demo, tmp_path):
    from data.indexed import write_indexed

    empty = str(tmp_path / "empty")
    write_indexed(empty, [], vocab_size=1024)
    open(str(tmp_path / "zero") + ".bin", "w").close()
    open(str(tmp_path / "zero") + ".idx", "w").close()
    for prefix, msg in ((empty, "is empty \\(0 documents\\)"), (str(tmp_path / "zero"), "not a megatron index")):
        with pytest.raises(ValueError, match=msg) as e:
            validate(DataConfig(paths=[prefix], tokenizer=demo["tokenizer"]))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="model's vocabulary is 100"):
        validate(DataConfig(paths=[demo["indexed_prefix"]], tokenizer=demo["tokenizer"], model_vocab_size=100))


def test_demo_contents(demo, tok):
    rows = [json.loads(x) for x in open(demo["corpus"])]
    assert {r["source"] for r in rows} == {"python-stdlib", "common-licenses", "debian-doc"}
    stdlib = sysconfig.get_paths()["stdlib"]
    r = next(r for r in rows if r["source"] == "python-stdlib")
    assert open(os.path.join(stdlib, r["path"]), encoding="utf-8").read().startswith(r["text"])  # real text
    assert tok.vocab_size == SMALL.vocab_size
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tok.token_id(t) is not None
    sft = [json.loads(x) for x in open(demo["sft"])]
    assert len(sft) == SMALL.sft_max_examples
    assert all(check_conversation(s["messages"]) is None for s in sft)
    long = [json.loads(x) for x in open(demo["longctx"])]
    assert {x["task"] for x in long} == {"passkey", "multikey"}
    for x in long:
        prompt = x["messages"][0]["content"]
        assert x["answer"] in prompt and x["messages"][1]["content"] == x["answer"]
        assert 0.9 * x["context_tokens"] <= x["prompt_tokens"] <= x["context_tokens"]
        assert x["prompt_tokens"] == len(tok.encode_plain([prompt])[0])


def test_sft_pairs_come_from_the_source_signatures():
    src = ('def area(w, h=1, *, unit="m"):\n    """Return the area of a rectangle of width w and height h."""\n'
           '    return w * h\n'
           'def _private(x):\n    """Hidden helper function that should be skipped."""\n')
    pairs = list(sft_examples_from_source("geo", src))
    assert len(pairs) == 2
    q, a, _ = pairs[0]
    assert "Return the area of a rectangle" in q and "def area(w, h=1, *, unit='m')" in a and "`geo.area`" in a
    ast.parse(a.split("```python\n")[1].split("\n```")[0] + ": pass")


def test_demo_cache_is_reused(demo):
    out = os.path.dirname(demo["corpus"])
    mtime = os.path.getmtime(demo["indexed_prefix"] + ".bin")
    t = time.perf_counter()
    again = build_demo(out, SMALL)
    assert time.perf_counter() - t < 2.0 and again == demo
    assert os.path.getmtime(demo["indexed_prefix"] + ".bin") == mtime


def test_demo_cli_prints_paths_from_cache(demo):
    import subprocess
    import sys

    out = os.path.dirname(demo["corpus"])
    import data

    repo = os.path.dirname(os.path.dirname(os.path.abspath(data.__file__)))
    r = subprocess.run([sys.executable, "-m", "data.demo_corpus", "--small", "--out", out],
                       capture_output=True, text=True, timeout=60, cwd=repo)
    assert r.returncode == 0, r.stderr
    printed = dict(line.split("=", 1) for line in r.stdout.strip().splitlines())
    assert printed == {k: demo[k] for k in ("corpus", "tokenizer", "indexed_prefix", "sft", "longctx")}
