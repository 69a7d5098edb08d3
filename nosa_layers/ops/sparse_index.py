"""The block-sparse index of a selection, built on the GPU in four launches with no host sync.

Geometry. KV blocks are the batch's block table (``layout.py``: documents cut into ``block``-token
blocks aligned to their start). Query tiles are ``qt`` consecutive tokens of one block (``qt``
divides ``block``; tile ``i`` is part ``i % S`` of block ``i // S``, ``S = block // qt``; tiles past
a document's end are empty). A kernel program takes one query tile with the query heads of one KV
group (M = qt x heads rows), which all share one selection: the tile's *union* of the rows'
selected blocks is what it iterates over, so small tiles keep that union close to one token's
selection (less "union inflation" than 64-token tiles of one head).

Forward lists, per (tile, KV head) ``w = tile * Hkv + h``: ``fwd_count[w]`` entries at
``fwd_ks[w, :]`` (first token of each listed KV block, ascending, the tile's own block last) and
``fwd_word[w, :]`` (bit ``r`` set <=> row ``r`` of the tile selected the block), padded to ``cap``
entries (no compaction across lists, hence no host sync for sizes). One KV block per entry: two-block
forward entries were measured slower on an H200 in every case (2026-12).

Inverse lists, per key group and KV head. A key group is ``kb`` (1 or 2) adjacent KV blocks of one
document, from a block whose index in its document is a multiple of ``kb`` (the last group of a
document may hold fewer real blocks): one dK/dV program keeps all its keys resident, so every query
tile it loads feeds ``kb * block`` keys. List ``l = block * Hkv + h`` of a group's first block:
``inv_ptr[l] .. inv_ptr[l+1]`` index ``inv_qs`` (first token of each query tile that selected any
block of the group, ascending) and ``inv_word`` (``[entries, kb]``: the tile's word of each block of
the group, 0 where it did not select it); the lists of the other blocks of a group are empty and get
no dK/dV program. dK/dV work: each list is cut into pieces of at most ``chunk`` entries (``piece_ptr``,
``piece_list``: the list of each piece); the pieces of a split list write fp32 partials to
consecutive slots from ``slot_ptr[l]`` (``-1``: one program does the whole list), at most
``max_slots`` slots in all (lists past that budget stay whole); ``slot_ptr[n_lists]`` is the number
of slots the split lists use, tagged for the host ring (``_SlotCountRing.tagged``). Everything is
ordered, so every reduction in the backward is deterministic.

The backward allocates the slots the index uses, not the budget: right after the index build the
count is copied, without blocking, to an entry of a pinned host ring (``_SlotCountRing``); the
backward, which runs long after, reads it (``SparseIndex.workspace_slots``; it waits for the copy
in the rare case it has not landed yet).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from nosa_layers.config import NOSAConfig

from ._common import UNSPECIALIZED, check_device
from .launch import launch_config
from .layout import BlockLayout, block_layout
from .query_layout import _query_rows, no_rows, query_layout, query_tiles


@dataclass
class SparseIndex:
    block: int            # tokens per KV block
    qt: int               # tokens per query tile
    hkv: int
    layout: BlockLayout
    n_tiles: int          # layout.n_blocks * (block // qt)
    cap: int              # forward list capacity per (tile, head)
    fwd_count: Tensor     # int32 [n_tiles * Hkv]
    fwd_ks: Tensor        # int32 [n_tiles * Hkv, cap]
    fwd_word: Tensor      # int32 (qt <= 32) / int64 [n_tiles * Hkv, cap]
    inv_ptr: Tensor       # int32 [n_lists + 1], n_lists = n_blocks * Hkv
    inv_qs: Tensor        # int32 [n_tiles * Hkv * cap] (capacity; inv_ptr[-1] used)
    inv_word: Tensor      # like fwd_word, [n_tiles * Hkv * cap, kb]
    chunk: int            # entries per dK/dV piece
    piece_ptr: Tensor     # int32 [n_lists + 1]
    piece_list: Tensor    # int32 [max_pieces]
    slot_ptr: Tensor      # int32 [n_lists + 1]: first slot of each list (-1: whole), then the slots used
    max_pieces: int       # grid bound of the dK/dV kernel
    max_slots: int        # budget of fp32 partial slots (key-group partials) for split lists
    kb: int = 1           # KV blocks per key group (keys resident in one dK/dV program: kb * block)
    slots_count: object = None  # where slot_ptr[n_lists] reaches the host: (_SlotCountRing, entry) or an int
    # query chunks (``query_layout``; None: the whole row): the tiles holding query rows (int32 [n_tiles], their
    # index among the table's tiles) and the query row of each token of a row (int32 [T], -1: none)
    qtiles: Tensor | None = None
    qrows: Tensor | None = None
    num_rows: int | None = None  # query rows (Tq; None: the whole row)

    @property
    def n_lists(self) -> int:
        return self.layout.n_blocks * self.hkv

    @property
    def subset(self) -> bool:
        """Whether the queries are a subset of the row (query chunks)."""
        return self.qrows is not None

    def query_args(self, device) -> tuple[Tensor, Tensor]:
        """``(QTiles, QRow)`` kernel arguments (one-entry stand-ins for the whole row)."""
        if self.qrows is None:
            stand_in = no_rows(str(device))
            return stand_in, stand_in
        return self.qtiles, self.qrows

    def workspace_slots(self) -> int:
        """Partial slots the dK/dV backward needs: the count the index build produced, once its copy to
        the host has landed (waiting for it in the rare case it has not, e.g. a backward that follows
        its forward at once); the upper bound only where no count can come (a CUDA graph capture)."""
        count = self.slots_count
        if isinstance(count, tuple):
            count = count[0].read(count[1])
        return count if count is not None else min(self.max_slots, self.max_pieces)

    def workspace_shape(self) -> tuple[int, int]:
        """``(slots, keys)`` of the dK/dV backward's fp32 partials: ``WDK / WDV [slots, keys, D]`` and
        ``WDB [slots, keys]`` (at least one slot, so the kernels always get a buffer)."""
        return max(self.workspace_slots(), 1), self.kb * self.block


@triton.jit(do_not_specialize=UNSPECIALIZED["_pack_lists_kernel"])
def _pack_lists_kernel(Sel, Blocks, Words, Count, FwdKs, FwdWord, QTiles, QRow, s_sb, s_sh, s_st, cap, NBW,
                       HKV: tl.constexpr, QT: tl.constexpr, S: tl.constexpr,
                       BS: tl.constexpr, NBC: tl.constexpr, SUBSET: tl.constexpr):
    """Per (query tile, KV head): the tile rows' selections ORed into one word per block (dense
    ``Words`` row, columns up to the tile's own block) and the forward list of non-zero entries.
    ``SUBSET``: program ``i`` takes the ``i``-th tile holding query rows (``QTiles``), whose selection
    rows are the tokens' query rows (``QRow``, ``query_layout``)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    gi = i
    if SUBSET:
        gi = tl.load(QTiles + i)
    c = gi // S
    b = tl.load(Blocks + c * 4 + 0).to(tl.int64)
    ks = tl.load(Blocks + c * 4 + 1)
    ds = tl.load(Blocks + c * 4 + 2)
    de = tl.load(Blocks + c * 4 + 3)
    j = (ks - ds) // BS
    qs = ks + (gi % S) * QT
    r = tl.arange(0, QT)
    rmask, trow = _query_rows(QRow, qs + r, (qs + r) < de, SUBSET)
    w = (i * HKV + h).to(tl.int64)
    n = 0
    for m0 in range(0, j + 1, NBC):
        cols = m0 + tl.arange(0, NBC)
        cm = cols <= j
        s = tl.load(Sel + b * s_sb + h * s_sh + trow[:, None].to(tl.int64) * s_st + cols[None, :],
                    mask=rmask[:, None] & cm[None, :], other=0)
        bits = (s != 0).to(Words.dtype.element_ty) << r[:, None].to(Words.dtype.element_ty)
        word = tl.sum(bits, axis=0)  # disjoint bits: sum == OR (wraps correctly at the top bit)
        tl.store(Words + w * NBW + cols, word, mask=cm)
        nz = (word != 0) & cm
        pos = n + tl.cumsum(nz.to(tl.int32), axis=0) - 1
        ok = nz & (pos < cap)
        tl.store(FwdKs + w * cap + pos, ds + cols * BS, mask=ok)
        tl.store(FwdWord + w * cap + pos, word, mask=ok)
        n += tl.sum(nz.to(tl.int32), axis=0)
    tl.store(Count + w, n)


