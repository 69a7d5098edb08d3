"""Rotary-embedding variants that megatron-core lacks (LongRoPE)."""

from nosa_layers.rope.longrope import LongRoPEConfig, longrope_cos_sin, longrope_inv_freq

__all__ = ["LongRoPEConfig", "longrope_inv_freq", "longrope_cos_sin"]
