"""The released NOSA checkpoints (``openbmb/NOSA-*``, the ``thunlp/NOSA`` remote code) on both sides of
the converters.

That layout is an HF Llama with two tensors more per layer (``self_attn.A [Hkv]``,
``self_attn.delta.weight [Hkv, Hkv*D]``), ``architectures: [SparseLlamaForCausalLM]``, an ``auto_map``
to ``modeling_llama_nosa.SparseLlamaForCausalLM`` and ``model_type: llama``; it has no
``nosa_config`` block because its modeling file hard-codes the geometry (64-token blocks, 32/16
compression windows, 1 sink block, a 16-block window, 16 query-aware blocks, top-k 64, ED-DMA).

* Import: :func:`checkpoint_format` tells our exports, reference checkpoints and dense Llamas apart
  (one-line errors for eviction tensors in a checkpoint of another architecture);
  :func:`parse_geometry` reads the ``--geometry`` override.
* Export: :func:`to_reference_config` rewrites an export's ``config.json`` into the reference's,
  refusing a model whose geometry differs from the hard-coded one (the reference would silently
  run another model).
* LongRoPE: the reference builds its rotary table once with ``seq_len=None``, so it uses
  ``short_factor`` at every length; transformers' ``longrope`` (and this framework) switch to
  ``long_factor`` past ``original_max_position_embeddings``. :func:`longrope_factors` makes the
  choice explicit when the two lists differ (``short`` = the reference's behaviour, ``switch`` =
  transformers').
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

from checkpoints_convert.hf_modeling.configuration_nosa import (
    MODEL_TYPE,
    REFERENCE_ARCHITECTURE,
    REFERENCE_AUTO_MAP,
    REFERENCE_GEOMETRY,
    REFERENCE_HEAD,
    is_reference_config,
)
from checkpoints_convert.mapping import ConversionError

FORMATS = ("nosa", "reference")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept from an import's source to its export
LONGROPE_CHOICES = ("short", "switch")
DENSE_ARCHITECTURES = ("LlamaForCausalLM",)
# per-layer attention tensors other than the q/k/v/o projections: eviction-head parameters
_EVICTION_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.(?!(q|k|v|o)_proj\.)")


def eviction_tensors(names: Iterable[str]) -> List[str]:
    """Names of per-layer eviction-head tensors (``self_attn.A``, ``self_attn.delta.weight`` ...), sorted."""
    return sorted((n for n in names if _EVICTION_TENSOR.match(n)), key=_natural)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def checkpoint_format(cfg: dict, names: Optional[Iterable[str]] = None) -> str:
    """``nosa`` (an export of this framework: ``nosa_config`` block), ``reference`` (a released NOSA
    checkpoint) or ``llama`` (dense). With the weight ``names``, eviction tensors in a checkpoint
    that is neither of the NOSA formats are one error naming the first of them."""
    if isinstance(cfg.get("nosa_config"), dict):
        return "nosa"
    if is_reference_config(cfg):
        return "reference"
    if cfg.get("model_type") == MODEL_TYPE:
        raise ConversionError(f"model_type={MODEL_TYPE!r} but config.json has no nosa_config block")
    ev = eviction_tensors(names or ())
    if ev:
        archs = cfg.get("architectures")
        raise ConversionError(
            f"{ev[0]} ({len(ev)} eviction-head tensor(s)) in a checkpoint whose config.json has no nosa_config "
            f"and architectures={archs}: a released NOSA checkpoint names {REFERENCE_ARCHITECTURE} (architectures "
            f"or auto_map); fix config.json, or drop the tensors to import a dense Llama")
    return "llama"


def parse_geometry(text: Optional[str]) -> dict:
    """``"block_size=16,kernel_size=8,..."`` -> ``{field: int}`` (fields of the reference geometry)."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in REFERENCE_GEOMETRY or not value.strip().lstrip("-").isdigit():
            raise ConversionError(f"--geometry {text!r}: expected comma-separated FIELD=INT with FIELD one of "
                                  f"{', '.join(REFERENCE_GEOMETRY)}")
        out[key] = int(value)
    return out


def longrope_factors(short: List[float], long: List[float], choice: Optional[str],
                     reference: bool, where: str) -> Tuple[List[float], List[float]]:
    """The (short, long) factor lists to use. Equal lists need no choice. When they differ:
    ``short`` -> short at every length (``long := short``; the reference code's behaviour),
    ``switch`` -> both kept (transformers: long past ``original_max_position_embeddings``);
    no choice is the transformers behaviour, except for the reference format (``reference``),
    where it is refused in one line."""
    if choice is not None and choice not in LONGROPE_CHOICES:
        raise ConversionError(f"--longrope {choice!r}; use short or switch")
    if list(short) == list(long):
        return list(short), list(long)
    if choice is None and reference:
        raise ConversionError(
            f"{where}: rope_scaling short_factor and long_factor differ; the reference NOSA code uses "
            f"short_factor at every length, transformers switches to long_factor past "
            f"original_max_position_embeddings: pass --longrope short (the reference's behaviour) or "
            f"--longrope switch (transformers')")
    if choice == "short":
        return list(short), list(short)
    return list(short), list(long)


def reference_mismatches(variants: List[str], nosa: dict) -> List[str]:
    """What keeps a model from the reference layout (empty = exportable as it is)."""
    bad = sorted({v for v in variants if v != "nosa"})
    out = [f"layer variants {bad} (the reference runs NOSA in every layer)"] if bad else []
    for key, want in {**REFERENCE_GEOMETRY, "eviction_head": REFERENCE_HEAD["eviction_head"],
                      "eviction_bias": REFERENCE_HEAD["eviction_bias"]}.items():
        if nosa.get(key) != want:
            out.append(f"{key}={nosa.get(key)!r} (reference: {want!r})")
    return out


def to_reference_config(cfg: dict, longrope: Optional[str] = None) -> dict:
    """An export's ``config.json`` (nosa format, with ``nosa_config``) -> the reference's: its
    architectures / auto_map / ``model_type: llama``, no ``nosa_config``, LongRoPE fields that
    transformers 4.4x-5.x read (top-level ``original_max_position_embeddings`` too, explicit
    ``attention_factor``). Refuses, in one line, a geometry the reference does not hard-code."""
    nosa = cfg.get("nosa_config")
    if not isinstance(nosa, dict):
        raise ConversionError("--format reference needs a NOSA model; dense models export as stock Llama")
    bad = reference_mismatches(list(nosa["layer_variants"]), nosa)
    if bad:
        raise ConversionError("--format reference: the reference code hard-codes its geometry and ignores any "
                              "config field, so this export would silently be a different model: "
                              + "; ".join(bad) + "; export with --format nosa")
    out = {k: v for k, v in cfg.items() if k not in ("nosa_config", "auto_map")}
    out.update(model_type="llama", architectures=[REFERENCE_ARCHITECTURE], auto_map=dict(REFERENCE_AUTO_MAP))
    rs = out.get("rope_scaling")
    if rs and "rope_theta" in rs:  # the reference is read by stock LlamaConfig: rope_theta at the top level
        rs = {k: v for k, v in rs.items() if k != "rope_theta"}
        out["rope_theta"] = cfg["rope_scaling"]["rope_theta"]
        out["rope_scaling"] = rs
    if rs and rs.get("rope_type") == "longrope":
        short, long = longrope_factors(rs["short_factor"], rs["long_factor"], longrope, True, "--format reference")
        out["rope_scaling"] = {**rs, "short_factor": short, "long_factor": long}
        out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    out["nosa_export"] = {**cfg.get("nosa_export", {}), "format": "reference"}
    return out
