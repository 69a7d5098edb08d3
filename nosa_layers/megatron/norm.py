"""RMSNorm for the local (non-TE) spec that also works with sequence parallelism.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel``; this module marks its weight
with ``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient over TP. With
``fused=True`` inputs the kernels run on (``nosa_layers.ops._common.kernels_run_on``: CUDA, or the
interpreter in tests) take the one-kernel Triton norm (``nosa_layers.ops.rms_norm``) instead of the
reference's elementwise passes; the trainer builds fused layers for GPU runs only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``y = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in fp32 (HF Llama/MiniCPM formula)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim of ``x [..., hidden]`` (:func:`rms_norm_reference`).

    Built by megatron as ``RMSNorm(config=..., hidden_size=..., eps=...)``; ``fused`` comes from the
    layer spec (``train.fusions``).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, fused: bool = False, **unused) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"nosa RMSNorm built with normalization={config.normalization!r}; use RMSNorm")
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            from nosa_layers.ops._common import kernels_run_on
            from nosa_layers.ops.rms_norm import fused_rms_norm

            if kernels_run_on(x):
                return fused_rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)
