"""A NOSA export without weights (``config.json`` + the shipped modeling code), for benchmarks and tests.

``write_random_export(out, model, attn)`` writes what ``to_hf`` writes except the tensors, from the
same ``hf_config``; ``load_random_model(out, dtype, device)`` instantiates the remote-code model with
freshly initialised weights (no download, no checkpoint). ``stock_llama(model, dtype, device)`` is a
transformers ``LlamaForCausalLM`` of the same shape (SDPA attention), the dense baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from checkpoints_convert.hf_modeling import write_modeling_files
from checkpoints_convert.to_hf import hf_config


def write_random_export(out, model, attn) -> Path:
    """``model``: ``nosa_layers.megatron.config.ModelConfig``; ``attn``: ``AttentionConfig``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(model, attn, torch.bfloat16)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_modeling_files(out)
    return out


def load_random_model(path, dtype=torch.float32, device="cpu", eviction_scale: float | None = None):
    """The export's model with random weights (transformers' init). ``eviction_scale`` sets every
    eviction head's ``A`` (zero at init, which makes the query-agnostic scores all equal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True, dtype=dtype)
    if eviction_scale is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("self_attn.A"):
                    p.fill_(eviction_scale)
    return model.eval()


def stock_llama(model, dtype=torch.float32, device="cpu"):
    """transformers' ``LlamaForCausalLM`` (SDPA) with the shape of ``model`` (a ``ModelConfig``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                      intermediate_size=model.ffn_hidden_size, num_hidden_layers=model.num_layers,
                      num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_kv_heads,
                      head_dim=model.kv_channels, max_position_embeddings=model.max_position_embeddings,
                      rope_theta=model.rope_theta, rms_norm_eps=model.norm_eps, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = LlamaForCausalLM(cfg).to(dtype)
    return m.eval()
