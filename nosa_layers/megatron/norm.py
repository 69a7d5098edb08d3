"""RMSNorm for the local (non-TE) spec that also works with sequence parallelism.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel``; this module marks its weight
with ``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient over TP.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)`` computed in fp32 (HF Llama/MiniCPM formula).

    Built by megatron as ``RMSNorm(config=..., hidden_size=..., eps=...)``; ``x [..., hidden]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"nosa RMSNorm built with normalization={config.normalization!r}; use RMSNorm")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
