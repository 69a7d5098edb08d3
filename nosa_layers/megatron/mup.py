"""MiniCPM muP residual scaling as a megatron-core bias-dropout-add (``*_bda``) submodule.

MiniCPM: ``h = h + branch(norm(h)) * scale_depth / sqrt(num_layers)`` for attention and MLP.
megatron-core's muP covers the embedding (``mup_embedding_mult``) and logit (``mup_output_mult``)
multipliers but not this one, so the layer spec swaps ``self_attn_bda`` / ``mlp_bda`` for
:class:`ScaledBiasDropoutAdd`.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ScaledBiasDropoutAdd:
    """``bda(training, fused)(x_with_bias, residual, prob) = residual + dropout((x + b) * scale)``."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def __call__(self, training: bool, fused: bool = False):
        scale = self.scale

        def _bda(x_with_bias, residual: Tensor, prob: float) -> Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = x * scale
            if training and prob > 0:
                x = torch.nn.functional.dropout(x, p=prob, training=True)
            return residual + x

        return _bda
