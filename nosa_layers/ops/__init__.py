"""Triton kernels of NOSA attention: block-sparse attention with the eviction-bias gradient, and
the block selection. Importing needs ``triton`` (ImportError otherwise) but no GPU; calling needs
CUDA tensors, or ``TRITON_INTERPRET=1`` for CPU tests. See README.md in this folder."""

import triton  # noqa: F401  (ImportError here means: no Triton backend)

from .attention import (CONFIG, build_sparse_index, nosa_attention_triton,  # noqa: F401
                        sparse_attention_from_selection)
from .selection import select_blocks_triton  # noqa: F401

__all__ = ["nosa_attention_triton", "select_blocks_triton", "sparse_attention_from_selection",
           "build_sparse_index", "CONFIG"]
