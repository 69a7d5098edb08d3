"""SFT: ChatML rendering, assistant-only masks, bad / over-long examples, packed loader and resume."""

import json

import numpy as np
import pytest
import torch

from data.config import SFTConfig
from data.loader import build_sft_loader
from data.sft import render_chatml, tokenize_conversation
from data.sources import BadInputError
from data.tokenizer import IM_END

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And in words,\n\nplease?"},
    {"role": "assistant", "content": " Four —\nexactly four."},
]


def _runs(mask):
    """Contiguous [start, end) runs of ones."""
    d = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def test_chatml_renderer_matches_the_tokenizer_template(tok):
    text, _ = render_chatml(CONV)
    assert text == tok.hf.apply_chat_template(CONV, tokenize=False)


@pytest.mark.parametrize("template", ["chatml", "tokenizer"])
def test_mask_covers_exactly_assistant_content_and_end_of_turn(tok, template):
    ids, mask = tokenize_conversation(tok, CONV, template)
    runs = _runs(mask)
    answers = [m["content"] for m in CONV if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    end = tok.token_id(IM_END)
    for (a, b), ans in zip(runs, answers):
        assert tok.decode(ids[a:b].tolist()) == ans + IM_END
        assert ids[b - 1] == end
    # everything outside the runs decodes to the non-assistant part of the rendering
    text, spans = render_chatml(CONV)
    outside = "".join(tok.decode(ids[a:b].tolist()) for a, b in _runs(1 - mask))
    assert outside == "".join(text[s:e] for s, e in zip([0] + [e for _, e in spans],
                                                        [s for s, _ in spans] + [len(text)]))


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _conv(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_bad_examples_are_counted_or_refused(tmp_path, tok):
    rows = [_conv("hi", "hello"),
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": []}, {"text": "no messages"}, {"messages": [{"role": "user", "content": "only a question"}]},
            {"messages": [{"role": "user"}]}, "{broken", _conv("q2", "a2")]
    path = _write(tmp_path / "bad.jsonl", rows)
    cfg = SFTConfig(path=path, tokenizer=tok.path, seq_length=64, micro_batch_size=1)
    # 6 of 8 rows unusable: above max_dropped_fraction=0.5 by default, one line naming the limit
    with pytest.raises(BadInputError,
                       match=r"6 of 8 conversations .* \(75%\) are unusable .*max_dropped_fraction") as e:
        build_sft_loader(cfg, log=lambda m: None)
    assert "\n" not in str(e.value)
    cfg.max_dropped_fraction = 0.8  # allowed, but above warn_dropped_fraction: one warning line
    logs = []
    loader = build_sft_loader(cfg, log=logs.append)
    assert loader.stats == {"skipped: unknown role 'wizard'": 1, "skipped: missing or empty 'messages'": 2,
                            "skipped: no assistant turn": 1, "skipped: malformed JSON": 1,
                            "skipped: malformed message (needs string 'role' and 'content')": 1}
    assert len(loader.data.ids) == 2 and len(logs) == 2 and "2 conversations kept" in logs[1]
    assert logs[0].startswith("warning: 6 of 8 SFT conversations (75%)")
    cfg.on_bad_example = "error"
    with pytest.raises(BadInputError, match=r"bad.jsonl:2: unknown role 'wizard'"):
        build_sft_loader(cfg)


def test_overlong_truncate_or_drop(tmp_path, tok):
    long = _conv("short question", "word " * 300)
    path = _write(tmp_path / "long.jsonl", [_conv("a", "b"), long, _conv("c", "d")])
    t = build_sft_loader(SFTConfig(path=path, tokenizer=tok.path, seq_length=64, overlong="truncate"),
                         log=lambda m: None)
    assert t.stats == {"truncated": 1} and max(len(x) for x in t.data.ids) == 64
    d = build_sft_loader(SFTConfig(path=path, tokenizer=tok.path, seq_length=64, overlong="drop"), log=lambda m: None)
    assert d.stats == {"dropped_overlong": 1} and len(d.data.ids) == 2
    # a truncation that leaves no assistant token is a counted skip, not a silent drop
    q_only = _conv("question " * 300, "answer")
    path2 = _write(tmp_path / "q.jsonl", [q_only, _conv("a", "b")])
    q = build_sft_loader(SFTConfig(path=path2, tokenizer=tok.path, seq_length=64), log=lambda m: None)
    assert q.stats == {"truncated": 1, "skipped: no assistant tokens within seq_length": 1}


def test_model_vocab_smaller_than_tokenizer_is_refused(demo, tok):
    cfg = SFTConfig(path=demo["sft"], tokenizer=tok.path, model_vocab_size=tok.vocab_size - 1)
    with pytest.raises(ValueError, match=f"use a model with vocab_size >= {tok.vocab_size}"):
        build_sft_loader(cfg)


def _segments(batch):
    for r in range(batch["tokens"].shape[0]):
        n = int(batch["cu_seqlens_len"][r])
        cu = batch["cu_seqlens"][r, :n].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            yield r, s, e


def test_packed_epoch_holds_each_conversation_once_with_its_mask(demo, tok):
    cfg = SFTConfig(path=demo["sft"], tokenizer=tok.path, seq_length=512, micro_batch_size=1)
    loader = build_sft_loader(cfg, log=lambda m: None)
    data = loader.data
    by_key = {tuple(x.tolist()): i for i, x in enumerate(data.ids)}
    seen = []
    for _ in range(len(loader)):
        b = next(loader)
        for r, s, e in _segments(b):
            toks = b["tokens"][r, s:e]
            if b["loss_mask"][r, s:e].sum() == 0 and (toks == toks[0]).all():
                continue  # the padding segment
            i = by_key[tuple(toks.tolist())]
            seen.append(i)
            assert b["position_ids"][r, s:e].tolist() == list(range(e - s))
            assert torch.equal(b["labels"][r, s:e - 1], toks[1:])
            assert torch.equal(b["loss_mask"][r, s:e - 1], torch.as_tensor(data.masks[i][1:], dtype=torch.float32))
            assert b["loss_mask"][r, e - 1] == 0
    assert sorted(seen) == list(range(len(data.ids)))  # B*D = 1: nothing dropped, nothing twice
    assert loader.epoch == 0 and next(loader) is not None and loader.epoch == 1


def test_sft_resume_mid_epoch_and_across_epochs(demo, tok):
    cfg = SFTConfig(path=demo["sft"], tokenizer=tok.path, seq_length=256, micro_batch_size=2)
    ref = build_sft_loader(cfg, 1, 2, tokenizer=tok, log=lambda m: None)
    n = len(ref)
    for _ in range(n - 2):
        next(ref)
    state = ref.state_dict()
    expected = [next(ref) for _ in range(5)]  # crosses into epoch 1 (repacked in a new order)
    assert ref.epoch == 1
    other = build_sft_loader(cfg, 1, 2, tokenizer=tok, log=lambda m: None)
    other.load_state_dict(state)
    for e in expected:
        g = next(other)
        assert all(torch.equal(torch.as_tensor(g[k]), torch.as_tensor(e[k])) for k in e)
    r0 = build_sft_loader(cfg, 0, 2, tokenizer=tok, log=lambda m: None)
    r0.load_state_dict(state)
    assert not torch.equal(next(r0)["tokens"], expected[0]["tokens"])  # ranks read different rows
