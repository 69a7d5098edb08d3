"""The ``torch.compile``-d decode step of the exported model against the plain one (CPU, tiny random export).

The compiled body is what the CUDA graph captures on a GPU (cache option ``compile``); here it runs on
every CPU step with the ``aot_eager`` backend, which traces the same Python (Dynamo: block cache, step
grid, selection, attention) into one graph without Inductor's C++ build. GQA group 3, prompts past the
selection budget (sparse selection active), GPU-resident and offloaded caches.
"""

from __future__ import annotations

import pytest
import torch

from nosa_layers.config import tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ModelConfig


@pytest.fixture(scope="module")
def model_gqa3(tmp_path_factory):
    from checkpoints_convert.random_export import load_random_model, write_random_export

    cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, num_kv_heads=2, head_dim=8,
                      ffn_hidden_size=64, vocab_size=97, rope_theta=10000.0)
    path = write_random_export(tmp_path_factory.mktemp("compile") / "nosa", cfg,
                               AttentionConfig(variant="nosa", nosa=tiny_geometry(), backend="reference"))
    torch.manual_seed(11)
    return load_random_model(path, torch.float64, eviction_scale=0.8)


def _decode(model, compile_opt, offload: bool, steps: int, seed: int):
    """Prefill 3 left-padded prompts (141, 103, 97 tokens: past the 96-token budget), then ``steps`` greedy
    steps; returns the step logits ``[3, steps, V]``, the tokens and the Dynamo graph count after each step."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(seed)
    lens = [141, 103, 97]
    ids = torch.zeros(3, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, -n:] = torch.randint(1, 97, (n,), generator=g)
        mask[b, -n:] = 1
    model.set_cache_options(compile=compile_opt)
    logits, toks, graphs = [], [], []
    base = counters["stats"]["unique_graphs"]
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask, cache=model.new_cache(offload=offload, fetch="copy"), use_cache=True)
            for _ in range(steps):
                cache = getattr(out, "cache", None) or out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(tok, attention_mask=mask, cache=cache, use_cache=True)
                logits.append(out.logits[:, -1])
                toks.append(tok)
                graphs.append(counters["stats"]["unique_graphs"] - base)
    finally:
        opts = model.model.cache_options
        model.set_cache_options()
    return torch.stack(logits, 1), torch.cat(toks, 1), graphs, opts


@pytest.mark.parametrize("offload,steps,seed", [(False, 7, 5), (True, 3, 9)])
def test_compiled_decode_step_equals_plain(model_gqa3, offload, steps, seed):
    """Compiled (``aot_eager``) vs plain decode: the same logits and greedy tokens over steps whose
    windows complete and selections change, with no fallback to the plain body. GPU-resident: the whole
    step is one graph, traced once (no recompile per step: positions are tensors). Offloaded (host-copy
    transfers, which synchronise and so break the graph where they read host values): same results."""
    torch._dynamo.reset()
    ref, ref_tok, _, _ = _decode(model_gqa3, False, offload, steps, seed)
    got, got_tok, graphs, opts = _decode(model_gqa3, "aot_eager", offload, steps, seed)
    assert opts["compile"] == "aot_eager"  # not switched off by a failed compile
    assert graphs[0] >= 1, graphs
    if not offload:
        assert graphs == [1] * steps
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_tok, ref_tok)


def test_compile_option_is_validated_and_auto_stays_plain_on_cpu(model_gqa3):
    """``compile`` takes a bool or a backend name; ``auto`` compiles only CUDA-graphed steps (none on a CPU)."""
    with pytest.raises(ValueError, match="compile"):
        model_gqa3.set_cache_options(compile="")
    torch._dynamo.reset()
    _, _, graphs, _ = _decode(model_gqa3, "auto", False, 2, 1)
    assert graphs == [0, 0]
