"""Hydra composition of ``recipes/`` into a typed :class:`~train.config.RunConfig`.

Uses Hydra's Compose API (no output directories, no cwd change, nothing per rank) and converts the
resolved YAML into dataclasses strictly: an unknown key is an error that names the closest field.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from runtime.dataclass_io import from_dict
from train.config import RunConfig

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def recipe_name(overrides: list[str]) -> str:
    for o in overrides:
        if o.startswith("recipe="):
            return o.split("=", 1)[1]
    return "default"


def compose_dict(overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> dict:
    """Compose ``recipes/config.yaml`` with Hydra overrides and return the resolved dict."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_explain(e, recipes_dir)) from None


def _explain(e: Exception, recipes_dir: Path) -> str:
    """One line for a Hydra/OmegaConf composition error, with the closest valid name."""
    import re

    msg = str(e).splitlines()[0]
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        node: Any = dataclasses.asdict(RunConfig())
        for part in parent.split(".") if parent else []:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        close = difflib.get_close_matches(leaf, list(node) if isinstance(node, dict) else [], n=1)
        hint = f"; did you mean '{parent + '.' if parent else ''}{close[0]}'?" if close else ""
        return f"unknown config key '{key}'{hint}"
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", str(e))
    if m:
        group, name = m.groups()
        options = sorted(p.stem for p in (recipes_dir / group).glob("*.yaml"))
        return f"unknown {group} '{name}'; available: {options}"
    return msg


def _register_defaults() -> None:
    """Every RunConfig field with its default, as the base node ``run_defaults`` of config.yaml.

    A plain (untyped) node, so every key can be overridden without ``+`` and misspelled keys are
    rejected by Hydra; types are checked when converting to dataclasses.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_defaults", node=dataclasses.asdict(RunConfig()))


def load_config(overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> RunConfig:
    """Compose and convert; ``recipe`` is taken from the ``recipe=<name>`` override."""
    raw = compose_dict(overrides, recipes_dir)
    raw["recipe"] = recipe_name(overrides)
    return from_dict(RunConfig, raw)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what ``print_config=true`` shows and the run dir keeps)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
