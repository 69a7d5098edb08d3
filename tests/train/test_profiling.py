"""GPU-time breakdown of a profiled step (``train/profiling.py``) from profiler events."""

from dataclasses import dataclass

import pytest
import torch

from train.profiling import breakdown, top_other_kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@dataclass
class Ev:
    key: str
    device_type: object
    self_device_time_total: float  # us
    device_time_total: float = 0.0
    count: int = 1
    is_user_annotation: bool = False


def test_kernels_are_sorted_into_parts_per_step():
    events = [
        Ev("_fwd_kernel", CUDA, 4000), Ev("_bwd_dq_kernel", CUDA, 3000), Ev("_bwd_dkdv_kernel", CUDA, 5000),
        Ev("_sel_block_kernel", CUDA, 1000), Ev("_select_kernel", CUDA, 200), Ev("_pack_lists_kernel", CUDA, 100),
        Ev("_inv_fill_kernel", CUDA, 100), Ev("sm90_xmma_gemm_bf16", CUDA, 20000),
        Ev("pytorch_flash::flash_fwd_kernel", CUDA, 600), Ev("nvjet_sm90_tst_128x256_NTN", CUDA, 6000),
        Ev("triton_poi_fused_silu_mul", CUDA, 2000),
        Ev("aten::mm", CPU, 20000),  # a CPU op's own kernels are already counted as kernel events
        Ev("nosa.eviction_head", CPU, 0, 800),
        Ev("train.forward_backward", CUDA, 30000),  # a phase range on the GPU timeline: its kernels are above
        Ev("a user's range", CUDA, 9000, is_user_annotation=True),  # any range copy, by torch's mark
    ]
    got = breakdown(events, steps=2)
    assert got["attention_forward"] == pytest.approx(2.3) and got["attention_backward"] == pytest.approx(4.0)
    assert got["nosa_selection"] == pytest.approx(0.6) and got["nosa_index"] == pytest.approx(0.1)
    assert got["eviction_head_forward"] == pytest.approx(0.4)
    assert got["total_gpu"] == pytest.approx(21.0)
    assert got["everything_else"] == pytest.approx(21.0 - 2.3 - 4.0 - 0.6 - 0.1 - 0.4)
    assert got["everything_else_matmul"] == pytest.approx(13.0)  # the two GEMMs, not the fused SwiGLU


def test_the_rest_is_named_kernel_by_kernel_largest_first():
    events = [Ev("_fwd_kernel", CUDA, 9000), Ev("elementwise_kernel<mul>", CUDA, 3000, count=8),
              Ev("sm90_xmma_gemm_bf16", CUDA, 20000, count=4), Ev("aten::mm", CPU, 20000),
              Ev("reduce_kernel<sum>", CUDA, 500, count=2), Ev("train.optimizer", CUDA, 90000)]
    top = top_other_kernels(events, steps=2, n=2)
    assert [r["kernel"] for r in top] == ["sm90_xmma_gemm_bf16", "elementwise_kernel<mul>"]
    assert top[0]["ms_per_step"] == pytest.approx(10.0) and top[1]["calls_per_step"] == 4.0


def _x(cat, name, ts, dur, **kw):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw}