@triton.jit
def _inverse_scan(Blocks, QRange, c, S: tl.constexpr, BS: tl.constexpr, KB: tl.constexpr, SUBSET: tl.constexpr):
    """Column of KV block ``c`` in the dense words: the tiles ``[i0, i1)`` of its document from its
    own block on (``SUBSET``: of the tiles holding query rows, ``QRange``), the column ``j`` (the block's
    index in its document) and whether the block starts a key group of ``KB`` blocks."""
    ks = tl.load(Blocks + c * 4 + 1)
    ds = tl.load(Blocks + c * 4 + 2)
    de = tl.load(Blocks + c * 4 + 3)
    j = (ks - ds) // BS
    nb_doc = (de - ds + BS - 1) // BS
    i0 = c * S
    i1 = (c - j + nb_doc) * S
    if SUBSET:
        i0 = tl.load(QRange + 2 * c)
        i1 = tl.load(QRange + 2 * c + 1)
    return i0, i1, j, (j % KB) == 0


@triton.jit
def _tile_ids(QTiles, i, im, SUBSET: tl.constexpr):
    """The tiles' index in the block table's tiles: ``QTiles[i]`` with ``SUBSET``, else ``i``."""
    if SUBSET:
        return tl.load(QTiles + i, mask=im, other=0)
    return i


