"""Name tables and transforms (no megatron, no files): fused QKV / gated MLP, muP folding, and the
one-message errors for missing, extra and misshapen tensors; exports are never partial."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoints_convert.mapping import (
    ConversionError,
    Geometry,
    hf_shapes,
    hf_to_megatron,
    megatron_to_hf,
    merge_gated,
    merge_qkv,
    split_gated,
    split_qkv,
)


def geo(**kw) -> Geometry:
    base = dict(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4, ffn_hidden_size=24,
                vocab_size=30, padded_vocab_size=32, layer_variants=["nosa", "nosa"], eviction_head="ed_dma")
    base.update(kw)
    return Geometry(**base)


def random_hf(g: Geometry) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=gen) for n, s in hf_shapes(g, optional=False).items()}


def test_qkv_layout_is_gqa_interleaved():
    Hq, Hkv, D, H = 4, 2, 3, 5
    q, k, v = torch.randn(Hq * D, H), torch.randn(Hkv * D, H), torch.randn(Hkv * D, H)
    w = merge_qkv(q, k, v, Hq, Hkv, D)
    g = w.view(Hkv, Hq // Hkv + 2, D, H)  # per KV group: G query heads, then k, then v
    assert torch.equal(g[1, 0], q.view(Hq, D, H)[2]) and torch.equal(g[1, 2], k.view(Hkv, D, H)[1])
    assert torch.equal(g[0, 3], v.view(Hkv, D, H)[0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(w, Hq, Hkv, D), (q, k, v)))
    # KV heads replicated over TP > Hkv (4 groups of one query head): replicas are dropped
    rep = torch.cat([torch.cat([q.view(Hq, D, H)[i], k.view(Hkv, D, H)[i // 2], v.view(Hkv, D, H)[i // 2]])
                     for i in range(Hq)])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(rep, Hq, Hkv, D), (q, k, v)))
    gate, up = torch.randn(6, H), torch.randn(6, H)
    assert all(torch.equal(a, b) for a, b in zip(split_gated(merge_gated(gate, up)), (gate, up)))


def test_roundtrip_and_mup_folding():
    g = geo()
    hf = random_hf(g)
    mg = hf_to_megatron(hf, g)
    assert mg["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, (4 + 4) * 4, 16)
    assert mg["embedding.word_embeddings.weight"].shape == (32, 16)
    back = megatron_to_hf(mg, g)
    assert set(back) == set(hf) and all(torch.equal(hf[k], back[k]) for k in hf)
    fold = geo(mup={"emb": 12.0, "residual": 0.25, "logits": 0.0625})
    out = megatron_to_hf(mg, fold)
    assert torch.equal(out["model.embed_tokens.weight"], hf["model.embed_tokens.weight"] * 12)
    assert torch.equal(out["model.layers.1.mlp.down_proj.weight"], hf["model.layers.1.mlp.down_proj.weight"] * 0.25)
    assert torch.equal(out["lm_head.weight"], hf["lm_head.weight"] * 0.0625)
    assert torch.equal(out["model.layers.0.self_attn.A"], hf["model.layers.0.self_attn.A"])  # unaffected


def test_errors_list_every_name():
    g = geo()
    mg = hf_to_megatron(random_hf(g), g)
    del mg["decoder.layers.mlp.linear_fc2.weight"]
    mg["decoder.layers.self_attention.surprise"] = torch.zeros(2, 3)
    mg["decoder.final_layernorm.weight"] = torch.zeros(7)
    with pytest.raises(ConversionError) as e:
        megatron_to_hf(mg, g)
    msg = str(e.value)
    assert "decoder.layers.mlp.linear_fc2.weight" in msg and "decoder.layers.self_attention.surprise" in msg
    assert "model.norm.weight" in msg and "\n" not in msg
    hf = random_hf(g)
    hf.pop("model.layers.1.self_attn.delta.weight")
    hf["model.layers.0.self_attn.extra"] = torch.zeros(1)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ConversionError) as e:
        hf_to_megatron(hf, g)
    msg = str(e.value)
    for n in ("model.layers.1.self_attn.delta.weight", "model.layers.0.self_attn.extra",
              "model.layers.0.mlp.up_proj.weight"):
        assert n in msg


def test_bad_checkpoint_leaves_no_output(megatron_ckpts, tmp_path):
    from checkpoints_convert.to_hf import export
    from runtime.checkpoint_manifest import hash_files, list_files, write_manifest

    src = shutil.copytree(megatron_ckpts.ckpt("llama3-dense-tp2"), tmp_path / "ckpt")
    cfg_path = src / "iter_0000000" / "nosa_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["num_layers"] = 4  # the tensors stack 2 layers
    cfg_path.write_text(json.dumps(cfg))
    write_manifest(cfg_path.parent, hash_files(cfg_path.parent, list_files(cfg_path.parent)))  # an intact file
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="num_layers=4"):
        export(str(src), str(out), log=lambda *_: None)
    cfg["model"]["num_layers"] = 2
    cfg["attention"]["variant"] = "sparse_magic"
    cfg_path.write_text(json.dumps(cfg))
    write_manifest(cfg_path.parent, hash_files(cfg_path.parent, list_files(cfg_path.parent)))
    with pytest.raises(ValueError, match="sparse_magic"):
        export(str(src), str(out), log=lambda *_: None)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
