"""Shared builders for the NOSA tests: tiny geometries and random inputs."""

import torch

from nosa_layers import NOSAConfig

# block 16, compression 8/4: block m pools windows 4m-1..4m+3 like the released 64/32/16.
TINY = dict(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
            select_blocks=2, topk=7)


def tiny_cfg(**overrides) -> NOSAConfig:
    return NOSAConfig(**{**TINY, **overrides}).validate()


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
