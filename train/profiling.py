"""``profile.*``: a torch.profiler record of chosen training steps and a GPU-time breakdown.

The breakdown sorts every GPU kernel of the recorded steps by name into the parts of a NOSA (or
dense) attention layer and the rest: attention forward / backward (the NOSA Triton kernels, or
flash / cuDNN attention), NOSA selection and index kernels, and the eviction head's forward
(the ``nosa.eviction_head`` range), so NOSA and dense runs compare part by part (ms per step), and
names the kernels that make up the rest. The rest's matrix products (cuBLAS / CUTLASS kernels, by
name) are also given on their own (``everything_else_matmul``): the part no attention change can
shorten, which bounds the NOSA / dense ratio a faster attention can reach.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.outputs import atomic_path, write_atomic
from train.gpu_idle import PHASES, summarize, trace_events
from train.host_time import host_work

PARTS = {  # kernel-name fragments, checked in this order
    "nosa_selection": ("_compress_kernel", "_sel_lse_kernel", "_sel_block_kernel", "_select_kernel"),
    "nosa_index": ("_pack_lists_kernel", "_inv_count_kernel", "_scan_kernel", "_inv_fill_kernel"),
    "attention_backward": ("_bwd_dq_kernel", "_bwd_dkdv_kernel", "_dkdv_reduce_kernel", "_bwd_delta_kernel",
                           "flash_bwd", "bprop", "fmha_bwd", "attention_backward", "dot_do_o"),
    "attention_forward": ("_fwd_kernel", "flash_fwd", "fprop", "fmha_fwd", "attention_forward"),
}
EVICTION_RANGE = "nosa.eviction_head"
MATMUL = ("nvjet", "gemm", "cutlass", "xmma")  # cuBLAS(Lt) / CUTLASS kernel-name fragments (lower case)


def part_of(kernel: str):
    """The part of :data:`PARTS` a kernel name belongs to, or ``None`` (everything else)."""
    return next((name for name, frags in PARTS.items() if any(f in kernel for f in frags)), None)


def is_matmul(kernel: str) -> bool:
    """Whether a kernel outside :data:`PARTS` is a library matrix product (GEMM)."""
    name = kernel.lower()
    return any(f in name for f in MATMUL)


def _is_kernel(ev) -> bool:
    """Whether a ``key_averages()`` entry is GPU work of its own: a CUDA-timeline entry that is not the GPU
    copy of a profiler range (``record_function``: the eviction head's, the trainer's phases), whose time is
    its kernels' (counted as theirs). torch marks range copies ``is_user_annotation``; the trainer's phase
    names are checked as well."""
    return (getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA
            and not getattr(ev, "is_user_annotation", False) and ev.key not in PHASES)


def breakdown(events, steps: int) -> dict:
    """GPU ms per step by part from ``profiler.key_averages()`` (kernels and the eviction range);
    ``everything_else_matmul`` is the share of ``everything_else`` in library GEMM kernels."""
    parts = {name: 0.0 for name in PARTS}
    total = eviction = matmul = 0.0
    for ev in events:
        if ev.key == EVICTION_RANGE:
            eviction = (getattr(ev, "device_time_total", 0) or 0) / 1e3
            continue
        if not _is_kernel(ev):
            continue  # CPU ops and ranges: their kernels are counted as kernel events
        ms = (getattr(ev, "self_device_time_total", 0) or 0) / 1e3
        total += ms
        part = part_of(ev.key)
        if part is not None:
            parts[part] += ms
        elif is_matmul(ev.key):
            matmul += ms
    parts["eviction_head_forward"] = eviction
    parts["everything_else"] = total - sum(parts.values())
    parts["everything_else_matmul"] = matmul
    out = {k: round(v / steps, 3) for k, v in parts.items()}
    out["total_gpu"] = round(total / steps, 3)
    return out


def top_other_kernels(events, steps: int, n: int = 15) -> list[dict]:
    """The ``n`` kernels of "everything else" (not attention, selection or index) with the most GPU
    time: ``{"kernel", "ms_per_step", "calls_per_step"}``, names cut to 160 characters."""
    rows = []
    for ev in events:
        if not _is_kernel(ev) or part_of(ev.key) is not None:
            continue
        ms = (getattr(ev, "self_device_time_total", 0) or 0) / 1e3
        rows.append({"kernel": ev.key[:160], "ms_per_step": round(ms / steps, 3),
                     "calls_per_step": round((getattr(ev, "count", 0) or 0) / steps, 2)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def device_ms_per_call(fn, n: int = 5) -> dict:
    """GPU time per call of each kernel (and copy / fill) that ``fn()`` launches: torch.profiler over
    ``n`` calls, ``{name: (ms per call, launches per call)}`` (benchmarks; needs CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out[ev.key] = (t / 1e3 / n, ev.count // n)
    return out


def _allocator_counts() -> dict:
    """CUDA caching-allocator counters: device mallocs / frees and retries (a retry frees the cache
    and synchronises: GPU idle), plus the reserved-memory peak in GiB."""
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
    out = {k: int(st.get(k, 0)) for k in keys}
    out["reserved_peak_gib"] = round(st.get("reserved_bytes.all.peak", 0) / 2**30, 2)
    return out


class StepProfiler:
    """Records steps ``[start, start + n)`` (1-based) on the rank that owns the output."""

    def __init__(self, start: int, n: int, run_dir: str, enabled: bool, with_stack: bool = False) -> None:
        self.start, self.n, self.enabled = start, n, enabled and start > 0
        self.with_stack = with_stack
        self.out = Path(run_dir) / "profile"
        self.prof = None

    def before(self, step: int) -> None:
        if self.enabled and step == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.mem0 = _allocator_counts()
            self.prof = torch.profiler.profile(activities=acts, with_stack=self.with_stack)
            self.prof.__enter__()

    def after(self, step: int, log) -> None:
        if self.prof is None or step != self.start + self.n - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        with atomic_path(self.out / "trace.json") as tmp:
            self.prof.export_chrome_trace(str(tmp))
        events = self.prof.key_averages()
        summary = {"steps": [self.start, step], "gpu_ms_per_step": breakdown(events, self.n),
                   "everything_else_top": top_other_kernels(events, self.n)}
        if torch.cuda.is_available():
            mem1 = _allocator_counts()
            summary["allocator"] = {k: mem1[k] - self.mem0.get(k, 0) for k in mem1 if k.startswith("num_")}
            summary["allocator"]["reserved_peak_gib"] = mem1["reserved_peak_gib"]
            trace = trace_events(json.loads((self.out / "trace.json").read_text()))
            summary["gpu_idle"] = summarize(trace, self.n)
            summary["host"] = host_work(trace, self.n)
        write_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
        log(f"profile of steps {self.start}-{step}: {self.out / 'summary.json'} "
            f"(GPU ms/step: {summary['gpu_ms_per_step']}; idle ms/step: "
            f"{summary.get('gpu_idle', {}).get('gpu_idle_ms_per_step', '-')}; allocator: {summary.get('allocator')})")
        self.prof = None