@triton.jit
def _group_word(Words, i, gi, im, c, h, j, NBW, HKV: tl.constexpr, S: tl.constexpr, u: tl.constexpr):
    """Words of tiles ``i`` (table tiles ``gi``) for block ``j + u`` of a key group starting at block ``c``
    (column ``j``): 0 for tiles before that block (causal; their dense word rows stop at their own block)."""
    return tl.load(Words + (i * HKV + h).to(tl.int64) * NBW + j + u, mask=im & (gi >= (c + u) * S), other=0)


@triton.jit
def _group_selected(Words, i, gi, im, c, h, j, NBW, HKV: tl.constexpr, S: tl.constexpr, KB: tl.constexpr):
    """Whether tiles ``i`` selected any block of the key group starting at block ``c``."""
    nz = _group_word(Words, i, gi, im, c, h, j, NBW, HKV, S, 0) != 0
    for u in tl.static_range(1, KB):
        nz |= _group_word(Words, i, gi, im, c, h, j, NBW, HKV, S, u) != 0
    return nz


@triton.jit(do_not_specialize=UNSPECIALIZED["_inv_count_kernel"])
def _inv_count_kernel(Words, Blocks, InvCount, QTiles, QRange, NBW, HKV: tl.constexpr, S: tl.constexpr,
                      BS: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr, SUBSET: tl.constexpr):
    """Entries of the inverse list of each (key group, KV head); -1 for blocks inside a group."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    i0, i1, j, lead = _inverse_scan(Blocks, QRange, c, S, BS, KB, SUBSET)
    cnt = 0
    if lead:
        for t0 in range(i0, i1, CB):
            i = t0 + tl.arange(0, CB)
            im = i < i1
            gi = _tile_ids(QTiles, i, im, SUBSET)
            cnt += tl.sum(_group_selected(Words, i, gi, im, c, h, j, NBW, HKV, S, KB).to(tl.int32), axis=0)
    else:
        cnt = -1
    tl.store(InvCount + c * HKV + h, cnt)


@triton.jit(do_not_specialize=UNSPECIALIZED["_scan_kernel"])
def _scan_kernel(InvCount, InvPtr, PiecePtr, SlotPtr, n_lists, chunk, max_slots, tag_base, CH: tl.constexpr):
    """One program: CSR offsets of the inverse lists, their dK/dV pieces, and the partial slots of
    the split lists (lists are split in order while the slot budget lasts) with their total, stored
    as ``tag_base + total`` (``_SlotCountRing.tagged``: the build's host-ring entry). A count
    of -1 marks a block inside a key group: an empty list without a piece."""
    carry_e = 0
    carry_p = 0
    carry_s = 0
    for l0 in range(0, n_lists, CH):
        idx = l0 + tl.arange(0, CH)
        ok = idx < n_lists
        raw = tl.load(InvCount + idx, mask=ok, other=0)
        cnt = tl.maximum(raw, 0)
        tl.store(InvPtr + idx, carry_e + tl.cumsum(cnt, axis=0) - cnt, mask=ok)
        pieces = tl.where(ok & (raw >= 0), tl.maximum((cnt + chunk - 1) // chunk, 1), 0)
        need = tl.where(pieces > 1, pieces, 0)
        s_end = carry_s + tl.cumsum(need, axis=0)
        split = (need > 0) & (s_end <= max_slots)
        tl.store(SlotPtr + idx, tl.where(split, s_end - need, -1), mask=ok)
        pieces = tl.where(split, pieces, tl.minimum(pieces, 1))
        tl.store(PiecePtr + idx, carry_p + tl.cumsum(pieces, axis=0) - pieces, mask=ok)
        carry_e += tl.sum(cnt, axis=0)
        carry_p += tl.sum(pieces, axis=0)
        carry_s += tl.sum(tl.where(split, need, 0), axis=0)
    tl.store(InvPtr + n_lists, carry_e)
    tl.store(PiecePtr + n_lists, carry_p)
    tl.store(SlotPtr + n_lists, tag_base + carry_s)


@triton.jit(do_not_specialize=UNSPECIALIZED["_inv_fill_kernel"])
def _inv_fill_kernel(Words, Blocks, InvPtr, PiecePtr, PieceList, InvQs, InvWord, QTiles, QRange, NBW,
                     HKV: tl.constexpr, S: tl.constexpr, QT: tl.constexpr,
                     BS: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr, SUBSET: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    lst = c * HKV + h
    i0, i1, j, lead = _inverse_scan(Blocks, QRange, c, S, BS, KB, SUBSET)
    base = tl.load(InvPtr + lst)
    n = 0
    tl.static_assert(KB <= 2, "key groups of one or two KV blocks")
    if lead:
        for t0 in range(i0, i1, CB):
            i = t0 + tl.arange(0, CB)
            im = i < i1
            gi = _tile_ids(QTiles, i, im, SUBSET)
            w0 = _group_word(Words, i, gi, im, c, h, j, NBW, HKV, S, 0)  # each word loaded once
            nz = w0 != 0
            if KB == 2:
                w1 = _group_word(Words, i, gi, im, c, h, j, NBW, HKV, S, 1)
                nz |= w1 != 0
            pos = base + n + tl.cumsum(nz.to(tl.int32), axis=0) - 1
            qs = tl.load(Blocks + (gi // S) * 4 + 1, mask=nz, other=0) + (gi % S) * QT
            tl.store(InvQs + pos, qs, mask=nz)
            tl.store(InvWord + pos.to(tl.int64) * KB, w0, mask=nz)
            if KB == 2:
                tl.store(InvWord + pos.to(tl.int64) * KB + 1, w1, mask=nz)
            n += tl.sum(nz.to(tl.int32), axis=0)
    p0 = tl.load(PiecePtr + lst)
    p1 = tl.load(PiecePtr + lst + 1)
    for q0 in range(p0, p1, CB):
        p = q0 + tl.arange(0, CB)
        tl.store(PieceList + p, lst, mask=p < p1)


def largest_divisor(G: int, n: int) -> int:
    """The largest divisor of ``G`` that is at most ``max(1, n)``."""
    d = max(1, min(G, n))
    while G % d:
        d -= 1
    return d


def query_tile(G: int, block: int, rows: int = 64) -> tuple[int, int]:
    """``(qt, heads)`` of a query tile: all ``G`` query heads of a KV group (at most ``rows``) and
    ``qt = rows // heads`` tokens (a power of two dividing ``block``; at least 1, M >= 16)."""
    heads = largest_divisor(G, rows)
    qt = 1 << (max(1, min(block, rows // heads)).bit_length() - 1)
    while qt * heads < 16 and qt < block:
        qt *= 2
    return qt, heads


CHUNK_WAVES = 4  # dK/dV pieces per SM that an "auto" chunk aims at


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def chunk_units(work_units: int, device: torch.device) -> int:
    """dK/dV piece length in units (64 query rows x one KV block) for an attention of about
    ``work_units`` units: ``CHUNK_WAVES`` pieces per SM, a power of two in 256..1024 (shorter pieces
    balance better and cost more fp32 partials; 1B shapes: 512 at 16K/16, 1024 at 32K/32)."""
    target = max(work_units, 1) / (_sm_count(device) * CHUNK_WAVES)
    return int(min(1024, max(256, 2 ** round(math.log2(target)))))


def build_sparse_index(selected: Tensor, cfg: NOSAConfig, seq_len: int, cu_seqlens: Tensor | None = None, *,
                       num_q_heads: int, row_budget: int | None = None, qt: int | None = None,
                       chunk: int | None = None, max_slots: int | None = None, kb: int | None = None,
                       q: Tensor | None = None, q_chunks=None) -> SparseIndex:
    """The kernels' index of ``selected`` bool ``[B, Hkv, T, nb]`` (a ``select_blocks`` result for
    ``seq_len = T`` tokens, documents at ``cu_seqlens``) for an attention with ``num_q_heads`` query
    heads.

    The query tile follows ``query_tile`` (``qt`` overrides it); ``row_budget``: most blocks any one
    row selects (``cfg.topk`` for NOSA selections), which bounds the forward lists at
    ``qt * row_budget`` entries instead of ``nb``; ``chunk`` (dK/dV piece length in list entries;
    default: the launch configuration's ``CHUNK`` units of 64 query rows x one KV block), ``max_slots``
    and ``kb`` (KV blocks per dK/dV key group, 1 or 2) override the launch configuration. ``q`` (the
    attention's queries, optional) lets the key groups follow the dK/dV kernel that will run: the
    Hopper kernel's, or the Triton kernel's for a shape the Hopper one does not cover. ``q_chunks``: the
    selection's rows are those query rows of the ``seq_len``-token row (``select_blocks(q_chunks=...)``);
    lists and programs then cover only the tiles that hold them (``query_layout``)."""
    check_device(selected)
    B, Hkv, rows, nbw = selected.shape
    T = seq_len
    want = T if q_chunks is None else q_chunks.num_rows
    if rows != want:
        raise ValueError(f"selected has {rows} rows for {want} query rows of a sequence of {seq_len} tokens")
    bs = cfg.block_size
    layout = block_layout(B, T, cu_seqlens, bs, selected.device)
    launch = launch_config(selected.device, q, bs)
    if q_chunks is not None and "triton" in launch["dkdv"]:  # query chunks take the Triton kernels (attention_op)
        launch = dict(launch, dkdv=dict(launch["dkdv"], **launch["dkdv"]["triton"]))
    G = num_q_heads // Hkv
    if qt is None:
        qt = query_tile(G, bs, launch["tile"]["rows"])[0]
    if bs % qt or qt & (qt - 1):
        raise ValueError(f"query tile of {qt} tokens must be a power of two dividing block_size {bs}")
    S = bs // qt
    ql = query_layout(layout, q_chunks)
    if ql is not None:
        qtiles, qrange, n_tiles = query_tiles(ql, layout, qt)
    else:
        qtiles = qrange = no_rows(str(selected.device))
        n_tiles = layout.n_blocks * S
    n_lists = layout.n_blocks * Hkv
    kb = launch["dkdv"]["blocks"] if kb is None else kb
    if kb not in (1, 2):
        raise ValueError(f"a dK/dV key group holds 1 or 2 KV blocks, got {kb}")
    cap = max(1, min(nbw, qt * row_budget) if row_budget else nbw)
    if chunk is None:  # CHUNK units of 64 query rows x one block; an entry is qt x G rows x kb blocks
        units = launch["dkdv"]["CHUNK"]
        if units == "auto":
            units = chunk_units(B * rows * num_q_heads * min(nbw, row_budget or nbw) // 64, selected.device)
        chunk = max(1, units * 64 // (qt * G * kb))
    max_slots = launch["dkdv"]["SLOTS"] // kb if max_slots is None else max_slots  # SLOTS: one-block partials
    if not 0 <= max_slots < _SlotCountRing.TAG_UNIT:  # the count used is packed below its build's tag
        raise ValueError(f"max_slots (the dK/dV partial budget) must be in 0..{_SlotCountRing.TAG_UNIT - 1}, "
                         f"got {max_slots}")
    dev = selected.device
    wdt = torch.int64 if qt > 32 else torch.int32
    i32 = dict(dtype=torch.int32, device=dev)
    fwd_count = torch.empty(n_tiles * Hkv, **i32)
    fwd_ks = torch.empty(n_tiles * Hkv, cap, **i32)
    fwd_word = torch.empty(n_tiles * Hkv, cap, dtype=wdt, device=dev)
    inv_ptr = torch.empty(n_lists + 1, **i32)
    piece_ptr = torch.empty(n_lists + 1, **i32)
    slot_ptr = torch.empty(n_lists + 1, **i32)
    nnz_cap = n_tiles * Hkv * cap
    max_pieces = n_lists + -(-nnz_cap // chunk)
    inv_qs = torch.empty(max(nnz_cap, 1), **i32)
    inv_word = torch.empty(max(nnz_cap, 1), kb, dtype=wdt, device=dev)
    piece_list = torch.empty(max(max_pieces, 1), **i32)
    ring, entry = _slot_count_ring(dev)
    tag_base = _SlotCountRing.tagged(entry) if ring is not None else 0
    if n_tiles:
        sel = selected.view(torch.uint8) if selected.dtype == torch.bool else selected
        words = torch.empty(n_tiles * Hkv, nbw, dtype=wdt, device=dev)
        inv_count = torch.empty(n_lists, **i32)
        qrow = ql.rows if ql is not None else qtiles
        sub = ql is not None
        _pack_lists_kernel[(n_tiles, Hkv)](sel, layout.blocks, words, fwd_count, fwd_ks, fwd_word, qtiles, qrow,
                                           *sel.stride()[:3], cap, nbw, HKV=Hkv, QT=qt, S=S, BS=bs, NBC=64, SUBSET=sub)
        _inv_count_kernel[(layout.n_blocks, Hkv)](words, layout.blocks, inv_count, qtiles, qrange, nbw, HKV=Hkv, S=S,
                                                  BS=bs, KB=kb, CB=128, SUBSET=sub)
        _scan_kernel[(1,)](inv_count, inv_ptr, piece_ptr, slot_ptr, n_lists, chunk, max_slots, tag_base, CH=1024)
        _inv_fill_kernel[(layout.n_blocks, Hkv)](words, layout.blocks, inv_ptr, piece_ptr, piece_list, inv_qs,
                                                 inv_word, qtiles, qrange, nbw, HKV=Hkv, S=S, QT=qt, BS=bs, KB=kb,
                                                 CB=128, SUBSET=sub)
    else:
        inv_ptr.zero_()
        piece_ptr.zero_()
        slot_ptr.fill_(tag_base)  # no lists: only the tagged count, 0
    if ring is None:  # CPU (untagged): read it now; while a CUDA graph is captured: unknown (the budget)
        count = int(slot_ptr[n_lists]) if dev.type != "cuda" else None
    else:
        ring.copy(entry, slot_ptr[n_lists:])
        count = (ring, entry)
    return SparseIndex(bs, qt, Hkv, layout, n_tiles, cap, fwd_count, fwd_ks, fwd_word, inv_ptr, inv_qs, inv_word,
                       chunk, piece_ptr, piece_list, slot_ptr, max_pieces, max_slots, kb, count,
                       qtiles if ql is not None else None, ql.rows if ql is not None else None,
                       ql.num_rows if ql is not None else None)


class _SlotCountRing:
    """Pinned host entries that slot counts are copied to without blocking, one per index build in
    turn. The count arrives tagged with its build's entry number: an entry that still holds -1 (copy
    not landed) or another build's count is waited on, and one reused by a build ``SIZE`` builds
    later is not trusted (the upper bound is taken). Waiting, not the bound, because the bound can
    be a GiB of partials at 32K: a backward right after its forward would otherwise raise the peak."""

    SIZE = 4096
    TAG_UNIT = 65536  # a tagged count is tag * TAG_UNIT + count (count < TAG_UNIT, tag < 32768: a positive int32)
    TIMEOUT_S = 60.0

    def __init__(self):
        self.host = torch.full((self.SIZE,), -1, dtype=torch.int32).pin_memory()
        self.view = self.host.numpy()
        self.builds = 0

    @classmethod
    def tagged(cls, entry: int, count: int = 0) -> int:
        """``count`` as build ``entry`` writes it (the scan kernel adds its count to ``tagged(entry)``)."""
        return entry % 32768 * cls.TAG_UNIT + count

    def next_entry(self) -> int:
        entry = self.builds
        self.builds += 1
        self.view[entry % self.SIZE] = -1
        return entry

    def copy(self, entry: int, count: Tensor) -> None:
        i = entry % self.SIZE
        self.host[i:i + 1].copy_(count, non_blocking=True)

    def read(self, entry: int) -> int | None:
        """The count of build ``entry`` (waits until its copy lands); None if its entry was reused."""
        deadline = None
        while self.builds - entry <= self.SIZE:
            v = int(self.view[entry % self.SIZE])
            if v >= 0 and v - self.tagged(entry) in range(self.TAG_UNIT):
                return v - self.tagged(entry)
            now = time.monotonic()
            deadline = deadline or now + self.TIMEOUT_S
            if now > deadline:
                raise RuntimeError(f"nosa_layers.ops: the dK/dV slot count of index build {entry} did not reach "
                                   f"the host in {self.TIMEOUT_S:.0f} s (is the GPU stream stalled?)")
            time.sleep(20e-6)
        return None


_RINGS: dict[tuple, _SlotCountRing] = {}


def _slot_count_ring(device: torch.device) -> tuple[_SlotCountRing | None, int]:
    """The host ring of this (GPU, thread) and this build's entry; none on the CPU or while a CUDA
    graph is being captured (a captured copy would land at replay, not now)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None, 0
    key = (device, threading.get_ident())
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = _SlotCountRing()
    return ring, ring.next_entry()


def union_inflation(index: SparseIndex, selected: Tensor) -> dict:
    """Work of the tiles' union lists against the rows' own selections (statistics; host syncs):
    ``inflation`` = listed blocks per row / selected blocks per row, ``bitmask_fill`` = selected rows
    per listed (tile, block) / rows of the tile. Whole-row indexes only."""
    if index.subset:
        raise ValueError("union_inflation takes an index of the whole row (no query chunks)")
    per_token = selected.sum(-1).float()  # [B, Hkv, T]
    counts = index.fwd_count.reshape(index.n_tiles, index.hkv).float()
    blocks = index.layout.blocks.long()
    S = index.block // index.qt
    qs = blocks[:, 1].repeat_interleave(S) + torch.arange(S, device=blocks.device).repeat(blocks.shape[0]) * index.qt
    de = blocks[:, 3].repeat_interleave(S)
    rows = (de - qs).clamp(min=0, max=index.qt).float()  # rows of each tile
    listed_rows = float((counts * rows[:, None]).sum())
    selected_rows = float(per_token.sum())
    e = torch.arange(index.cap, device=counts.device)[None, :] < index.fwd_count[:, None]
    words = index.fwd_word[e].long() & ((1 << index.qt) - 1 if index.qt < 64 else -1)
    bits = sum(((words >> i) & 1) for i in range(index.qt))
    return {
        "mean_blocks_per_token": float(per_token.mean()),
        "mean_union_blocks_per_tile": listed_rows / max(float(rows.sum()) * index.hkv, 1.0),
        "inflation": listed_rows / max(selected_rows, 1.0),
        "bitmask_fill": float(bits.sum()) / max(float((counts * rows[:, None]).sum()), 1.0),
        "nnz": int(e.sum()),
    }
