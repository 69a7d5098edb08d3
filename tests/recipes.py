"""Typed model and attention configs read from ``recipes/`` (the one source of the model shapes
and attention presets; composed by Hydra exactly as ``train/main.py`` composes them)."""

from __future__ import annotations

import functools
from dataclasses import replace

from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from runtime.dataclass_io import from_dict
from train.compose import RECIPES_DIR, compose_dict


def recipe_names(group: str) -> list[str]:
    """The files of one recipe group (``model``, ``attention``, ``recipe``, ...), without ``.yaml``."""
    return sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _group(group: str, name: str) -> dict:
    return compose_dict([f"{group}={name}"])[group]


def model_recipe(name: str, **overrides) -> ModelConfig:
    """``recipes/model/<name>.yaml`` as a ModelConfig; ``overrides`` replace fields."""
    return replace(from_dict(ModelConfig, _group("model", name)), **overrides)


def attention_recipe(name: str, **overrides) -> AttentionConfig:
    """``recipes/attention/<name>.yaml`` as an AttentionConfig; ``overrides`` replace fields."""
    return replace(from_dict(AttentionConfig, _group("attention", name)), **overrides)
