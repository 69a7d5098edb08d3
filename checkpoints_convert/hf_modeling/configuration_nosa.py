"""Config class of NOSA / InfLLM-V2 exports (shipped next to ``modeling_nosa.py``; ``auto_map``
``AutoConfig``).

Exports of sparse models use their own ``model_type`` (``nosa_llama``), so that stock transformers
refuses them without ``trust_remote_code=True`` (with its own message naming the flag) instead of
silently building a dense ``LlamaForCausalLM`` that ignores the eviction heads. Dense exports stay
stock Llama (``model_type: llama``, no remote code).

The class also reads the layout of the released ``openbmb/NOSA-*`` checkpoints (the ``thunlp/NOSA``
remote code: ``model_type: llama``, ``SparseLlamaForCausalLM``, no ``nosa_config`` block, geometry
fixed in its modeling file): :func:`nosa_settings` gives such a config the reference geometry.
Needs only ``transformers`` (no framework import), so the same file works inside an export.
"""

from __future__ import annotations

from transformers import LlamaConfig

MODEL_TYPE = "nosa_llama"

# The released NOSA checkpoints: class, remote-code module and the geometry their modeling file
# hard-codes (64-token blocks, 32/16-token compression windows, 1 sink block, a 1024-token = 16-block
# sliding window, 16 query-aware blocks, 64 blocks in total, ED-DMA eviction head in every layer).
REFERENCE_ARCHITECTURE = "SparseLlamaForCausalLM"
REFERENCE_MODULE = "modeling_llama_nosa"
REFERENCE_AUTO_MAP = {"AutoModelForCausalLM": f"{REFERENCE_MODULE}.{REFERENCE_ARCHITECTURE}"}
REFERENCE_GEOMETRY = {"block_size": 64, "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1,
                      "local_blocks": 16, "select_blocks": 16, "topk": 64}
REFERENCE_HEAD = {"eviction_head": "ed_dma", "eviction_bias": False, "detach_value": False}


class NOSALlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the ``nosa_config`` block (per-layer variants, eviction head, block
    geometry; see the exporter's README). A config without the block is accepted when it is a
    reference-format one (:func:`is_reference_config`)."""

    model_type = MODEL_TYPE
    nosa_config: dict | None = None

    def __init__(self, *args, **kwargs):
        # LongRoPE exports keep rope_theta inside rope_scaling (no top-level key, so that transformers' generic
        # config can read config.json); LlamaConfig of transformers 4.x reads only the top-level key
        rs = kwargs.get("rope_scaling")
        if isinstance(rs, dict) and "rope_theta" in rs:
            kwargs["rope_scaling"] = {k: v for k, v in rs.items() if k != "rope_theta"}
            kwargs.setdefault("rope_theta", rs["rope_theta"])
        super().__init__(*args, **kwargs)


def is_reference_config(config) -> bool:
    """No ``nosa_config`` block, and ``architectures`` or ``auto_map`` name the reference class."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if isinstance(get("nosa_config"), dict):
        return False
    archs = get("architectures") or []
    targets = (get("auto_map") or {}).values()
    return REFERENCE_ARCHITECTURE in archs or any(str(t).endswith("." + REFERENCE_ARCHITECTURE) for t in targets)


def reference_settings(num_layers: int, **geometry) -> dict:
    """The ``nosa_config`` block equivalent to a reference-format checkpoint (NOSA + ED-DMA in every
    layer, the reference geometry; ``geometry`` overrides fields of it)."""
    unknown = sorted(set(geometry) - set(REFERENCE_GEOMETRY))
    if unknown:
        raise ValueError(f"unknown geometry field(s) {unknown}; known: {sorted(REFERENCE_GEOMETRY)}")
    return {"layer_variants": ["nosa"] * num_layers, **REFERENCE_GEOMETRY, **geometry, **REFERENCE_HEAD,
            "backend": "auto"}


def nosa_settings(config) -> dict:
    """The ``nosa_config`` block of a config: its own, or the reference one for a reference-format config."""
    raw = getattr(config, "nosa_config", None)
    if isinstance(raw, dict):
        return raw
    if is_reference_config(config):
        return reference_settings(int(config.num_hidden_layers))
    raise ValueError("config.json has no 'nosa_config' block and is not a reference-format NOSA config "
                     f"(architectures {REFERENCE_ARCHITECTURE}): this modeling file runs NOSA / InfLLM-V2 "
                     "exports of checkpoints_convert.to_hf and the released NOSA checkpoints")


__all__ = ["NOSALlamaConfig", "nosa_settings", "is_reference_config", "reference_settings"]
