"""Triton kernels that move KV blocks between pinned host memory and GPU slots without the host.

With unified virtual addressing, pinned host memory (``torch.empty(..., pin_memory=True)``) is
addressable from GPU kernels: the offloaded cache's copies then become kernel launches on the
compute stream, with no host synchronisation and no host-side gather, so a decode step that
fetches blocks can be captured in a CUDA graph. Shipped with exports; needs ``triton`` (absent:
``available()`` is False and the cache copies through the host instead).

Rows are ``bs * D`` contiguous elements (one KV block of one KV head): ``host [R, bs, D]``,
``slots [S, bs, D]``.
"""

from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the export also runs with torch + transformers alone
    triton = None

_KERNELS: dict = {}


def available() -> bool:
    return triton is not None


def _build() -> dict:
    if _KERNELS or triton is None:
        return _KERNELS

    @triton.jit
    def fetch_rows(src_k, src_v, dst_k, dst_v, src_row, dst_row, n, ELEMS: tl.constexpr, CHUNK: tl.constexpr):
        """Program p copies rows ``p, p + P, ...`` (``P`` programs): row ``src_row[i]`` of the host store
        to slot ``dst_row[i]`` (skipped if < 0)."""
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            d = tl.load(dst_row + i)
            if d >= 0:
                s = tl.load(src_row + i)
                for c in tl.static_range(0, ELEMS, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    tl.store(dst_k + d * ELEMS + offs, tl.load(src_k + s * ELEMS + offs))
                    tl.store(dst_v + d * ELEMS + offs, tl.load(src_v + s * ELEMS + offs))

    @triton.jit
    def store_tokens(k, v, dst_k, dst_v, dst_elem, D: tl.constexpr):
        """Program i writes token row ``i`` of ``k, v [N, D]`` at element offset ``dst_elem[i]``."""
        i = tl.program_id(0)
        e = tl.load(dst_elem + i)
        offs = tl.arange(0, D)
        tl.store(dst_k + e + offs, tl.load(k + i * D + offs))
        tl.store(dst_v + e + offs, tl.load(v + i * D + offs))

    _KERNELS.update(fetch=fetch_rows, store=store_tokens)
    return _KERNELS


def fetch_rows(host_k: Tensor, host_v: Tensor, slot_k: Tensor, slot_v: Tensor, src_row: Tensor,
               dst_row: Tensor, programs: int | None = None) -> None:
    """``slot[dst_row[i]] = host[src_row[i]]`` for every ``i`` with ``dst_row[i] >= 0`` (K and V).
    ``programs``: a grid of that many programs looping over the rows (few programs leave the other
    SMs to work on other streams); default one program per row."""
    elems = host_k.shape[1] * host_k.shape[2]
    chunk = min(elems, 1024)
    if elems % chunk:
        raise ValueError(f"block of {elems} elements is not a multiple of {chunk}")
    n = src_row.numel()
    grid = max(1, min(n, programs)) if programs else max(1, n)
    _build()["fetch"][(grid,)](host_k, host_v, slot_k, slot_v, src_row, dst_row, n,
                               ELEMS=elems, CHUNK=chunk, num_warps=4)


def store_tokens(k: Tensor, v: Tensor, host_k: Tensor, host_v: Tensor, dst_elem: Tensor) -> None:
    """Write token rows ``k, v [N, D]`` (contiguous) into the host store at element offsets ``dst_elem [N]``."""
    D = k.shape[-1]
    if D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two")
    _build()["store"][(k.shape[0],)](k, v, host_k, host_v, dst_elem, D=D, num_warps=1)


__all__ = ["available", "fetch_rows", "store_tokens"]
