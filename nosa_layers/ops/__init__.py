"""Triton kernels of NOSA attention: block-sparse attention with the eviction-bias gradient, its
index, and the block selection (plus the fused RMSNorm and RoPE of the layers, ``rms_norm.py`` and
``rope.py``). Importing needs ``triton`` (ImportError otherwise) but no GPU; calling needs CUDA tensors, or
``TRITON_INTERPRET=1`` for CPU tests. Each kernel has a plain PyTorch reference in ``nosa_layers``
(``selection.py``, ``reference.py``) it is tested against; ``nosa_layers.dispatch`` chooses between
them. See README.md in this folder."""

import triton  # noqa: F401  (ImportError here means: no Triton backend)

from .attention_op import HEAD_DIMS, attention_plan, sparse_attention, supports_attention
from .block_selection import select_blocks_triton, supports_selection
from .launch import CONFIG, SEL_CONFIG
from .sparse_index import SparseIndex, build_sparse_index

__all__ = ["select_blocks_triton", "supports_selection", "sparse_attention", "supports_attention", "attention_plan",
           "HEAD_DIMS",
           "build_sparse_index", "SparseIndex", "CONFIG", "SEL_CONFIG"]
