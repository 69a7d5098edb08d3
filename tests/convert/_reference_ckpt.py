"""Tiny checkpoints in the layout of the released NOSA models (the ``thunlp/NOSA`` remote code), built
here with random weights: ``config.json`` with the reference's keys (``model_type: llama``,
``architectures: [SparseLlamaForCausalLM]``, ``auto_map`` to ``modeling_llama_nosa``, LongRoPE
``rope_scaling``, no ``nosa_config``) and one safetensors file with its tensor names
(``self_attn.{q,k,v,o}_proj``, ``self_attn.A [Hkv]``, ``self_attn.delta.weight [Hkv, Hkv*D]`` ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 64, 4, 2, 16, 128, 256
ORIGINAL_MAX_POS, MAX_POS = 2048, 8192


def reference_config(short=None, long=None) -> dict:
    half = HEAD_DIM // 2
    short = short or [1.0 + 0.05 * i for i in range(half)]
    return {
        "architectures": ["SparseLlamaForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_llama_nosa.SparseLlamaForCausalLM"},
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long or list(short),
                         "original_max_position_embeddings": ORIGINAL_MAX_POS, "attention_factor": 1.0763},
    }


def reference_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN, std=1.0), "lm_head.weight": rnd(VOCAB, HIDDEN),
          "model.norm.weight": 1 + rnd(HIDDEN, std=0.2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": 1 + rnd(HIDDEN, std=0.2),
            p + "post_attention_layernorm.weight": 1 + rnd(HIDDEN, std=0.2),
            p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN, std=0.3),
            p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN, std=0.3),
            p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN, std=0.3),
            p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.A": 0.5 + torch.rand(KV_HEADS, generator=g),
            p + "self_attn.delta.weight": rnd(KV_HEADS, KV_HEADS * HEAD_DIM, std=0.3),
            p + "mlp.gate_proj.weight": rnd(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rnd(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rnd(HIDDEN, FFN),
        })
    return sd


def write_reference_checkpoint(out: Path, cfg: dict | None = None, weights: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg or reference_config(), indent=2))
    save_file({k: v.contiguous() for k, v in (weights if weights is not None else reference_weights()).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
