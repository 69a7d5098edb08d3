"""Where the host's time goes: per thread of a torch.profiler Chrome trace, the launches it issued and
the time it spent inside PyTorch ops (by op, self time), and the time outside any op.

A run whose GPU sits idle in many short gaps is host-bound: the host needs longer to launch a step's
kernels than the GPU to run them. ``gpu_idle`` says where the GPU waited; this says what the host did
instead: how many launches per step (each costs host time: a PyTorch op's dispatch, a Triton kernel's
argument binding) and which ops hold the host longest. An op's self time includes waiting for the GPU
when it synchronises (``aten::_local_scalar_dense`` of an ``.item()``, a ``copy_`` to pageable host
memory): large values there mean the host was ahead. The forward and the optimizer run on the main
thread and the backward on autograd's device thread, so threads are reported separately (the two
that launch the most); ``outside_ops_ms_per_step`` is the time in which no thread was inside an op
(Python between ops, Triton launches outside autograd functions). Times are milliseconds.
"""

from __future__ import annotations

from collections import defaultdict

from train.gpu_idle import merge_intervals

LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch")


def _thread(e: dict) -> tuple:
    return e.get("pid"), e.get("tid")


def _self_times(ops: list[dict]) -> tuple[dict, list]:
    """Self time per op name (µs, ``[total, calls]``) of nested ``cpu_op`` events of one thread, and the
    ``(start, end)`` intervals of the outermost ones (µs)."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    stack: list[list] = []  # [end, event, children's time]
    outer: list[tuple[float, float]] = []

    def close(entry):
        end, ev, child = entry
        by_name[ev["name"]][0] += ev["dur"] - child
        by_name[ev["name"]][1] += 1
        if stack:
            stack[-1][2] += ev["dur"]

    for e in ops:
        while stack and stack[-1][0] <= e["ts"]:
            close(stack.pop())
        if not stack:
            outer.append((e["ts"], e["ts"] + e["dur"]))
        stack.append([e["ts"] + e["dur"], e, 0.0])
    while stack:
        close(stack.pop())
    return by_name, outer


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (µs), in ms."""
    return sum(t - s for s, t in merge_intervals(intervals)) / 1e3


def host_work(events: list[dict], steps: int, top: int = 12, threads: int = 2) -> dict:
    """Per host thread (the ``threads`` that launch the most): launches, time in PyTorch ops and the
    ``top`` ops by self time; over all threads: the span of their ops and the time outside any op;
    all per step."""
    launches: dict[tuple, int] = defaultdict(int)
    ops: dict[tuple, list] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and e["name"].startswith(LAUNCH_PREFIXES):
            launches[_thread(e)] += 1
        elif cat == "cpu_op":
            ops[_thread(e)].append(e)
    per = 1.0 / max(steps, 1)
    out, every = [], []
    for tid in sorted(launches, key=lambda t: -launches[t])[:threads]:
        by_name, outer = _self_times(ops.get(tid, []))
        every += outer
        out.append({
            "thread": len(out), "launches_per_step": round(launches[tid] * per, 1),
            "in_ops_ms_per_step": round(_union_ms(outer) * per, 3),
            "top_ops": [{"op": name, "self_ms_per_step": round(v[0] / 1e3 * per, 3),
                         "calls_per_step": round(v[1] * per, 1)}
                        for name, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        })
    span = (max(t for _, t in every) - min(s for s, _ in every)) / 1e3 if every else 0.0
    return {"threads": out, "span_ms_per_step": round(span * per, 3),
            "outside_ops_ms_per_step": round((span - _union_ms(every)) * per, 3)}
