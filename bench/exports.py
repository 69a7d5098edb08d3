"""Trained models in the inference benchmark: Hugging Face exports with their weights, prompts of real
text, and the measures that need trained selections (cache hit rate, bytes per token).

* :func:`load_export` loads our NOSA export (its shipped modeling code) or a stock Llama directory;
* :func:`text_tokens` gives ``n`` tokens of held-out documents (``eval.documents``: the validation part
  of the training split), so the decode continues real text as the locality simulation reads it;
* :func:`hit_rate`: the share of the blocks a decode step selects that were already on the device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def export_kind(path: str | Path) -> str:
    """``nosa`` for this framework's NOSA / InfLLM-V2 exports, ``llama`` for a dense (stock) Llama dir."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return "nosa" if "auto_map" in cfg and cfg.get("model_type") != "llama" else "llama"


def load_export(path: str | Path, dtype: torch.dtype, device: torch.device):
    """The export's model with its weights, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=export_kind(path) == "nosa",
                                                 dtype=dtype)
    return model.to(device).eval()


def export_shape(path: str | Path):
    """The export's ``ModelConfig`` (layers, heads, vocabulary: what the benchmark's rows report)."""
    from checkpoints_convert.from_hf import configs_from_hf

    model, _ = configs_from_hf(json.loads((Path(path) / "config.json").read_text()))
    return model


def text_tokens(data: str, tokenizer: str, n: int, split: str | None, vocab_size: int) -> torch.Tensor:
    """``n`` tokens of the first held-out document that long (shorter ones joined), int64 ``[n]``."""
    from data.tokenizer import Tokenizer
    from eval.documents import load_documents

    tok = Tokenizer(tokenizer)
    docs = load_documents(data, tok, n, 1, vocab_size, split, join=True, log=lambda *_: None)
    return docs[0]


def hit_rate(fetched_per_step: float, batch: int, offloaded_layers: int, kv_heads: int, topk: int) -> float:
    """``1 - fetched / selected`` blocks per decode step: a step selects ``topk`` blocks per (sequence,
    offloaded layer, KV head) once the context exceeds the budget; those not in a device slot are fetched."""
    selected = batch * offloaded_layers * kv_heads * topk
    return 1.0 - fetched_per_step / selected if selected else float("nan")
