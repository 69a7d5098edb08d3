"""Per-layer capture of what the NOSA selection sees: post-RoPE q and k and the eviction score.

A forward pre-hook on every ``NOSACoreAttention`` of a Megatron model records its inputs during
one forward pass; :func:`nosa_layers.select_blocks` / :func:`nosa_layers.measure_locality` on them
reproduce the blocks the layer selected for every token (row t of the parallel selection is the
decode-time selection of step t, proven and tested in ``nosa_layers``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from torch import Tensor

from nosa_layers import NOSAConfig


@dataclass
class LayerCapture:
    """One NOSA / InfLLM-V2 layer of one forward: ``q [1, T, Hq, D]``, ``k [1, T, Hkv, D]`` (post-RoPE),
    ``score [1, T, Hkv]`` fp32 (None for InfLLM-V2), and the layer's geometry ``cfg``."""

    layer: int  # 0-based
    cfg: NOSAConfig
    q: Tensor
    k: Tensor
    score: Optional[Tensor]


@contextmanager
def capture_selection_inputs(model) -> Iterator[dict[int, LayerCapture]]:
    """``with capture_selection_inputs(megatron_model) as got: model(...)`` fills ``got[layer]``
    (0-based layer index) for every sparse layer; dense layers are absent."""
    from nosa_layers.megatron import NOSACoreAttention

    got: dict[int, LayerCapture] = {}
    handles = []

    def hook(module, args, kwargs):
        query, key = args[0], args[1]  # [s, b, h, D], post-RoPE (unpacked input)
        score = kwargs.get("evict_score")  # handed over by the layer's pre-hook, registered before this one
        got[module.layer_number - 1] = LayerCapture(
            layer=module.layer_number - 1, cfg=module.cfg, q=query.detach().transpose(0, 1),
            k=key.detach().transpose(0, 1), score=None if score is None else score.detach().float())

    for m in model.modules():
        if isinstance(m, NOSACoreAttention):
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()
