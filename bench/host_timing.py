"""Host and GPU time of a GPU call, shared by ``bench.attention --profile`` and ``bench.probes.layer_host``.

A call's host time (Python, argument binding, launches) hides behind the GPU when work is queued ahead of
it and shows as GPU idle time when nothing is. These helpers time the host alone: the GPU is kept busy by a
``torch.cuda._sleep`` queued first, so that no launch waits for it. ``setup`` (optional) builds each call's
argument outside the timing (e.g. a graph for a backward); ``batch`` (optional) runs many calls at once
(e.g. one autograd engine run over many graphs, as a training step's backward does). Needs CUDA.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP_CYCLES = 40_000_000  # ~20 ms of GPU time at the H200's clock, ahead of one call's launches


def run_calls(fn, setup, batch, args: list) -> None:
    """The calls on ``args`` (``setup()`` results, or ``None`` each without a setup): ``batch(args)`` where
    given, else ``fn(arg)`` (``fn()`` without a setup) one by one."""
    if batch is not None:
        batch(args)
    else:
        for a in args:
            fn(a) if setup is not None else fn()


def host_us_back_to_back(fn, n: int, setup=None, batch=None, sleep_cycles: int = 5 * SLEEP_CYCLES) -> float:
    """Host time per call in microseconds of ``n`` calls back to back with the GPU kept busy (``sleep_cycles``
    queued first: more than the calls' host time), as a layer runs inside a step."""
    args = [setup() for _ in range(n)] if setup is not None else [None] * n
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    run_calls(fn, setup, batch, args)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(host / n * 1e6, 1)


def gpu_ms_back_to_back(fn, n: int, setup=None, batch=None, sleep_cycles: int = 5 * SLEEP_CYCLES) -> float:
    """GPU time per call in ms of ``n`` calls back to back (their host time hidden behind a sleep; the L2
    cache not flushed between them)."""
    args = [setup() for _ in range(n)] if setup is not None else [None] * n
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_calls(fn, setup, batch, args)
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n, 4)


def host_us_alone(fn, n: int = 20, setup=None) -> float:
    """Median host time in microseconds of one call made alone, right after a synchronisation, with the GPU
    kept busy (3 calls first, untimed)."""
    host = []
    for i in range(n + 3):
        arg = setup() if setup is not None else None
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if i >= 3:
            host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(sorted(host)[len(host) // 2] * 1e6, 1)


def host_top(fn, n: int = 20, setup=None, batch=None, top: int = 12) -> dict:
    """Python functions where ``n`` calls spend their host time (cProfile own time; cProfile slows Python
    down, so these are shares, not times): ``{"file:line(function)": us per call}``, the ``top`` largest;
    files of this repository by their path in it, others by their name."""
    args = [setup() for _ in range(n)] if setup is not None else [None] * n
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    run_calls(fn, setup, batch, args)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    where = lambda f: os.path.relpath(f, ROOT) if f.startswith(ROOT) else os.path.basename(f)  # noqa: E731
    return {f"{where(f)}:{line}({name})": round(v[2] / n * 1e6, 1) for (f, line, name), v in rows}
