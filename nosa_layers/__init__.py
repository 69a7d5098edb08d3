"""NOSA attention: selection, eviction heads, reference attention, decode and locality tools.

Public API (names are a contract for the rest of the framework)::

    NOSAConfig, select_blocks, nosa_attention, nosa_decode_step, measure_locality,
    EVICTION_HEADS, register_eviction_head, build_eviction_head, EvictionHead, EvictionOutput

The names are imported on first use (PEP 562), so importing a torch-free submodule (``nosa_layers.config``)
does not import torch: a command's ``--help`` stays fast.
"""

from importlib import import_module

_HOME = {
    "config": ["NOSAConfig"],
    "dispatch": ["PreparedSelection", "nosa_attention", "prepare_selection", "resolve_backend", "select_blocks"],
    "decode": ["DecodeOutput", "nosa_decode_step", "select_decode"],
    "eviction": ["EVICTION_HEADS", "EvictionHead", "EvictionOutput", "build_eviction_head", "register_eviction_head"],
    "locality": ["LocalityStats", "format_locality_table", "measure_locality"],
    "selection": ["document_spans"],
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = [
    "NOSAConfig", "select_blocks", "nosa_attention", "prepare_selection", "PreparedSelection", "resolve_backend",
    "nosa_decode_step", "select_decode", "DecodeOutput", "measure_locality", "LocalityStats", "format_locality_table",
    "document_spans", "EVICTION_HEADS", "EvictionHead", "EvictionOutput", "build_eviction_head",
    "register_eviction_head",
]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        import importlib.util

        if importlib.util.find_spec(f"nosa_layers.{name}") is not None:  # a submodule (``nosa_layers.ops``), as
            return import_module(f"nosa_layers.{name}")  # ``from nosa_layers import ops`` gives it
        raise AttributeError(f"module 'nosa_layers' has no attribute {name!r}")
    value = getattr(import_module(f"nosa_layers.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
