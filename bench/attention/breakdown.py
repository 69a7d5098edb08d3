"""Where the attention's time goes: packed documents against FlashAttention-2 varlen by stage
(``--packed``), the kernels' device time and the calls' host overhead (``--profile``), the index build's
top ops and its host time behind queued GPU work (``--index-profile``)."""

from __future__ import annotations

import time

import torch

from bench.attention.inputs import DEV, DT, D, index_for, make_inputs, p1_case, p1_lists, synthetic_nosa_inputs
from bench.attention.inputs import useful_keys
from bench.attention.rows import bench, emit
from bench.host_timing import SLEEP_CYCLES, gpu_ms_back_to_back, host_top, host_us_alone
from nosa_layers import NOSAConfig, prepare_selection
from nosa_layers.megatron.dense_varlen import causal_varlen_attention
from nosa_layers.ops import select_blocks_triton, sparse_attention
from nosa_layers.ops.launch import launch_config
from train.profiling import PARTS, device_ms_per_call, part_of


def packed_documents(T, HQ):
    """Cost per token of selection + index + forward + backward for 1, 8 and 64 documents per sample."""
    cfg = NOSAConfig()
    q, k, v, bias = synthetic_nosa_inputs(T, HQ, seed=4, smooth=1)
    do = torch.randn_like(q)
    g = torch.Generator().manual_seed(5)
    for n_docs in (1, 8, 64):
        cut = torch.sort(torch.randperm(T - 1, generator=g)[:n_docs - 1] + 1).values.tolist()
        cu = torch.tensor([0] + cut + [T], dtype=torch.int32, device=DEV)
        qg, kg, vg, bg = (x.clone().requires_grad_(True) for x in (q, k, v, bias))

        def step():
            prep = prepare_selection(qg, kg, bg, cfg, cu, backend="triton")
            o = sparse_attention(qg, kg, vg, prep.index, bias=bg)
            torch.autograd.grad(o, (qg, kg, vg, bg), do)

        step()
        t = bench(step)[0]
        sel = prepare_selection(q, k, bias, cfg, cu, backend="triton").selected
        keys = sum(useful_keys(sel[:, :, a:e], cfg.block_size) for a, e in zip(cu.tolist(), cu.tolist()[1:]))
        # the dense baseline of training on the same packing: FlashAttention-2 varlen, forward + backward
        longest = int(torch.diff(cu).max())
        qd, kd, vd = (x[0].detach().clone().requires_grad_(True) for x in (q, k, v))

        def dense_step():
            o = causal_varlen_attention(qd, kd, vd, cu, longest)
            torch.autograd.grad(o, (qd, kd, vd), do[0])

        dense_step()
        td = bench(dense_step)[0]
        gpu = {"nosa": _gpu_ms_by_stage(step), "dense": _gpu_ms_by_stage(dense_step)}
        causal_keys = sum((e - a) * (e - a + 1) // 2 for a, e in zip(cu.tolist(), cu.tolist()[1:]))
        emit(kind="packed_documents", T=T, HQ=HQ, n_docs=n_docs, step_ms=t, us_per_ktoken=1e3 * t / (T / 1024),
             useful_tflops=3.5 * 4.0 * HQ * keys * D / t / 1e9, dense_varlen_ms=td,
             dense_useful_tflops=3.5 * 4.0 * HQ * causal_keys * D / td / 1e9, nosa_over_dense=t / td,
             density=keys / causal_keys, gpu_ms=gpu,
             gpu_nosa_over_dense=sum(gpu["nosa"].values()) / max(sum(gpu["dense"].values()), 1e-9))


def _gpu_ms_by_stage(fn) -> dict:
    """GPU time of one ``fn()`` by part of ``train.profiling.PARTS`` (``device_ms_per_call``): the NOSA
    selection, index, attention forward, backward (ours or FlashAttention's), everything else."""
    out = dict.fromkeys([*PARTS, "other"], 0.0)
    for key, (ms, _) in device_ms_per_call(fn).items():
        out[part_of(key) or "other"] += ms
    return {k: round(v, 4) for k, v in out.items()}


def profile_kernels(T, HQ):
    """Per-kernel device time (torch.profiler) of one forward + backward on the P1 lists, with the
    useful TFLOP/s of each attention kernel (dQ: 3 matmuls = 1.5x the forward FLOPs; dK/dV/db: 4 = 2x)."""
    sel, keys, cfg, idx, (qg, kg, vg, bg), do = p1_case(T, HQ)

    def step():
        o = sparse_attention(qg, kg, vg, idx, bias=bg)
        torch.autograd.grad(o, (qg, kg, vg, bg), do)

    for _ in range(2):
        step()
    fwd_flops = 4.0 * HQ * keys * D
    mult = {"_fwd_kernel": 1.0, "_bwd_dq_kernel": 1.5, "_bwd_dkdv_kernel": 2.0}
    kernels = {}
    for key, (ms, calls) in device_ms_per_call(step).items():
        row = dict(ms=round(ms, 3), calls=calls)
        for name, m in mult.items():
            if name in key:
                row["tflops"] = round(m * fwd_flops / ms / 1e9, 1)
        kernels[key[:60]] = row
    emit(kind="kernel_profile", T=T, HQ=HQ, config={k: dict(v) for k, v in launch_config(torch.device(DEV)).items()},
         kernels=kernels)


def call_overhead(T, HQ, n=20):
    """Where the table's forward / backward time goes beyond the kernels (P1 lists): per call, the
    host time of the call with the GPU kept busy (``torch.cuda._sleep`` queued first, so no launch
    waits), the GPU time of back-to-back calls (host time hidden, L2 not flushed), the kernels'
    device time (torch.profiler), the table's ``do_bench`` time (L2 flushed before each call: a host
    time longer than the flush shows in it) and the host's top Python functions."""
    sel, keys, cfg, idx, (qg, kg, vg, bg), do = p1_case(T, HQ)
    o = sparse_attention(qg, kg, vg, idx, bias=bg)
    calls = dict(forward=lambda: sparse_attention(qg, kg, vg, idx, bias=bg),
                 backward=lambda: torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True))
    for name, fn in calls.items():
        host = host_us_alone(fn, n)
        back_to_back = gpu_ms_back_to_back(fn, n, sleep_cycles=SLEEP_CYCLES)
        kernels = device_ms_per_call(fn)
        emit(kind="call_overhead", T=T, HQ=HQ, call=name, host_us=host, back_to_back_ms=round(back_to_back, 3),
             kernels_ms=round(sum(ms for ms, _ in kernels.values()), 3), do_bench_ms=round(bench(fn)[0], 3),
             host_top_us=host_top(fn))


