"""RULER-style task generators: answers are where the samples say, lengths fit, seeds reproduce."""

import re
from collections import Counter

import pytest

from eval.tasks import TASKS, encoder, load_haystack
from eval.tasks.ruler import generate, item_token_spans

LENGTH = 512


@pytest.fixture(scope="module")
def gen(small_demo):
    from data.tokenizer import Tokenizer

    tok = Tokenizer(small_demo["tokenizer"])
    hay = load_haystack(small_demo["corpus"], tok)
    enc = encoder(tok)
    return tok, enc, lambda task, seed=0, n=3, length=LENGTH: generate(task, hay, enc, length, n, seed)


@pytest.mark.parametrize("task", list(TASKS))
def test_fits_the_length_and_reproduces_by_seed(gen, task):
    tok, enc, make = gen
    a, b, other = make(task), make(task), make(task, seed=1)
    assert a == b and a != other
    for s in a:
        assert s.tokens == len(enc(s.full_text())) <= LENGTH
        assert s.tokens >= 0.7 * LENGTH, (task, s.tokens)
        full, spans = item_token_spans(s, enc)
        for (lo, hi), cont in zip(spans, s.continuations()):  # each item's tokens decode to its continuation
            assert tok.decode(full[lo:hi]) == cont


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needles_hold_the_answers(gen, task):
    _, _, make = gen
    for s in make(task):
        assert len(s.evidence) == len(s.answers)
        for (lo, hi), value in zip(s.evidence, s.answers):
            needle = s.prompt[lo:hi]
            assert re.fullmatch(r"One of the special magic numbers for [a-z]+ is: \d{7}\.", needle), needle
            assert needle.endswith(f" {value}.") and s.prompt.count(value) == 1
            key = needle.split(" for ")[1].split(" is:")[0]
            assert key in s.prompt[s.prompt.rindex("\n"):]  # the question asks for this key
        if task == "niah_multivalue":  # answers in order of appearance
            assert [lo for lo, _ in s.evidence] == sorted(lo for lo, _ in s.evidence)
        if task == "niah_multiquery":  # answers in the order the question names the keys
            question = s.prompt[s.prompt.rindex("\n"):]
            keys = [s.prompt[lo:hi].split(" for ")[1].split(" is:")[0] for lo, hi in s.evidence]
            assert [question.index(k) for k in keys] == sorted(question.index(k) for k in keys)


def test_variable_tracking_chain(gen):
    _, _, make = gen
    for s in make("vt"):
        value = re.search(r"assigned the value (\d+) in the text", s.prompt).group(1)
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d+)\.", s.prompt))
        holds, changed = {value}, True
        while changed:  # every variable whose chain ends in the value
            new = {n for n, src in assigned.items() if src in holds}
            changed = not new <= holds
            holds |= new
        assert holds - {value} == set(s.answers) and len(s.answers) == 5
        assert [s.prompt[lo:hi].split()[1] for lo, hi in s.evidence] == s.answers  # chain order = text order


def test_common_words(gen):
    _, _, make = gen
    for s in make("cwe"):
        listing = re.findall(r"^\d+\. ([a-z]+)$", s.prompt, re.M)
        counts = Counter(listing)
        top = max(counts.values())
        assert {w for w, c in counts.items() if c == top} == set(s.answers)
        assert sorted(counts.values())[-len(s.answers) - 1] < top  # strictly more than every other word
        assert s.answers == sorted(s.answers, key=listing.index)


def test_frequent_words(gen):
    _, _, make = gen
    for s in make("fwe"):
        body = s.prompt.split("\n", 1)[1].rsplit("\nQuestion:", 1)[0]
        counts = Counter(body.split()).most_common()
        assert [w for w, _ in counts[:3]] == s.answers
        assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]


def test_task_set_files_and_lm_eval_configs(small_demo, tmp_path):
    import json

    from data.tokenizer import Tokenizer
    from eval.errors import EvalError
    from eval.tasks import TaskSetConfig, build_task_set, load_task_set

    tok = Tokenizer(small_demo["tokenizer"])
    out = build_task_set(small_demo["corpus"], tok, tmp_path / "ts",
                         TaskSetConfig(lengths=[384], tasks=["niah_single", "vt"], samples=2, train_docs=1),
                         log=lambda *_: None)
    ts = load_task_set(out)
    for task in ("niah_single", "vt"):
        rows = ts.samples(task, 384)
        items = [json.loads(x) for x in (out / f"{task}_384.items.jsonl").read_text().splitlines()]
        assert len(items) == sum(len(r["answers"]) for r in rows)
        for it in items:  # context + continuation is a prefix of the sample's full text
            r = rows[it["sample"]]
            full = r["prompt"] + "".join((" " if j == 0 else ", ") + a for j, a in enumerate(r["answers"]))
            assert full.startswith(it["context"] + it["continuation"])
        yaml = (out / f"nosa_ruler_{task}_384.yaml").read_text()
        assert f"test: {out.resolve() / f'{task}_384.items.jsonl'}" in yaml and "output_type: loglikelihood" in yaml
    assert len((out / "train.jsonl").read_text().splitlines()) == 2
    with pytest.raises(EvalError, match="exceed the model's max_position_embeddings=256"):
        ts.pick_lengths(None, 256)
    with pytest.raises(EvalError, match="exists and is not a task set"):
        build_task_set(small_demo["corpus"], tok, tmp_path, TaskSetConfig(lengths=[384]), log=lambda *_: None)
