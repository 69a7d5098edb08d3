"""The KV blocks of a (packed) batch, the one table every kernel of ``nosa_layers.ops`` walks.

Every document of every batch row is cut into blocks of ``block`` tokens aligned to the document
start (the last one may be partial). Block ``c`` of the table holds ``b, k_start, doc_start,
doc_end`` (token offsets in batch row ``b``); its index inside its document is
``(k_start - doc_start) // block``. Kernels take one block per program, so a packed batch runs in
one launch whatever its number of documents (no per-document Python loop).

The table depends only on ``B, T`` and ``cu_seqlens``, so it is built once per micro-batch and
the other layers find it in a cache keyed by the ``cu_seqlens`` tensor object (and its in-place
version). Building it needs the values of ``cu_seqlens`` on the host: a caller that already has
them (the trainer, from the loader's batch) hands them over with :func:`remember_host_values`, and
then nothing is read back from the device (no host synchronisation in the layers); otherwise the
first layer reads them (one synchronisation per micro-batch). The table goes to the device from
pinned memory without blocking the host.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockLayout:
    block: int          # tokens per KV block
    batch: int          # B
    seq_len: int        # T (tokens per batch row)
    n_blocks: int       # blocks of all documents of all rows
    max_doc_blocks: int  # blocks of the longest document (the width of a selection)
    blocks: Tensor      # int32 [n_blocks, 4]: b, k_start, doc_start, doc_end
    host: tuple = field(default=(), repr=False, compare=False)  # the same rows on the host


def _build(B: int, T: int, spans: tuple, block: int, device: torch.device) -> BlockLayout:
    rows, widest = [], 0
    for b in range(B):
        for s, e in spans:
            n = -(-(e - s) // block)
            widest = max(widest, n)
            rows.extend((b, s + i * block, s, e) for i in range(n))
    blocks = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)
    if device.type == "cuda":  # pinned source: the copy is queued, the host goes on
        blocks = blocks.pin_memory().to(device, non_blocking=True)
    else:
        blocks = blocks.to(device)
    return BlockLayout(block, B, T, blocks.shape[0], widest, blocks, tuple(rows))


@functools.lru_cache(maxsize=32)
def _unpacked(B: int, T: int, block: int, device: str) -> BlockLayout:
    return _build(B, T, ((0, T),) if T else (), block, torch.device(device))


@dataclass
class _Known:
    """What this module holds for one ``cu_seqlens`` tensor; dropped when the tensor dies."""
    ref: weakref.ref
    host: tuple | None = None  # (in-place version, host values) handed over by the caller
    layout: tuple | None = None  # (key, BlockLayout) built for it


_KNOWN: dict[int, _Known] = {}  # id(cu_seqlens) -> _Known


def _forget(ident: int, ref) -> None:
    """Weakref callback: drop ``_KNOWN[ident]`` if it still belongs to the tensor that died."""
    known = _KNOWN.get(ident)
    if known is not None and known.ref is ref:
        del _KNOWN[ident]


def _known(cu_seqlens: Tensor) -> _Known:
    ident = id(cu_seqlens)
    known = _KNOWN.get(ident)
    if known is None or known.ref() is not cu_seqlens:  # new tensor (or a dead one's reused id)
        known = _Known(weakref.ref(cu_seqlens, lambda r: _forget(ident, r)))
        _KNOWN[ident] = known
    return known


def remember_host_values(cu_seqlens: Tensor, values: list[int]) -> None:
    """Hand over the values of a device ``cu_seqlens`` that the caller holds on the host, so that
    :func:`block_layout` does not read them back (valid until the tensor is changed in place)."""
    if len(values) != cu_seqlens.numel():
        raise ValueError(f"{len(values)} host values for a cu_seqlens of {cu_seqlens.numel()} entries")
    _known(cu_seqlens).host = (cu_seqlens._version, [int(v) for v in values])


def host_values(cu_seqlens: Tensor) -> list[int] | None:
    """The host values handed over for ``cu_seqlens`` (:func:`remember_host_values`), ``None`` if there
    are none (or the tensor changed in place since)."""
    known = _KNOWN.get(id(cu_seqlens))
    if known is None or known.ref() is not cu_seqlens or known.host is None:
        return None
    return list(known.host[1]) if known.host[0] == cu_seqlens._version else None


def block_layout(B: int, T: int, cu_seqlens: Tensor | None, block: int, device) -> BlockLayout:
    """The block table of a batch ``[B, T]`` (``cu_seqlens``: packed documents, B = 1)."""
    device = torch.device(device)
    if cu_seqlens is None:
        return _unpacked(B, T, block, str(device))
    key = (cu_seqlens._version, B, T, block, str(device))
    known = _known(cu_seqlens)
    if known.layout is not None and known.layout[0] == key:
        return known.layout[1]
    if known.host is not None and known.host[0] == cu_seqlens._version:
        cu = known.host[1]  # handed over by the caller: no read from the device
    else:
        cu = cu_seqlens.tolist()  # one host sync, once per micro-batch
    if B != 1 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T} with batch size 1, got {cu} (B={B})")
    layout = _build(B, T, tuple((a, b) for a, b in zip(cu, cu[1:]) if b > a), block, device)
    known.layout = (key, layout)
    return layout
