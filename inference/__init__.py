"""The decode engine of exported NOSA models: a block KV cache for transformers' ``generate``, batched decode
steps that recompute the NOSA selection from incrementally kept state, CUDA-graph capture, and offloading of
the KV blocks to pinned host memory. See README.md in this folder.

Layering: this package uses ``nosa_layers`` (config, reference selection, the decode kernels in
``nosa_layers.ops``) and transformers; the exported modeling file (``checkpoints_convert/hf_modeling``) uses
it. Every module here is shipped into sparse exports as a flat copy (``nosa_<module>.py``, imports made
relative), so write absolute imports of this package and of ``nosa_layers`` only, at module level.
"""
