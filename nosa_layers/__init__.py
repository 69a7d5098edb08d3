"""NOSA attention: selection, eviction heads, reference attention, decode and locality tools.

Public API (names are a contract for the rest of the framework)::

    NOSAConfig, select_blocks, nosa_attention, nosa_decode_step, measure_locality,
    EVICTION_HEADS, register_eviction_head, build_eviction_head, EvictionHead, EvictionOutput
"""

from nosa_layers.config import NOSAConfig
from nosa_layers.dispatch import PreparedSelection, nosa_attention, prepare_selection, resolve_backend, select_blocks
from nosa_layers.decode import DecodeOutput, nosa_decode_step, select_decode
from nosa_layers.eviction import (
    EVICTION_HEADS,
    EvictionHead,
    EvictionOutput,
    build_eviction_head,
    register_eviction_head,
)
from nosa_layers.locality import LocalityStats, format_locality_table, measure_locality
from nosa_layers.selection import document_spans

__all__ = [
    "NOSAConfig", "select_blocks", "nosa_attention", "prepare_selection", "PreparedSelection", "resolve_backend",
    "nosa_decode_step", "select_decode", "DecodeOutput", "measure_locality", "LocalityStats", "format_locality_table",
    "document_spans", "EVICTION_HEADS", "EvictionHead", "EvictionOutput", "build_eviction_head",
    "register_eviction_head",
]
