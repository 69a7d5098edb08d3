"""Inputs of the attention benchmark: the shapes' constants, random q / k / v / bias, the "P1" block lists
(sink + window + random past blocks per 128-token query block), inputs whose NOSA selection is smooth, and the
kernels' sparse index of a selection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa_layers import NOSAConfig
from nosa_layers.ops import build_sparse_index


D, HKV = 128, 2  # head dim, KV heads of every shape (T tokens, HQ query heads)
DT = torch.bfloat16
DEV = "cuda"


def index_for(sel, cfg, T, HQ, qt=None, cu=None):
    """The kernels' sparse index of the selection ``sel`` (row budget ``cfg.topk``)."""
    return build_sparse_index(sel, cfg, T, cu, num_q_heads=HQ, row_budget=cfg.topk, qt=qt)


def p1_lists(T: int, seed: int, qb: int = 128, topk: int = 32, win: int = 8):
    """Per 128-query-block lists; returns (flex BlockMask pieces, 64-block selection, useful keys)."""
    g = torch.Generator().manual_seed(seed)
    nqb = T // qb
    full_idx = torch.zeros(nqb, nqb, dtype=torch.int32)
    full_num = torch.zeros(nqb, dtype=torch.int32)
    part_idx = torch.zeros(nqb, nqb, dtype=torch.int32)
    part_num = torch.ones(nqb, dtype=torch.int32)
    sel128 = torch.zeros(nqb, nqb, dtype=torch.bool)
    for i in range(nqb):
        fb = set(range(max(0, i + 1 - win), i))
        if i > 0:
            fb.add(0)
        cand = [j for j in range(1, i) if j not in fb]
        need = topk - 1 - len(fb)
        if need > 0 and cand:
            fb.update(cand[p] for p in torch.randperm(len(cand), generator=g)[:need].tolist())
        fb = sorted(fb)
        full_num[i] = len(fb)
        full_idx[i, :len(fb)] = torch.tensor(fb, dtype=torch.int32)
        part_idx[i, 0] = i
        sel128[i, fb] = True
        sel128[i, i] = True
    # 64-token view: query half-block r of 128-block i takes the 64-blocks of sel128[i], causal
    sel64 = sel128.repeat_interleave(2, 0).repeat_interleave(2, 1)  # [nqb64, nb64]
    nqb64 = 2 * nqb
    sel64 &= torch.arange(nqb64)[None, :] <= torch.arange(nqb64)[:, None]
    keys = 0
    for i in range(nqb64):
        nfull = int(sel64[i, :i].sum())
        keys += 64 * 64 * nfull + 64 * 65 // 2
    sel = sel64.repeat_interleave(64, 0)[None, None].expand(1, HKV, T, nqb64).contiguous()
    return (part_num, part_idx, full_num, full_idx), sel.to(DEV), keys


def useful_keys(sel: torch.Tensor, bs: int) -> int:
    """sum over (KV head, row) of visible keys of the selected blocks, divided by Hkv (per head avg)."""
    B, H, T, nb = sel.shape
    t = torch.arange(T, device=sel.device)
    blk = torch.arange(nb, device=sel.device)
    nkeys = ((t[:, None] + 1 - blk[None, :] * bs).clamp(0, bs))  # [T, nb] visible keys of block
    return int((sel.float() * nkeys.float()).sum().item()) // H


def make_inputs(T, HQ, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device=DEV, dtype=DT, generator=g)
    k = torch.randn(1, T, HKV, D, device=DEV, dtype=DT, generator=g)
    v = torch.randn(1, T, HKV, D, device=DEV, dtype=DT, generator=g)
    bias = 0.1 * torch.randn(1, T, HKV, device=DEV, dtype=torch.float32, generator=g)
    return q, k, v, bias


def synthetic_nosa_inputs(T, HQ, seed, smooth):
    """q/k for a NOSA selection: iid (smooth=0) or with a slowly varying shared component."""
    q, k, v, bias = make_inputs(T, HQ, seed)
    if smooth:
        g = torch.Generator(device=DEV).manual_seed(seed + 1)
        walk = torch.randn(1, T // 256 + 2, 1, D, device=DEV, generator=g)
        walk = F.interpolate(walk.permute(0, 2, 3, 1).reshape(1, D, -1), size=T, mode="linear").reshape(1, D, T)
        walk = walk.permute(0, 2, 1)[:, :, None, :]
        q = (q.float() * 0.5 + 2.0 * walk).to(DT)
        k = (k.float() * 0.5 + 2.0 * walk).to(DT)
    return q, k, v, bias


def p1_case(T, HQ):
    """P1 lists and inputs at one shape: ``(sel, keys, cfg, index, (q, k, v, bias) gradient leaves, dO)``."""
    _, sel, keys = p1_lists(T, seed=1)
    cfg = NOSAConfig()
    q, k, v, bias = make_inputs(T, HQ)
    leaves = tuple(x.clone().requires_grad_(True) for x in (q, k, v, bias))
    return sel, keys, cfg, index_for(sel, cfg, T, HQ), leaves, torch.randn_like(q)
