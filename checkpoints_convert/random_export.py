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
    """transformers' ``LlamaForCausalLM`` (SDPA, random weights) with the shape of ``model`` (a
    ``ModelConfig``) and the ``config.json`` a dense export of it would ship (its RoPE, LongRoPE included)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nosa_layers.megatron.config import AttentionConfig

    fields = hf_config(model, AttentionConfig(variant="dense"), dtype)
    fields.pop("torch_dtype", None)
    cfg = LlamaConfig(**fields)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = LlamaForCausalLM(cfg).to(dtype)
    return m.eval()
