"""Files of a NOSA distributed checkpoint that every tool agrees on (trainer, converters).

    <run dir>/checkpoints/latest          text: name of the last COMPLETE iter_* dir
    <run dir>/checkpoints/iter_XXXXXXX/   megatron-core dist_checkpointing (torch_dist), model under "model"
        nosa_config.json                  {"model": ModelConfig, "attention": AttentionConfig, ...} as dicts

Kept here (below both ``train/`` and ``checkpoints_convert/``) so neither restates the layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from runtime.dataclass_io import from_dict
from nosa_layers.megatron.config import AttentionConfig, ModelConfig

LATEST = "latest"
MODEL_CONFIG = "nosa_config.json"


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint a run dir, its ``checkpoints/`` dir or an ``iter_*`` dir points at.

    Returns None where there is none; raises ``FileNotFoundError`` for a dangling ``latest``.
    """
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        pointer = candidate / LATEST
        if pointer.is_file():
            ckpt = candidate / pointer.read_text().strip()
            if (ckpt / "metadata.json").is_file():
                return ckpt
            raise FileNotFoundError(f"{pointer} names {ckpt.name}, which is not a complete checkpoint")
    if (p / "metadata.json").is_file():
        return p
    return None


def configs_to_dict(model: ModelConfig, attn: AttentionConfig) -> dict:
    return {"model": dataclasses.asdict(model), "attention": dataclasses.asdict(attn)}


def configs_from_dict(raw: dict) -> tuple[ModelConfig, AttentionConfig]:
    """Inverse of :func:`configs_to_dict`; unknown keys or wrong types raise ``ValueError``."""
    return (from_dict(ModelConfig, raw["model"], "model"),
            from_dict(AttentionConfig, raw.get("attention") or {}, "attention"))


def read_configs(ckpt: str | os.PathLike) -> tuple[ModelConfig, AttentionConfig, dict] | None:
    """``(model, attention, extra)`` from ``<ckpt>/nosa_config.json``, or None if the file is absent."""
    path = Path(ckpt) / MODEL_CONFIG
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    model, attn = configs_from_dict(raw)
    return model, attn, {k: v for k, v in raw.items() if k not in ("model", "attention")}