def test_gpu_idle_gaps_name_the_host_work_that_caused_them():
    from train.gpu_idle import idle_gaps, summarize

    events = [
        _x("kernel", "gemm", 0, 1000), _x("kernel", "gemm", 500, 1500),  # overlapping: one busy interval
        _x("kernel", "attn", 5000, 1000),  # 3 ms gap after 2000 us
        _x("gpu_memcpy", "Memcpy DtoH", 6000, 100), _x("kernel", "mlp", 6200, 800),  # 0.1 ms gap: below 0.2
        _x("kernel", "mlp", 9000, 1000),  # 2 ms gap
        _x("cpu_op", "aten::item", 1900, 3200), _x("cpu_op", "aten::_local_scalar_dense", 1950, 3100),
        _x("cuda_runtime", "cudaStreamSynchronize", 2000, 2900),
        _x("user_annotation", "step", 0, 10000),
        _x("cuda_runtime", "cudaMalloc", 7100, 1500), _x("cuda_runtime", "cudaMalloc", 7000, 50),
    ]
    gaps = idle_gaps(events, min_ms=0.2)
    assert [round(g["ms"], 3) for g in gaps] == [3.0, 2.0]
    assert gaps[0]["host_op"] == "aten::_local_scalar_dense"
    assert gaps[0]["host_stack"][:3] == ["aten::_local_scalar_dense", "aten::item", "step"]
    assert gaps[0]["runtime_ms"] == {"cudaStreamSynchronize": 2.9}
    assert gaps[1]["host_op"] == "step" and gaps[1]["runtime_ms"]["cudaMalloc"] == pytest.approx(1.55)
    s = summarize(events, steps=2)
    assert s["window_ms_per_step"] == 5.0 and s["gpu_busy_ms_per_step"] == 2.45
    assert s["gpu_idle_ms_per_step"] == 2.55
    top = s["idle_by_host_op"][0]
    assert (top["host_op"], top["ms_per_step"], top["gaps_per_step"]) == ("aten::_local_scalar_dense", 1.5, 0.5)
    assert top["longest_gap_stack"][:2] == ["aten::_local_scalar_dense", "aten::item"]
    assert s["host_sync_ms_per_step"] == {"cudaStreamSynchronize": 1.45}
    assert s["allocator_calls_per_step"]["cudaMalloc"]["count"] == 1.0
    assert s["allocator_calls_per_step"]["cudaMalloc"]["ms"] == pytest.approx(0.775, abs=0.006)


def test_gpu_idle_is_split_among_the_trainers_phases():
    from train.gpu_idle import PHASES, idle_by_phase, phase_segments, summarize

    ann = lambda name, ts, dur: _x("user_annotation", name, ts, dur)  # noqa: E731
    events = [
        ann("train.step_start", 0, 1000),
        ann("train.forward_backward", 1000, 8000),
        ann("train.forward_first", 1000, 2000), ann("train.forward", 5000, 1000),
        ann("train.checks", 9000, 500), ann("train.optimizer", 9500, 1500),
        _x("user_annotation", "nosa.eviction_head", 1200, 100),  # not a phase: ignored
        _x("kernel", "a", 500, 700),      # idle 1200-1500 (forward, first micro-batch)
        _x("kernel", "b", 1500, 1000),    # idle 2500-3200: 500 in the first forward, 200 in the backward
        _x("kernel", "c", 3200, 5900),    # idle 9100-9700: 400 in the checks, 200 in the optimizer
        _x("kernel", "d", 9700, 1000),    # idle 10700-11500: 300 in the optimizer, 500 outside
        _x("kernel", "e", 11500, 100),
    ]
    segs = phase_segments(events)
    assert [(s, t, n) for s, t, n in segs] == [
        (0, 1000, "train.step_start"), (1000, 3000, "train.forward_first"), (3000, 5000, "train.forward_backward"),
        (5000, 6000, "train.forward"), (6000, 9000, "train.forward_backward"), (9000, 9500, "train.checks"),
        (9500, 11000, "train.optimizer")]
    got = idle_by_phase([(500, 1200), (1500, 2500), (3200, 9100), (9700, 10700), (11500, 11600)], segs, steps=1,
                        waits={})
    nothing = {"host_waits_ms_per_step": {}}  # no call that waits for the GPU in these events
    assert got[PHASES["train.forward_first"]] == {"idle_ms_per_step": 0.8, "span_ms_per_step": 2.0, **nothing}
    assert got[PHASES["train.forward_backward"]] == {"idle_ms_per_step": 0.2, "span_ms_per_step": 5.0, **nothing}
    assert got[PHASES["train.checks"]] == {"idle_ms_per_step": 0.4, "span_ms_per_step": 0.5, **nothing}
    assert got[PHASES["train.optimizer"]] == {"idle_ms_per_step": 0.5, "span_ms_per_step": 1.5, **nothing}
    assert got["(outside the trainer's phases)"]["idle_ms_per_step"] == 0.5
    assert got[PHASES["train.forward"]]["idle_ms_per_step"] == 0.0
    assert sum(v["idle_ms_per_step"] for v in got.values()) == pytest.approx(2.4)  # every idle moment, once
    s = summarize(events, steps=1)
    assert s["idle_by_phase"] == got and s["gpu_idle_ms_per_step"] == 2.4
    assert all(not g["host_op"].startswith("train.") for g in s["longest_gaps"])  # phases are not host ops


