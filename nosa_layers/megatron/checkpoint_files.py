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

from nosa_layers.config import NOSAConfig
from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from nosa_layers.rope.longrope import LongRoPEConfig

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
    """Inverse of :func:`configs_to_dict`; unknown keys raise ``ValueError`` naming them."""
    m = dict(raw["model"])
    if m.get("longrope") is not None:
        m["longrope"] = _build(LongRoPEConfig, m["longrope"], "model.longrope")
    a = dict(raw.get("attention") or {})
    if a.get("nosa") is not None:
        a["nosa"] = _build(NOSAConfig, a["nosa"], "attention.nosa")
    return _build(ModelConfig, m, "model"), _build(AttentionConfig, a, "attention")


def read_configs(ckpt: str | os.PathLike) -> tuple[ModelConfig, AttentionConfig, dict] | None:
    """``(model, attention, extra)`` from ``<ckpt>/nosa_config.json``, or None if the file is absent."""
    path = Path(ckpt) / MODEL_CONFIG
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    model, attn = configs_from_dict(raw)
    return model, attn, {k: v for k, v in raw.items() if k not in ("model", "attention")}


def _build(cls, d: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - names)
    if extra:
        raise ValueError(f"{MODEL_CONFIG}: unknown keys in {where}: {extra}")
    return cls(**d)
