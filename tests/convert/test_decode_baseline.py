"""bench.decode_baseline: the static-cache dense decode fixes a LongRoPE model's long/short choice once the
prompt is past the original context (so the compiled step has no per-call length check), exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.decode_baseline import pin_longrope, static_cache, static_decode
from checkpoints_convert.random_export import stock_llama
from nosa_layers.rope.longrope import LongRoPEConfig
from tests.recipes import model_recipe


def _longrope_llama(seed: int):
    half = 8  # head_dim 16: 8 rotary frequencies
    g = torch.Generator().manual_seed(seed)
    long = [round(1.0 + 3.0 * float(x), 4) for x in torch.rand(half, generator=g)]
    m = dataclasses.replace(model_recipe("tiny"), vocab_size=256, max_position_embeddings=128, rope_type="longrope",
                            longrope=LongRoPEConfig(short_factor=[1.0] * half, long_factor=long,
                                                    original_max_position_embeddings=64))
    torch.manual_seed(seed)
    return stock_llama(m)


@torch.no_grad()
def _greedy_logits(model, prompt, steps: int, pin: bool, force_short: bool = False):
    B, n = prompt.shape
    cache = static_cache(model, B, n + steps + 4, prompt.device, torch.float32)
    out = model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(n))
    if pin:
        assert pin_longrope(model, n) == "pinned_long"
    if force_short:  # the other factors: what a wrong pin would give
        rot = model.model.rotary_emb
        rot.inv_freq.copy_(rot.original_inv_freq)
        rot.rope_type = "pinned_short"
    logits, tok = [], out.logits[:, -1:].argmax(-1)
    for i in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([n + i]))
        logits.append(out.logits[:, -1])
        tok = out.logits[:, -1:].argmax(-1)
    model.model.rotary_emb.rope_type = "longrope"
    return torch.stack(logits, 1)


@pytest.mark.parametrize("seed", [3, 11])
def test_pinned_longrope_decodes_exactly_like_the_per_call_check(seed):
    model = _longrope_llama(seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompt = torch.randint(0, 256, (2, 67 + seed % 5), generator=g)  # past the original 64 positions
    want = _greedy_logits(model, prompt, 5, pin=False)
    got = _greedy_logits(model, prompt, 5, pin=True)
    assert torch.equal(got, want)
    wrong = _greedy_logits(model, prompt, 5, pin=False, force_short=True)
    assert (wrong - want).abs().max() > 1e-3  # the factors matter at these positions: the test can fail


def test_no_pin_within_the_original_context_or_without_longrope():
    model = _longrope_llama(5)
    assert pin_longrope(model, 64) is None  # a decode from here crosses the boundary: the check stays
    assert model.model.rotary_emb.rope_type == "longrope"
    plain = stock_llama(dataclasses.replace(model_recipe("tiny"), vocab_size=256))
    assert pin_longrope(plain, 1000) is None


def test_static_decode_reports_the_pinned_rope():
    model = _longrope_llama(7)
    prompt = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(0))
    row = static_decode(model, prompt, steps=3, compiled=False)
    assert row["rope"] == "pinned_long" and row["batch"] == 1 and row["tok_per_s"] > 0
    assert model.model.rotary_emb.rope_type == "longrope"  # restored: the next row decides afresh
    again = static_decode(model, prompt.repeat(2, 1), steps=3, compiled=False)
    assert again["rope"] == "pinned_long"
    short = static_decode(model, prompt[:, :40], steps=3, compiled=False)
    assert "rope" not in short
