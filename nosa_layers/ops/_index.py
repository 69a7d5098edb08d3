"""Host-side (torch, on the tensors' device) construction of the block-sparse index.

Geometry: every document of every batch row is cut into query tiles of ``block_size`` tokens,
aligned to the document start; tile ``i`` of a document is also KV block ``i`` of that document,
so one global tile id names both a query tile and a KV block.

Forward CSR (per tile and KV head, ``w = tile * Hkv + h``): ``row_ptr[w]..row_ptr[w+1]`` indexes
``fwd_ks`` (first token of the KV block in its batch row, ascending, the diagonal block last) and
``fwd_word`` (int64 token bitmask: bit ``r`` set <=> query row ``r`` of the tile selected it).

Inverse lists (per KV block and KV head, ``c * Hkv + h``): ``inv_qs`` (first token of the query tile,
ascending) and ``inv_word`` (the same bitmask), cut into the dK/dV work items (``dkdv_items``: list
pieces with their entry ranges). Built with one stable sort: the order, hence every reduction in
the backward, is deterministic. The lists carry token offsets, not tile ids, so a kernel's loop
needs one index load per entry before its tile loads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ._kernels import pack_words


@dataclass
class SparseIndex:
    block: int
    n_tiles: int
    hkv: int
    tiles: Tensor      # int32 [n_tiles, 8]: b, q_start, q_end, doc_start, doc_end, j (block in doc), 0, 0
    row_ptr: Tensor    # int32 [n_tiles*Hkv + 1]
    fwd_ks: Tensor     # int32 [nnz]
    fwd_word: Tensor   # int64 [nnz]
    fwd_order: Tensor  # int32 [n_tiles*Hkv]: longest list first
    inv_qs: Tensor     # int32 [nnz]
    inv_word: Tensor   # int64 [nnz]
    dkdv_items: Tensor  # int32 [n_items, 4]: w, first entry, end entry, partial slot (-1: writes dK/dV itself)
    dkdv_order: Tensor  # int32 [n_items]: longest piece first
    n_slots: int        # fp32 partial (dK, dV, db) buffers the pieces of split lists write
    reduce_items: Tensor  # int32 [n_split, 3]: w, first slot, number of slots (ascending slots)

    @property
    def nnz(self) -> int:
        return int(self.fwd_ks.numel())


def make_tiles(B: int, T: int, spans: list[tuple[int, int]], block: int, device) -> Tensor:
    """Query tiles ``[n_tiles, 8]`` (cached per geometry and device: training calls repeat it)."""
    return _tiles_cached(B, T, tuple(map(tuple, spans)), block, str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _tiles_cached(B: int, T: int, spans: tuple, block: int, device: str) -> Tensor:
    rows = []
    for b in range(B):
        for s, e in spans:
            n = (e - s + block - 1) // block
            for i in range(n):
                rows.append((b, s + i * block, min(s + (i + 1) * block, e), s, e, i, 0, 0))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 8).to(device)


def split_lists(counts: Tensor, chunk: int):
    """dK/dV work items of the inverse lists (``counts`` entries each, stored back to back): every
    list cut into pieces of at most ``chunk`` entries (``chunk <= 0``: one piece per list; an empty
    list still gets one piece, which writes zeros).

    A KV block's sink-like list (used by every query tile) would otherwise be one program as long
    as the whole kernel. Pieces of a split list write fp32 partials to consecutive slots, summed
    in slot order by the reduction kernel (deterministic). Returns ``(items, order, n_slots,
    reduce_items)`` as documented on ``SparseIndex``."""
    dev = counts.device
    n_w = counts.numel()
    nch = torch.ones_like(counts) if chunk <= 0 else torch.div(counts + chunk - 1, chunk, rounding_mode="floor").clamp(min=1)
    is_multi = nch > 1
    # the only host sync: the sizes of the outputs
    n_items, n_slots, n_multi = torch.stack([nch.sum(), torch.where(is_multi, nch, 0).sum(), is_multi.sum()]).tolist()
    item_w = torch.repeat_interleave(torch.arange(n_w, device=dev), nch, output_size=n_items)
    first = nch.cumsum(0) - nch
    piece = torch.arange(n_items, device=dev) - first[item_w]
    hi = counts.cumsum(0)[item_w]
    lo = hi - counts[item_w]
    start = lo if chunk <= 0 else lo + piece * chunk
    end = hi if chunk <= 0 else torch.minimum(start + chunk, hi)
    split = is_multi[item_w]
    slot = torch.where(split, split.long().cumsum(0) - 1, torch.full_like(item_w, -1))
    items = torch.stack([item_w, start, end, slot], 1).to(torch.int32).contiguous()
    order = torch.sort(end - start, descending=True, stable=True).indices.to(torch.int32)
    multi = torch.sort((~is_multi).to(torch.uint8), stable=True).indices[:n_multi]  # ascending w with nch > 1
    slot0 = nch[multi].cumsum(0) - nch[multi]
    reduce_items = torch.stack([multi, slot0, nch[multi]], 1).to(torch.int32).contiguous()
    return items, order, n_slots, reduce_items


def build_index(selected: Tensor, spans: list[tuple[int, int]], block: int, dkdv_chunk: int = 0) -> SparseIndex:
    """``selected`` bool ``[B, Hkv, T, nb]`` (block indices relative to each document);
    ``dkdv_chunk``: longest inverse-list piece of one dK/dV program (0: no split)."""
    B, Hkv, T, nb = selected.shape
    dev = selected.device
    tiles = make_tiles(B, T, spans, block, dev)
    n_tiles = tiles.shape[0]
    words = pack_words(selected, tiles, block)  # [n_tiles, Hkv, nb] int64
    nz = words != 0
    counts = nz.sum(-1).reshape(-1)  # [n_tiles*Hkv]
    row_ptr = torch.zeros(n_tiles * Hkv + 1, dtype=torch.int64, device=dev)
    row_ptr[1:] = counts.cumsum(0)
    flat = nz.reshape(-1).nonzero().squeeze(1)  # ascending: (tile, h, blk) row-major
    blk = flat % nb
    fwd_word = words.reshape(-1)[flat]
    w_of = torch.div(flat, nb, rounding_mode="floor")  # tile*Hkv + h
    tile_of = torch.div(w_of, Hkv, rounding_mode="floor")
    h_of = w_of % Hkv
    key_tile = tile_of - tiles[tile_of, 5].long() + blk  # global tile id of the KV block
    inv_key = key_tile * Hkv + h_of
    inv_key_sorted, perm = torch.sort(inv_key, stable=True)
    inv_counts = torch.zeros(n_tiles * Hkv, dtype=torch.int64, device=dev).index_add_(  # no host sync
        0, inv_key_sorted, torch.ones_like(inv_key_sorted))
    tile_start = tiles[:, 1]
    fwd_ks = tile_start[key_tile]
    inv_qs = tile_start[tile_of[perm]]
    inv_word = fwd_word[perm]
    fwd_order = torch.sort(counts, descending=True, stable=True).indices.to(torch.int32)
    items, order, n_slots, reduce_items = split_lists(inv_counts, dkdv_chunk)
    return SparseIndex(block, n_tiles, Hkv, tiles, row_ptr.to(torch.int32), fwd_ks, fwd_word.contiguous(),
                       fwd_order, inv_qs, inv_word.contiguous(), items, order, n_slots, reduce_items)


def union_inflation(index: SparseIndex, selected: Tensor) -> dict:
    """|U| / mean per-token list length, and token density inside listed blocks."""
    nnz = index.nnz
    per_token = selected.sum(-1).float()  # [B, Hkv, T]
    tile_len = (index.tiles[:, 2] - index.tiles[:, 1]).float()
    union_sizes = index.row_ptr.diff().float().reshape(index.n_tiles, index.hkv)  # listed blocks per (tile, head)
    union_per_tile = float((union_sizes * tile_len[:, None]).sum() / (tile_len.sum() * index.hkv))
    # tokens selected per listed (tile, block) pair
    bits = torch.zeros_like(index.fwd_word)
    w = index.fwd_word
    for i in range(index.block):
        bits += (w >> i) & 1
    return {
        "mean_blocks_per_token": float(per_token.mean()),
        "mean_union_blocks_per_tile": union_per_tile,
        "inflation": union_per_tile / float(per_token.mean()),
        "bitmask_fill": float(bits.float().sum() / (nnz * index.block)),
        "nnz": nnz,
    }
