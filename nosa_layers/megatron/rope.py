"""LongRoPE for megatron-core's ``GPTModel`` (megatron-core ships plain/llama3/YaRN/mRoPE only).

:class:`LongRoPERotaryEmbedding` replaces ``GPTModel.rotary_pos_emb``: it switches between short
and long factors on the rotary length of the forward pass (the longest document for packed
sequences: HF's ``max(position_ids) + 1``). The attention factor multiplies cos and sin; megatron
applies it through the attention's RoPE ``mscale`` (see ``NOSAMegatronSelfAttention``), which computes
``cos(freqs) * mscale`` exactly like HF's ``cos * attention_scaling``.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch import Tensor

from nosa_layers.rope.longrope import LongRoPEConfig, longrope_inv_freq


class LongRoPERotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose inverse frequencies are ``1/(factor_i * theta^(2i/d))``."""

    def __init__(self, kv_channels: int, longrope: LongRoPEConfig, rotary_base: float,
                 rotary_interleaved: bool = False, use_cpu_initialization: bool = False,
                 cp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__(kv_channels=kv_channels, rotary_percent=1.0, rotary_interleaved=rotary_interleaved,
                         rotary_base=rotary_base, use_cpu_initialization=use_cpu_initialization,
                         cp_group=cp_group)
        self.longrope = longrope
        self.rotary_dim = kv_channels
        self.theta = float(rotary_base)
        device = self.inv_freq.device
        self.short_inv_freq = longrope_inv_freq(longrope, kv_channels, self.theta, None, device=device)
        self.long_inv_freq = longrope_inv_freq(
            longrope, kv_channels, self.theta, longrope.original_max_position_embeddings + 1, device=device)
        self.inv_freq = self.short_inv_freq

    def _inv_freq(self, long: bool) -> Tensor:
        device = self.inv_freq.device
        if self.short_inv_freq.device != device:
            # megatron moves a CPU-initialised ``inv_freq`` to the GPU at the first forward; the factors
            # follow once (a copy from pageable host memory per forward would wait for the GPU's queue)
            self.short_inv_freq, self.long_inv_freq = self.short_inv_freq.to(device), self.long_inv_freq.to(device)
        return self.long_inv_freq if long else self.short_inv_freq

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> Tensor:
        long = max_seq_len + offset > self.longrope.original_max_position_embeddings
        inv_freq = self._inv_freq(long)
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        return torch.outer(seq, inv_freq)
