"""Rotary-embedding variants that megatron-core lacks (LongRoPE) and packed-document positions."""

from nosa_layers.rope.longrope import LongRoPEConfig, longrope_cos_sin, longrope_inv_freq
from nosa_layers.rope.packed import document_positions

__all__ = ["LongRoPEConfig", "longrope_inv_freq", "longrope_cos_sin", "document_positions"]
