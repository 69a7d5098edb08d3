"""Peak device memory of a stretch of CUDA work, attributed to the Python lines that allocated it.

Built on PyTorch's allocator history (``torch.cuda.memory._record_memory_history``): every
allocation and free of the caching allocator with its Python stack. :func:`record` runs a function
with the history on and returns its events; :func:`peak_allocations` replays them and returns the
blocks live at the peak; :func:`top_sites` groups those by the first frame outside PyTorch.
Only what the stretch allocates counts: buffers that existed before it (the weights) are not in
the history, and their frees inside the stretch are ignored. A stretch may hold a set-up part (e.g.
building a KV cache) before the part whose peak is wanted: ``fn`` gets a ``mark()`` to call between
them, and :func:`peak_allocations` takes the peak after the mark, over everything still live.
"""

from __future__ import annotations

from collections import defaultdict

_ALLOC = "alloc"
_FREE = "free_completed"  # the block is back in the allocator's pool (not just requested)


def record(fn, device=None, max_entries: int = 2_000_000, marked: bool = False):
    """Run ``fn()`` with the CUDA allocator history on; the trace events of ``device``. With
    ``marked``, ``fn(mark)`` is called and the result is ``(events, index)``: ``index`` is the number
    of events recorded when ``mark()`` ran (0 if it never did)."""
    import torch

    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise RuntimeError("bench.memory_trace needs a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    def events() -> list:
        traces = torch.cuda.memory._snapshot().get("device_traces", [])
        return list(traces[index]) if index < len(traces) else []

    at = [0]

    def mark() -> None:
        torch.cuda.synchronize(dev)
        at[0] = len(events())

    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn(mark) if marked else fn()
        torch.cuda.synchronize(dev)
        out = events()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if len(out) >= max_entries:
        raise RuntimeError(f"allocator history full ({max_entries} events): raise max_entries")
    return (out, at[0]) if marked else out


def peak_allocations(events: list[dict], start: int = 0) -> tuple[int, list[dict]]:
    """Replay ``alloc`` / ``free_completed`` events: ``(peak bytes live, the alloc events of the blocks
    live at that peak)``, the peak taken over the states after event ``start`` (0: after any
    event; the live bytes just before ``start`` count as a candidate). Frees of blocks allocated
    before the trace are ignored."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1 if start == 0 else None
    for i, e in enumerate(events):
        if i == start and start > 0:
            peak, peak_at = cur, i - 1
        action = e.get("action")
        if action == _ALLOC:
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak and i >= start:
                peak, peak_at = cur, i
        elif action == _FREE and e.get("addr") in live:
            cur -= live.pop(e["addr"])["size"]
    if peak_at is None:  # ``start`` at or past the end: the state after the last event
        peak, peak_at = cur, len(events) - 1
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
