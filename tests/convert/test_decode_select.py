"""The decode step's selection (``select_decode_fast``) against its plain batched reference
(``select_decode_batched``, itself tested against ``select_rows`` in ``test_block_cache.py``): random
compressed keys, window scores and positions (odd lengths, rows with no complete window, rows shorter than
the forced blocks), GQA groups 3 and 9, fp32 / bf16 compressed keys, with and without the query-agnostic
stage, a finite garbage sink column."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.decode_select import decode_masks, select_decode_batched, select_decode_fast
from nosa_layers.config import tiny_geometry
from nosa_layers.selection import block_window_index


@pytest.mark.parametrize("G,dtype,with_score,init_blocks,seed", [
    (3, torch.float32, True, 1, 0), (9, torch.float32, True, 3, 1), (3, torch.bfloat16, True, 2, 2),
    (9, torch.bfloat16, False, 1, 3), (1, torch.float64, True, 3, 4), (3, torch.float32, False, 3, 5)])
def test_fast_selection_equals_batched_reference(G, dtype, with_score, init_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(tiny_geometry(), init_blocks=init_blocks)
    B, Hkv, D, cap = 7, 2, 16, 333
    NW, NB = cfg.num_windows(cap), -(-cap // cfg.block_size)
    pos = torch.randint(0, cap, (B,), generator=g)
    pos[0], pos[1], pos[2] = 5, 17, cap - 1  # no full window; fewer blocks than forced (init_blocks 3); full
    kc = torch.randn(B, Hkv, NW + 1, D, generator=g).to(dtype)
    wsc = torch.randn(B, Hkv, NW + 1, generator=g, dtype=torch.float64).to(torch.promote_types(dtype, torch.float32))
    q = torch.randn(B, Hkv, G, D, generator=g).to(dtype)
    if dtype != torch.float64:
        q = q.float()
    index = block_window_index(cfg, NB, NW)
    scale = D ** -0.5
    want = select_decode_batched(q, kc[:, :, :NW], wsc[:, :, :NW] if with_score else None, pos, cfg, index, scale,
                                 decode_masks(pos, cfg, NB, NW))
    got = select_decode_fast(q, kc, wsc if with_score else None, cfg, index, scale, decode_masks(pos, cfg, NB, NW + 1))
    assert torch.equal(got[1], want[1])
    # the valid entries are the same blocks in the same order (padding entries: any future block)
    assert torch.equal(torch.where(got[1], got[0], -1), torch.where(want[1], want[0], -1))
