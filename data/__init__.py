"""NOSA data pipeline: indexed pretraining data, packed document-aware batches, SFT chat masks.

Light import: configs load eagerly; loaders (torch) and megatron-core load on first use.
See data/README.md for formats, batch keys and the resume contract.
"""

from data.config import DataConfig, SFTConfig, validate

_LAZY = {
    "build_pretrain_loaders": "data.loader", "build_sft_loader": "data.loader", "build_sft_loaders": "data.loader",
    "PretrainLoader": "data.loader", "SFTLoader": "data.loader",
    "Tokenizer": "data.tokenizer", "build_demo": "data.demo_corpus",
    "row_cu_seqlens": "data.packing", "flat_cu_seqlens": "data.packing",
}

__all__ = ["DataConfig", "SFTConfig", "validate", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