def profile_index(T, HQ):
    """Where the index build spends its time (torch.profiler, CPU and CUDA, P1 lists): top ops."""
    from torch.profiler import ProfilerActivity, profile

    _, sel, _ = p1_lists(T, seed=1)
    cfg = NOSAConfig()
    for _ in range(3):
        index_for(sel, cfg, T, HQ)
    torch.cuda.synchronize()
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        index_for(sel, cfg, T, HQ)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            index_for(sel, cfg, T, HQ)
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    emit(kind="index_profile", T=T, HQ=HQ, wall_ms=round(wall, 3),
         top_ops={e.key[:50]: dict(self_cpu_ms=round(e.self_cpu_time_total / 1e3 / n, 3), calls=e.count // n,
                                   device_ms=round((getattr(e, "self_device_time_total", 0) or 0) / 1e3 / n, 3))
                  for e in ops})


def index_host_check(T, HQ, builds=56):
    """Host time of ``builds`` index builds (one training step's worth at 28 layers x 2 micro-batches)
    queued behind about 20 ms of GPU work, with and without the non-blocking copy of the slot count to
    the host ring: a build that blocked would wait for that work (host time up, GPU wait down)."""
    import nosa_layers.ops.sparse_index as si

    cfg = NOSAConfig()
    q, k, _, bias = make_inputs(T, HQ)
    sel = select_blocks_triton(q, k, bias, cfg)
    ring = si._slot_count_ring
    x = torch.randn(8192, 8192, device=DEV, dtype=DT)
    for name, fn in (("ring", ring), ("no_ring", lambda dev: (None, 0)), ("ring", ring)):
        si._slot_count_ring = fn
        try:
            keep = [index_for(sel, cfg, T, HQ) for _ in range(8)]
            torch.cuda.synchronize()
            keep.clear()
            for _ in range(20):
                x @ x
            t0 = time.perf_counter()
            keep = [index_for(sel, cfg, T, HQ) for _ in range(builds)]
            host = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            emit(kind="index_host_check", T=T, HQ=HQ, variant=name, builds=builds, host_ms=round(host, 2),
                 gpu_wait_ms=round((time.perf_counter() - t1) * 1e3, 1), workspace_slots=keep[-1].workspace_slots())
        finally:
            si._slot_count_ring = ring
