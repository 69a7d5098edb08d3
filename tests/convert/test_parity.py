"""Megatron TP=2 / PP=2 checkpoint -> HF: logits, selections, tensors (every family x variant x layout)."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints_convert.common import (geometry, load_megatron_tensors, load_safetensors_dir, max_abs,
                                        read_model_config, rel_err)
from checkpoints_convert.mapping import hf_to_megatron, megatron_to_hf
from tests.convert._cases import CASES
from tests.convert.conftest import RESULTS, load_hf

NAMES = sorted(CASES)
REL_TOL = 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_export_matches_megatron(name, megatron_ckpts, exports):
    """Logits of ``from_pretrained(export, trust_remote_code=True)`` equal the TP=2 / PP=2 Megatron
    forward (fp32, rel <= 1e-4); for sparse layers the blocks chosen per (layer, KV head, token)
    are identical, and the long cases are really sparse."""
    case = CASES[name]
    ref = megatron_ckpts.result(name)
    cfg = json.loads((exports[name] / "config.json").read_text())
    model = load_hf(exports[name])
    if case.variant == "dense":  # stock transformers class, no remote code
        assert cfg["model_type"] == "llama"
        assert "auto_map" not in cfg and not (exports[name] / "modeling_nosa.py").exists()
        assert type(model).__name__ == "LlamaForCausalLM"
    else:
        assert cfg["model_type"] == "nosa_llama"  # stock transformers refuses it without remote code
        assert cfg["auto_map"] == {"AutoConfig": "configuration_nosa.NOSALlamaConfig",
                                   "AutoModelForCausalLM": "modeling_nosa.NOSALlamaForCausalLM"}
        assert type(model).__name__ == "NOSALlamaForCausalLM"
        model.record(True)
    if case.model.use_mup:
        assert not {"scale_emb", "scale_depth", "dim_model_base"} & set(cfg)
    if case.long:
        rs = cfg["rope_scaling"]
        assert rs["rope_type"] == "longrope" and rs["attention_factor"] == pytest.approx(1.0763)
        assert len(rs["short_factor"]) == case.model.kv_channels // 2
    with torch.no_grad():
        got = model(ref["tokens"]).logits.float()
    want = ref["logits"]
    assert got.shape == want.shape
    rel, mx = rel_err(got, want), max_abs(got, want)
    RESULTS[name] = {"rel": rel, "max_abs": mx, "T": int(want.shape[1])}
    assert rel <= REL_TOL, f"{name}: relative logit error {rel:.3e} (max |d| {mx:.3e})"
    if case.variant == "dense":
        return

    sels = model.selections()
    T = ref["tokens"].shape[1]
    assert set(sels) == {0, 1}
    assert len(ref["selections"]) == 2 * case.model.num_kv_heads
    for (layer, h), want_sel in sorted(ref["selections"].items()):
        got_sel = sels[layer][0][h]  # batch row 0, KV head h: [T, nb]
        assert got_sel.shape == want_sel.shape
        bad = (got_sel != want_sel).any(-1).nonzero().flatten().tolist()
        assert not bad, f"{name} layer {layer} head {h}: {len(bad)} rows differ, first {bad[:5]}"
    if case.long:
        causal = torch.arange(T) // case.attn.nosa.block_size + 1
        chosen = ref["selections"][(1, 0)].sum(-1)
        assert (chosen < causal).any() and int(chosen.max()) <= case.attn.nosa.topk


@pytest.mark.parametrize("name", NAMES)
def test_tensor_roundtrips(name, megatron_ckpts, exports):
    """HF -> Megatron -> HF bitwise; Megatron -> HF -> Megatron bitwise on the real vocabulary rows."""
    ckpt = megatron_ckpts.ckpt(name) / "iter_0000000"
    model, attn, _ = read_model_config(ckpt)
    hf = load_safetensors_dir(exports[name])
    geo = geometry(model, attn)
    back = megatron_to_hf(hf_to_megatron(hf, geo, unfold_mup=False), geometry(model, attn, fold_mup=False))
    assert set(back) == set(hf)
    assert all(torch.equal(hf[k], back[k]) for k in hf)
    mg = load_megatron_tensors(ckpt)
    again = hf_to_megatron(megatron_to_hf(mg, geometry(model, attn, fold_mup=False)), geo)
    for k, v in again.items():
        orig = mg[k]
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(v[model.vocab_size:], torch.zeros_like(v[model.vocab_size:]))
            v, orig = v[:model.vocab_size], orig[:model.vocab_size]
        assert torch.equal(v, orig), k
    model_keys = {k for k in mg}
    assert set(again) == model_keys
