"""Small helpers shared by ``bench.inference`` and its mixins."""

from __future__ import annotations

import inspect
import time

GIB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cache_kw(model) -> str:
    """The keyword a model's forward takes its KV cache by (ours: ``cache``; transformers: ``past_key_values``)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def out_cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)
