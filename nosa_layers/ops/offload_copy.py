"""Triton kernels that move KV blocks between pinned host memory and GPU slots without the host.

With unified virtual addressing, pinned host memory (``torch.empty(..., pin_memory=True)``) is
addressable from GPU kernels: the offloaded cache's copies then become kernel launches on the
compute stream, with no host synchronisation and no host-side gather, so a decode step that
fetches blocks can be captured in a CUDA graph (``inference.transfers``). Shipped into sparse exports (a copy
next to ``modeling_nosa.py``); there Triton may be missing: ``available()`` is False and the cache copies
through the host instead.

Rows are ``bs * D`` contiguous elements (one KV block of one KV head): ``host [R, bs, D]``,
``slots [S, bs, D]``.
"""

from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # an export's copy also runs with torch + transformers alone
    triton = None

_KERNELS: dict = {}


def available() -> bool:
    return triton is not None


def define_kernels() -> None:
    """Define the Triton kernels now (no-op without Triton): a ``torch.compile``-d caller must find them
    defined, it cannot trace their definition."""
    _build()


def _build() -> dict:
    if _KERNELS or triton is None:
        return _KERNELS

    @triton.jit
    def fetch_rows(src_k, src_v, src_b, dst_k, dst_v, dst_b, src_row, dst_row, n, ELEMS: tl.constexpr,
                   CHUNK: tl.constexpr, BELEMS: tl.constexpr, HAS_B: tl.constexpr):
        """Program p copies rows ``p, p + P, ...`` (``P`` programs): row ``src_row[i]`` of the host store
        to slot ``dst_row[i]`` (skipped if < 0); with ``HAS_B`` also the row's ``BELEMS`` bias values."""
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            d = tl.load(dst_row + i)
            if d >= 0:
                s = tl.load(src_row + i)
                for c in tl.static_range(0, ELEMS, CHUNK):
                    offs = c + tl.arange(0, CHUNK)
                    tl.store(dst_k + d * ELEMS + offs, tl.load(src_k + s * ELEMS + offs))
                    tl.store(dst_v + d * ELEMS + offs, tl.load(src_v + s * ELEMS + offs))
                if HAS_B:
                    offs_b = tl.arange(0, BELEMS)
                    tl.store(dst_b + d * BELEMS + offs_b, tl.load(src_b + s * BELEMS + offs_b))

    @triton.jit
    def store_tokens(k, v, dst_k, dst_v, dst_elem, D: tl.constexpr):
        """Program i writes token row ``i`` of ``k, v [N, D]`` at element offset ``dst_elem[i]``."""
        i = tl.program_id(0)
        e = tl.load(dst_elem + i)
        offs = tl.arange(0, D)
        tl.store(dst_k + e + offs, tl.load(k + i * D + offs))
        tl.store(dst_v + e + offs, tl.load(v + i * D + offs))

    @triton.jit
    def store_values(x, dst, dst_elem, n, BLOCK: tl.constexpr):
        """``dst[dst_elem[i]] = x[i]`` for ``i < n`` (one value per row: a token's bias)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        e = tl.load(dst_elem + i, mask=live, other=0)
        tl.store(dst + e, tl.load(x + i, mask=live, other=0.0), mask=live)

    _KERNELS.update(fetch=fetch_rows, store=store_tokens, store_values=store_values)
    return _KERNELS


def fetch_rows(host_k: Tensor, host_v: Tensor, slot_k: Tensor, slot_v: Tensor, src_row: Tensor,
               dst_row: Tensor, programs: int | None = None, host_b: Tensor | None = None,
               slot_b: Tensor | None = None) -> None:
    """``slot[dst_row[i]] = host[src_row[i]]`` for every ``i`` with ``dst_row[i] >= 0`` (K and V, and
    the bias rows ``host_b -> slot_b [rows, bs]`` when given).
    ``programs``: a grid of that many programs looping over the rows (few programs leave the other
    SMs to work on other streams); default one program per row."""
    elems = host_k.shape[1] * host_k.shape[2]
    chunk = min(elems, 1024)
    if elems % chunk:
        raise ValueError(f"block of {elems} elements is not a multiple of {chunk}")
    has_b = host_b is not None
    belems = host_b.shape[1] if has_b else 1
    if has_b and (slot_b is None or slot_b.shape[1] != belems or belems & (belems - 1)):
        raise ValueError("bias rows: host and slot rows of one power-of-two length")
    n = src_row.numel()
    grid = max(1, min(n, programs)) if programs else max(1, n)
    _build()["fetch"][(grid,)](host_k, host_v, host_b if has_b else host_k, slot_k, slot_v,
                               slot_b if has_b else slot_k, src_row, dst_row, n,
                               ELEMS=elems, CHUNK=chunk, BELEMS=belems, HAS_B=has_b, num_warps=4)


def store_tokens(k: Tensor, v: Tensor, host_k: Tensor, host_v: Tensor, dst_elem: Tensor) -> None:
    """Write token rows ``k, v [N, D]`` (contiguous) into the host store at element offsets ``dst_elem [N]``."""
    D = k.shape[-1]
    if D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two")
    _build()["store"][(k.shape[0],)](k, v, host_k, host_v, dst_elem, D=D, num_warps=1)


def store_values(x: Tensor, host: Tensor, dst_elem: Tensor) -> None:
    """``host.view(-1)[dst_elem[i]] = x[i]`` (``x [N]`` contiguous, same dtype as ``host``)."""
    n = x.numel()
    if n:
        block = 128
        _build()["store_values"][(-(-n // block),)](x, host, dst_elem, n, BLOCK=block, num_warps=1)


__all__ = ["available", "define_kernels", "fetch_rows", "store_tokens", "store_values"]
