"""The ``model`` config group file of an imported checkpoint, so a recipe trains it without a
hand-written model YAML.

``from_hf`` writes ``<out>/model/<name>.yaml`` (every ``ModelConfig`` field of the import; with
``--target-length`` the LongRoPE block of that context extension) and the trainer reads it through
Hydra's search path::

    python train/main.py recipe=import_cpt_16k hydra.searchpath=[file://<out>] model=<name> init_from=<out>
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from nosa_layers.rope.longrope import initial_longrope


def group_name(source_name: str) -> str:
    """A group option name from a model's name: lower case, ``[a-z0-9_]`` (``SmolLM2 135M`` ->
    ``smollm2_135m``)."""
    name = re.sub(r"[^a-z0-9]+", "_", source_name.lower()).strip("_")
    return name or "imported"


def extend_context(model, target_length: int):
    """``model`` (a ``ModelConfig``) with the LongRoPE extension of its context to ``target_length``
    tokens (``nosa_layers.rope.longrope.initial_longrope`` from its rope theta, head dim and context)."""
    if model.rope_type != "default":
        raise ValueError(f"--target-length: the source already uses {model.rope_type} RoPE; extend it with its own "
                         f"factors (edit the model group's longrope block)")
    lr = initial_longrope(model.kv_channels, model.rope_theta, model.max_position_embeddings, target_length)
    return dataclasses.replace(model, rope_type="longrope", longrope=lr, max_position_embeddings=target_length)


class _FlowLists(yaml.SafeDumper):
    """Lists of numbers (the LongRoPE factors) in flow style: one line each."""


_FlowLists.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def model_group_yaml(model, source: str, note: str = "") -> str:
    """The group file's text: a comment naming the source, then every field of ``model``."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "params_dtype"}
    head = f"# Imported by checkpoints_convert.from_hf from {source}.\n"
    if note:
        head += "".join(f"# {line}\n" for line in note.splitlines())
    return head + yaml.dump(fields, Dumper=_FlowLists, sort_keys=False, default_flow_style=False, width=120)


def write_model_group(out: Path, model, source: str, note: str = "") -> Path:
    """``<out>/model/<size>.yaml`` (``model.size`` is the group name); returns its path."""
    path = Path(out) / "model" / f"{model.size}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model_group_yaml(model, source, note))
    return path
