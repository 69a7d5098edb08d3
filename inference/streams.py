"""CUDA streams of the decode step (graph capture, batch parts), shared by every cache of a thread."""

from __future__ import annotations

import threading

import torch

_STREAMS: dict = {}  # (device index, purpose, thread) -> [torch.cuda.Stream]


def shared_streams(device, purpose: str, n: int) -> list:
    """``n`` CUDA streams of ``device`` for ``purpose`` ("graph": decode-graph capture, "part": batch
    parts of a step), shared by every cache of this thread. A stream that has run a matmul keeps a
    cuBLAS workspace (32 MiB on Hopper) for the rest of the process, so streams made per cache
    would each add one, up to the size of PyTorch's stream pool (32 streams, about 1 GiB)."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    pool = _STREAMS.setdefault((index, purpose, threading.get_ident()), [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device=index))
    return pool[:n]
