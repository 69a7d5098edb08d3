"""Shared builders for the NOSA tests: tiny geometries and random inputs."""

import torch

from nosa_layers import NOSAConfig
from nosa_layers.config import tiny_geometry


def tiny_cfg(**overrides) -> NOSAConfig:
    """The tiny geometry with a 7-block budget (2 query-agnostic blocks), validated."""
    return tiny_geometry(**{"topk": 7, **overrides}).validate()


def random_qkvs(B, T, Hq, Hkv, D, dtype=torch.float64, score_scale=1.0, grad=False, seed=None):
    """Random q ``[B,T,Hq,D]``, k/v ``[B,T,Hkv,D]``, score ``[B,T,Hkv]``."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    s = score_scale * torch.randn(B, T, Hkv, generator=g, dtype=dtype)
    if grad:
        for x in (q, k, v, s):
            x.requires_grad_(True)
    return q, k, v, s
