"""Where the host's time goes: per thread of a torch.profiler Chrome trace, the launches it issued and
the time it spent inside PyTorch ops (by op, self time) against Python between ops.

A run whose GPU sits idle in many short gaps is host-bound: the host needs longer to launch a step's
kernels than the GPU to run them. ``gpu_idle`` says where the GPU waited; this says what the host did
instead: how many launches per step (each costs host time: a PyTorch op's dispatch, a Triton kernel's
argument binding), which ops hold the host longest, and how much time passes in Python outside any
op (our layers' own code, Triton launches outside autograd functions). The forward and the
optimizer run on the main thread and the backward on autograd's device thread, so threads are
reported separately (the two that launch the most). Times are milliseconds.
"""

from __future__ import annotations

from collections import defaultdict

LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch")


def _thread(e: dict) -> tuple:
    return e.get("pid"), e.get("tid")


def _self_times(ops: list[dict]) -> tuple[dict, float]:
    """Self time per op name (µs, ``[total, calls]``) of nested ``cpu_op`` events of one thread, and the
    time covered by the outermost ones (µs)."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    stack: list[list] = []  # [end, event, children's time]
    covered = 0.0

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
            covered += e["dur"]
        stack.append([e["ts"] + e["dur"], e, 0.0])
    while stack:
        close(stack.pop())
    return by_name, covered


def host_work(events: list[dict], steps: int, top: int = 12, threads: int = 2) -> list[dict]:
    """Per host thread (the ``threads`` that launch the most): launches, the thread's span, time in
    PyTorch ops and between them, and the ``top`` ops by self time, all per step."""
    launches: dict[tuple, int] = defaultdict(int)
    ops: dict[tuple, list] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and e["name"].startswith(LAUNCH_PREFIXES):
            launches[_thread(e)] += 1
        elif cat == "cpu_op":
            ops[_thread(e)].append(e)
    per = 1.0 / max(steps, 1)
    out = []
    for tid in sorted(launches, key=lambda t: -launches[t])[:threads]:
        mine = ops.get(tid, [])
        by_name, covered = _self_times(mine)
        span = (max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)) if mine else 0.0
        out.append({
            "thread": len(out), "launches_per_step": round(launches[tid] * per, 1),
            "span_ms_per_step": round(span / 1e3 * per, 3),
            "in_ops_ms_per_step": round(covered / 1e3 * per, 3),
            "between_ops_ms_per_step": round((span - covered) / 1e3 * per, 3),
            "top_ops": [{"op": name, "self_ms_per_step": round(v[0] / 1e3 * per, 3),
                         "calls_per_step": round(v[1] * per, 1)}
                        for name, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        })
    return out