def test_host_waits_are_split_among_the_trainers_phases():
    """A copy to the GPU that waits (from pageable memory) shows in the phase that issued it; a synchronize
    that spans two phases is split between them; waits outside every phase are kept apart."""
    from train.gpu_idle import OUTSIDE, PHASES, summarize

    ann = lambda name, ts, dur: _x("user_annotation", name, ts, dur)  # noqa: E731
    rt = lambda name, ts, dur: _x("cuda_runtime", name, ts, dur)  # noqa: E731
    events = [
        ann("train.step_start", 0, 1000), ann("train.forward_backward", 1000, 8000),
        ann("train.checks", 9000, 500), ann("train.optimizer", 9500, 1500),
        _x("kernel", "a", 0, 11000),
        rt("cudaMemcpyAsync", 100, 600), rt("cudaMemcpyAsync", 800, 100),  # the batches' copies
        rt("cudaStreamSynchronize", 9200, 500),  # 300 in the checks, 200 in the optimizer step
        rt("cudaMemcpyAsync", 11200, 400),  # after the step: outside the phases
        rt("cudaLaunchKernel", 2000, 300),  # does not wait
    ]
    for steps, scale in ((1, 1.0), (2, 0.5)):
        phases = summarize(events, steps=steps)["idle_by_phase"]
        assert phases[PHASES["train.step_start"]]["host_waits_ms_per_step"] == {"cudaMemcpyAsync": 0.7 * scale}
        assert phases[PHASES["train.checks"]]["host_waits_ms_per_step"] == {"cudaStreamSynchronize": 0.3 * scale}
        assert phases[PHASES["train.optimizer"]]["host_waits_ms_per_step"] == {"cudaStreamSynchronize": 0.2 * scale}
        assert phases[PHASES["train.forward_backward"]]["host_waits_ms_per_step"] == {}
        assert phases[OUTSIDE]["host_waits_ms_per_step"] == {"cudaMemcpyAsync": 0.4 * scale}


def test_host_work_splits_threads_and_counts_self_time_and_launches():
    from train.host_time import host_work

    main, bwd = dict(pid=1, tid=1), dict(pid=1, tid=2)
    events = [
        # main thread: op A 0-100 us containing op B 10-40 (and its launch) and op C 50-60; op D 200-250
        _x("cpu_op", "A", 0, 100, **main), _x("cpu_op", "B", 10, 30, **main), _x("cpu_op", "C", 50, 10, **main),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, **main), _x("cpu_op", "D", 200, 50, **main),
        _x("cuda_driver", "cuLaunchKernelEx", 150, 5, **main),  # a Triton launch between ops
        _x("cuda_runtime", "cudaMemcpyAsync", 210, 5, **main),
        _x("cuda_runtime", "cudaStreamSynchronize", 220, 20, **main),  # not a launch
        # autograd thread: one op with one launch
        _x("cpu_op", "E", 300, 40, **bwd), _x("cuda_runtime", "cudaLaunchKernel", 310, 5, **bwd),
        _x("user_annotation", "ProfilerStep#1", 0, 400, **main),  # ranges are not ops
        _x("kernel", "gemm", 30, 100, pid=0, tid=7),
    ]
    h = host_work(events, steps=2)
    t0, t1 = h["threads"]
    assert (t0["launches_per_step"], t1["launches_per_step"]) == (1.5, 0.5)
    assert t0["in_ops_ms_per_step"] == 0.075 and t1["in_ops_ms_per_step"] == 0.02  # 150 and 40 us
    # ops span 0-340 us; inside an op: 0-100, 200-250, 300-340 -> outside 150 us
    assert h["span_ms_per_step"] == 0.17 and h["outside_ops_ms_per_step"] == 0.075
    self_ms = {o["op"]: o["self_ms_per_step"] for o in t0["top_ops"]}
    assert self_ms == {"A": 0.03, "B": 0.015, "C": 0.005, "D": 0.025}  # A: 100 - 30 - 10 us, over 2 steps
    assert [o["op"] for o in t0["top_ops"]] == ["A", "D", "B", "C"]
    assert t1["top_ops"] == [{"op": "E", "self_ms_per_step": 0.02, "calls_per_step": 0.5}]
    assert host_work(events, steps=2, threads=1)["threads"] == [t0]
