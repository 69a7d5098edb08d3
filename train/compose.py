"""Hydra composition of ``recipes/`` into a typed :class:`~train.config.RunConfig`.

Uses Hydra's Compose API (no output directories, no cwd change, nothing per rank) over a typed
structured-config schema (``RunConfig`` registered in Hydra's ConfigStore as ``run_defaults``), so
Hydra itself rejects unknown keys and mistyped values while composing; the resolved YAML is then
converted into dataclasses strictly. Errors are one line naming the closest valid key or option.
Sweeps (``-m key=a,b``) are expanded with Hydra's own override grammar and basic sweeper.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from runtime.dataclass_io import from_dict
from train.config import RunConfig

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
GROUPS = ("recipe", "model", "attention", "stage", "parallel")


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
    if msg.startswith("Ambiguous value for argument"):
        return f"{msg}: add -m to sweep over the values, write a list as key=[a,b], or quote a string as key='a,b'"
    m = re.match(r"Error merging override (\S+)", msg)
    if m and e.__cause__ is not None:  # a typed schema refused the value
        return f"bad value {m.group(1)!r}: {str(e.__cause__).splitlines()[0]}"
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
    """The typed schema: ``RunConfig`` (every field, its type and default) as the base node
    ``run_defaults`` of config.yaml, so every key is overridden without ``+``, and misspelled keys
    and values of the wrong type are refused by Hydra while composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_defaults", node=RunConfig)


def group_options(recipes_dir: Path = RECIPES_DIR) -> dict[str, list[str]]:
    """The selectable files of each config group (``recipe``, ``model``, ...), without ``.yaml``."""
    return {g: sorted(p.stem for p in (recipes_dir / g).glob("*.yaml")) for g in GROUPS}


def expand_sweep(overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> tuple[list[list[str]], list[str]]:
    """Hydra multirun expansion: ``(jobs, swept_keys)``; every job is a full override list.

    The grammar is Hydra's (``key=a,b``, ``range(1,4)``, ``choice(a,b)``, ``glob(nosa*)`` over a
    group); jobs are the cartesian product in the order given, as Hydra's basic sweeper makes them.
    """
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    _register_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir), version_base=None):
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            parsed = parser.parse_overrides(list(overrides))
            swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
            jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException as e:
        raise ValueError(str(e).splitlines()[0]) from None
    finally:
        GlobalHydra.instance().clear()
    return jobs, swept


def load_config(overrides: list[str], recipes_dir: Path = RECIPES_DIR) -> RunConfig:
    """Compose and convert; ``recipe`` is taken from the ``recipe=<name>`` override."""
    raw = compose_dict(overrides, recipes_dir)
    raw["recipe"] = recipe_name(overrides)
    return from_dict(RunConfig, raw)


COMMANDS = ("print_config", "dry_run")  # switches of one launch, not settings of the run


class _FlowNumbersDumper(yaml.SafeDumper):
    """YAML with every list of numbers in flow style (``[1.0, 1.02, ...]``), everything else in block style."""


def _represent_list(dumper: yaml.SafeDumper, seq: list):
    numbers = bool(seq) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in seq)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", seq, flow_style=numbers)


_FlowNumbersDumper.add_representer(list, _represent_list)


def to_yaml(cfg: RunConfig, omit: tuple[str, ...] = ()) -> str:
    """The resolved config as YAML (what ``print_config=true`` / ``--cfg job`` show, without ``omit``,
    and the run dir keeps). Lists of numbers (LongRoPE factors, data weights) are written in flow style,
    a few lines instead of one line per number."""

    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    data = {k: plain(v) for k, v in dataclasses.asdict(cfg).items() if k not in omit}
    return yaml.dump(data, Dumper=_FlowNumbersDumper, sort_keys=False, default_flow_style=False, width=120,
                     allow_unicode=True)
