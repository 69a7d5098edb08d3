"""Peak device memory of a stretch of CUDA work, attributed to the Python lines that allocated it.

Built on PyTorch's allocator history (``torch.cuda.memory._record_memory_history``): every
allocation and free of the caching allocator with its Python stack. :func:`record` runs a function
with the history on and returns its events; :func:`peak_allocations` replays them and returns the
blocks live at the peak; :func:`top_sites` groups those by the first frame outside PyTorch.
Only what the stretch allocates counts: buffers that existed before it (a KV cache, the weights)
are not in the history, and their frees inside the stretch are ignored.
"""

from __future__ import annotations

from collections import defaultdict

_ALLOC = "alloc"
_FREE = "free_completed"  # the block is back in the allocator's pool (not just requested)


def record(fn, device=None, max_entries: int = 2_000_000) -> list[dict]:
    """Run ``fn()`` with the CUDA allocator history on; the trace events of ``device``."""
    import torch

    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise RuntimeError("bench.memory_trace needs a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize(dev)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces", [])
    return list(traces[index]) if index < len(traces) else []


def peak_allocations(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay ``alloc`` / ``free_completed`` events: ``(peak bytes live, the alloc events of the blocks
    live at that peak)``. Frees of blocks allocated before the trace are ignored."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == _ALLOC:
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif action == _FREE and e.get("addr") in live:
            cur -= live.pop(e["addr"])["size"]
    live.clear()
    for e in events[:peak_at + 1]:
        action = e.get("action")
        if action == _ALLOC:
            live[e["addr"]] = e
        elif action == _FREE:
            live.pop(e.get("addr"), None)
    return peak, list(live.values())


def site(frames: list[dict], skip: tuple[str, ...] = ("/torch/", "/contextlib.py", "/bench/memory_trace.py")) -> str:
    """``file:line function`` of the innermost frame not inside ``skip`` (PyTorch and this module)."""
    for f in frames or []:
        name = f.get("filename", "")
        if not any(s in name for s in skip):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame outside torch)"


def top_sites(blocks: list[dict], n: int = 15) -> list[dict]:
    """Blocks grouped by :func:`site`, largest total first: ``[{site, mib, blocks}]``."""
    total: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for b in blocks:
        s = site(b.get("frames", []))
        total[s] += b["size"]
        count[s] += 1
    order = sorted(total, key=lambda s: -total[s])[:n]
    return [{"site": s, "mib": round(total[s] / 2**20, 3), "blocks": count[s]} for s in order]
