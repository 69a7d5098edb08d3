"""Plain data (dicts, lists, scalars from YAML or JSON) -> typed dataclasses, strictly.

One converter for every typed config of the project: an unknown key is an error naming the
closest field, and scalar types are checked (``int`` for ``float`` fields is widened).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from plain ``data`` (dicts, lists, scalars), checking keys and types."""
    return _convert(cls, data, path)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise ValueError(f"config {path or '<root>'} must not be null")
        return _convert(args[0], value, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"config {path or '<root>'} must be a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        for key in value:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {names}"
                raise ValueError(f"unknown config key {_join(path, key)!r}{hint}")
        kwargs = {k: _convert(hints[k], v, _join(path, k)) for k, v in value.items()}
        return tp(**kwargs)
    if origin in (list, typing.List):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config {path} must be a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            raise ValueError(f"config {path} must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config {path} must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config {path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config {path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config {path} must be a string, got {value!r}")
        return value
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
