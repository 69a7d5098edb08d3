"""Context parallelism in the trainer: each rank of a CP group keeps its chunks of every micro-batch.

The loader hands every CP rank of a data-parallel rank the same samples; :func:`split_microbatch` keeps
this rank's zigzag chunks of tokens, labels, loss mask and positions (megatron-core's
``get_batch_on_this_cp_rank``: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``; a packed THD row is one row),
while ``cu_seqlens`` and ``max_seqlen`` keep describing the whole row (the layers gather keys and values,
``nosa_layers.megatron.context_parallel``). Loss sums and token counts are then reduced over DP x CP.
"""

from __future__ import annotations

import torch

from nosa_layers.query_chunks import zigzag_chunks, zigzag_split

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def split_microbatch(mb: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a model-input micro-batch (``[b, s]`` tensors -> ``[b, s / cp]``); with
    ``cp_size`` 1 the micro-batch itself."""
    if cp_size == 1:
        return mb
    out = dict(mb)
    for key in SEQUENCE_KEYS:
        out[key] = zigzag_split(mb[key], cp_size, cp_rank, dim=1)
    out["cp"] = (cp_size, cp_rank)
    return out


def locality_positions(mb: dict) -> torch.Tensor:
    """Positions ``[b, s_local]`` for the locality statistics: the first token of each of this rank's
    chunks counts as a document start (its predecessor token lives on another rank)."""
    pos = mb["position_ids"]
    if "cp" not in mb:
        return pos
    size, rank = mb["cp"]
    pos = pos.clone()
    row = 0
    for a, b in zigzag_chunks(pos.shape[1] * size, size, rank).spans:
        pos[:, row] = 0
        row += b - a
    return pos
