"""Where the GPU waits: idle gaps of a torch.profiler Chrome trace and what the host did meanwhile.

A step whose wall time exceeds its GPU time leaves the GPU idle between kernels. This module finds
those gaps in an exported trace (``prof.export_chrome_trace``) and, for each, the host work that
overlapped it: CUDA runtime calls (a ``cudaStreamSynchronize`` or a blocking ``cudaMemcpy`` is a
host sync; ``cudaMalloc`` / ``cudaFree`` are allocator retries) and the innermost CPU op / range
running when the gap began. ``summarize`` groups the gaps by that op so the cause reads off one
table. Times are milliseconds.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")  # the last with profile.with_stack
# The trainer's step phases (``torch.profiler.record_function`` ranges on the main thread, nested): the
# start of a step (zero the gradients, batches to the GPU), megatron's forward-backward schedule (its own
# time, outside the forwards: the backward and the schedule's glue), the forward of the step's first
# micro-batch and of the others, reading the next step's batches, the loss / finiteness read, the
# optimizer step. ``idle_by_phase`` splits the GPU's idle time among them.
PHASES = {
    "train.step_start": "step start (zero gradients, batches to the GPU)",
    "train.forward_first": "forward, first micro-batch of the step",
    "train.forward": "forward, other micro-batches",
    "train.forward_backward": "backward (and the schedule between micro-batches)",
    "train.read_ahead": "next step's batches read",
    "train.checks": "loss and finite-gradient read",
    "train.optimizer": "optimizer step",
}
# host calls that wait for the GPU (cudaMemcpyAsync to pageable host memory blocks too)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def trace_events(trace: dict) -> list[dict]:
    """The complete (``ph == X``) events of a Chrome trace."""
    evs = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [e for e in evs if e.get("ph") == "X" and "dur" in e]


def merge_intervals(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for s, t in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def gpu_busy(events: list[dict]) -> list[tuple[float, float]]:
    """Merged ``[start, end)`` intervals (µs) in which any GPU stream ran a kernel, copy or memset."""
    return merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)


def idle_gaps(events: list[dict], min_ms: float = 0.2) -> list[dict]:
    """Every GPU idle gap of at least ``min_ms`` with the host work that overlapped it."""
    busy = gpu_busy(events)
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and e["name"] not in PHASES),
                  key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    gaps = []
    for (_, s), (t, _) in itertools.pairwise(busy):
        if (t - s) / 1e3 < min_ms:
            continue
        calls = defaultdict(float)
        for e in runtime:
            if e["ts"] > t:
                break
            ov = min(t, e["ts"] + e["dur"]) - max(s, e["ts"])
            if ov > 0:
                calls[e["name"]] += ov / 1e3
        # innermost host range containing the gap start (shortest one that covers it)
        covering = [e for e in host if e["ts"] <= s <= e["ts"] + e["dur"]]
        covering.sort(key=lambda e: e["dur"])
        gaps.append({
            "start_us": s, "ms": (t - s) / 1e3,
            "host_op": covering[0]["name"] if covering else "(no host op: Python between ops)",
            "host_stack": [e["name"] for e in covering[:10]],
            "runtime_ms": {k: round(v, 3) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:4]},
        })
    return gaps


def phase_segments(events: list[dict]) -> list[tuple[float, float, str]]:
    """``(start, end, name)`` (µs) of the innermost trainer phase (``PHASES`` ranges, nested) at each moment
    they cover, in time order."""
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"] in PHASES),
                    key=lambda e: (e["ts"], -e["dur"]))
    segments: list[tuple[float, float, str]] = []
    stack: list[tuple[float, str]] = []  # (end, name) of the open ranges, innermost last
    cursor = 0.0

    def advance(to: float) -> None:
        nonlocal cursor
        if stack and to > cursor:
            segments.append((cursor, to, stack[-1][1]))
        cursor = max(cursor, to)

    for e in ranges:
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= start:  # close the ranges that ended before this one starts
            advance(stack[-1][0])
            stack.pop()
        advance(start)
        stack.append((end, e["name"]))
    while stack:
        advance(stack[-1][0])
        stack.pop()
    return segments


OUTSIDE = "(outside the trainer's phases)"


def _split_by_phase(intervals, segments: list[tuple[float, float, str]]) -> dict[str, float]:
    """µs of ``intervals`` (``(start, end)``, sorted by start) inside the phase ``segments`` (``phase_segments``),
    by phase name; what lies outside every phase under ``OUTSIDE``."""
    out: dict[str, float] = defaultdict(float)
    i = 0
    for s, t in intervals:
        covered = 0.0
        while i < len(segments) and segments[i][1] <= s:
            i += 1
        j = i
        while j < len(segments) and segments[j][0] < t:
            ov = min(t, segments[j][1]) - max(s, segments[j][0])
            if ov > 0:
                out[segments[j][2]] += ov
                covered += ov
            j += 1
        if t - s > covered:
            out[OUTSIDE] += t - s - covered
    return out


def idle_by_phase(busy: list[tuple[float, float]], segments: list[tuple[float, float, str]], steps: int,
                  waits: dict[str, list[tuple[float, float]]]) -> dict:
    """GPU idle and wall time per trainer phase (``PHASES``), ms per step, and ``host_waits_ms_per_step``: the
    host's time in the calls that wait for the GPU (``waits``: ``{runtime call: [(start, end), ...]}`` of
    ``SYNC_CALLS``), by call (a copy to the GPU from pageable memory shows here as ``cudaMemcpyAsync``, not as
    a read); what lies outside every phase under ``OUTSIDE``."""
    gaps = [(s, t) for (_, s), (t, _) in itertools.pairwise(busy)]
    idle = _split_by_phase(gaps, segments)
    span: dict[str, float] = defaultdict(float)
    for s, t, name in segments:
        span[name] += t - s
    waited = {call: _split_by_phase(sorted(iv), segments) for call, iv in waits.items()}
    per = 1.0 / max(steps, 1)
    out = {}
    for name in [*PHASES, OUTSIDE]:
        if name in span or name in idle or any(name in w for w in waited.values()):
            host_waits = {c: round(w.get(name, 0.0) / 1e3 * per, 2) for c, w in waited.items()}
            out[PHASES.get(name, name)] = {"idle_ms_per_step": round(idle[name] / 1e3 * per, 2),
                                           "span_ms_per_step": round(span[name] / 1e3 * per, 2),
                                           "host_waits_ms_per_step": {c: ms for c, ms in host_waits.items() if ms > 0}}
    return out


def summarize(events: list[dict], steps: int, min_ms: float = 0.2, top: int = 12) -> dict:
    """GPU busy / idle ms per step, idle grouped by the host op at the gap start, host-sync time."""
    busy = gpu_busy(events)
    if not busy:
        return {"gpu_events": 0}
    span = (busy[-1][1] - busy[0][0]) / 1e3
    busy_ms = sum(t - s for s, t in busy) / 1e3
    gaps = idle_gaps(events, min_ms)
    by_op: dict[str, list] = defaultdict(lambda: [0.0, 0, None])
    for g in gaps:
        entry = by_op[g["host_op"]]
        entry[0] += g["ms"]
        entry[1] += 1
        if entry[2] is None or g["ms"] > entry[2]["ms"]:
            entry[2] = g
    waits: dict[str, list[tuple[float, float]]] = defaultdict(list)  # the host calls that wait for the GPU
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS:
            waits[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    sync = {call: sum(t - s for s, t in iv) / 1e3 for call, iv in waits.items()}
    allocs = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaMalloc", "cudaFree", "cudaMallocAsync"):
            allocs[e["name"]][0] += 1
            allocs[e["name"]][1] += e["dur"] / 1e3
    per = 1.0 / max(steps, 1)
    return {
        "window_ms_per_step": round(span * per, 2),
        "gpu_busy_ms_per_step": round(busy_ms * per, 2),
        "gpu_idle_ms_per_step": round((span - busy_ms) * per, 2),
        f"idle_in_gaps_over_{min_ms}ms_per_step": round(sum(g["ms"] for g in gaps) * per, 2),
        "idle_by_host_op": [
            {"host_op": k, "ms_per_step": round(v[0] * per, 2), "gaps_per_step": round(v[1] * per, 1),
             "longest_gap_stack": v[2]["host_stack"]}
            for k, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
        "longest_gaps": sorted(gaps, key=lambda g: -g["ms"])[:top],
        "idle_by_phase": idle_by_phase(busy, phase_segments(events), steps, waits),
        "host_sync_ms_per_step": {k: round(v * per, 2) for k, v in sorted(sync.items(), key=lambda kv: -kv[1])},
        "allocator_calls_per_step": {k: {"count": round(n * per, 1), "ms": round(ms * per, 2)}
                                     for k, (n, ms) in allocs.items()},
    }


def summarize_file(path: str | Path, steps: int, min_ms: float = 0.2) -> dict:
    return summarize(trace_events(json.loads(Path(path).read_text())), steps, min_ms)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="GPU idle gaps of a torch.profiler Chrome trace")
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace covers (figures are per step)")
    ap.add_argument("--min-ms", type=float, default=0.2)
    a = ap.parse_args()
    print(json.dumps(summarize_file(a.trace, a.steps, a.min_ms), indent=1))
