"""The selection part of the attention benchmark (``--selection``): its stages (compression, scoring
kernels, the fused top-k checked against the torch one), the index build and whether preparing a selection
is free of host synchronisations, against the sparse forward of the P1 lists."""

from __future__ import annotations

import hashlib

import torch

from bench.attention.inputs import index_for, make_inputs, p1_lists, synthetic_nosa_inputs
from bench.attention.rows import ROWS, bench, emit, ours
from bench.attention.sweeps import sweep_selection, under
from bench.host_timing import host_us_alone
from nosa_layers import NOSAConfig, prepare_selection
from nosa_layers.ops import select_blocks_triton
from nosa_layers.ops.block_selection import block_scores_triton, compress
from nosa_layers.ops.launch import SEL_CONFIG, TOPK_CONFIG
from nosa_layers.ops.layout import block_layout
from nosa_layers.ops.topk import select_from_block_scores, select_from_block_scores_torch
from train.profiling import device_ms_per_call


def selection_bench(T, HQ, dense_ms, sweep_first: bool):
    """The selection target: its stages on iid and smooth synthetic inputs against the sparse forward
    of the P1 lists (``selection / forward``), optionally after ``sweep_selection``."""
    cfg = NOSAConfig()
    _, sel, keys = p1_lists(T, seed=1)
    ours(T, HQ, sel, keys, dense_ms, "ours_p1_db", cfg, make_inputs(T, HQ))
    del sel
    fwd_ms = ROWS[-1]["fwd_ms"]
    chosen = sweep_selection(T, HQ) if sweep_first else []
    with under(chosen):
        for smooth in (0, 1):
            q, k, _, bias = synthetic_nosa_inputs(T, HQ, seed=2, smooth=smooth)
            t_sel = bench(lambda: select_blocks_triton(q, k, bias, cfg))[0]
            selection_breakdown(q, k, bias, cfg, t_sel, case="smooth" if smooth else "iid",
                                selection_over_p1_forward=round(t_sel / fwd_ms, 3),
                                lse_config=dict(SEL_CONFIG["lse"]), topk_config=dict(TOPK_CONFIG["cuda"]))


def scored_columns(bq, cfg, covered):
    """Block scores of one unpacked sample with the columns the scoring does not write (later blocks,
    the first ``covered`` blocks' rows) set to 0: a tensor that two code versions can compare."""
    T, nb = bq.shape[2], bq.shape[3]
    qb = torch.arange(T, device=bq.device) // cfg.block_size
    written = (torch.arange(nb, device=bq.device)[None, :] <= qb[:, None]) & (qb >= covered)[:, None]
    return bq.masked_fill(~written, 0.0)


def _digest(x: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (16 hex digits): equal digests mean bit-identical tensors."""
    return hashlib.sha256(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def selection_breakdown(q, k, bias, cfg, total_ms, **extra):
    """Selection stages (compression, scoring kernels, the fused top-k and the torch top-k it is
    checked against), the index build of the kernels, and whether preparing a selection (selection +
    index) runs without a host synchronisation (torch's sync debug mode raises on one); the GPU time of
    each scoring kernel, and digests of the block scores and the selection (to compare code versions)."""
    T, HQ = q.shape[1], q.shape[2]
    layout = block_layout(1, T, None, cfg.block_size, q.device)
    kc, ws = compress(k, bias, layout, cfg, q.dtype)
    bq = block_scores_triton(q, kc, layout, cfg, covered=cfg.topk)
    fused = select_from_block_scores(bq, ws, layout, cfg)
    exact = bool(torch.equal(fused, select_from_block_scores_torch(bq, ws, layout, cfg)))
    sel = select_blocks_triton(q, k, bias, cfg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepare_selection(q, k, bias, cfg, backend="triton")
        sync_free = True
    except RuntimeError:
        sync_free = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels = device_ms_per_call(lambda: block_scores_triton(q, kc, layout, cfg, covered=cfg.topk))
    index_gpu = device_ms_per_call(lambda: index_for(sel, cfg, T, HQ))  # kernels and the slot-count copy
    emit(kind="selection_breakdown", T=T, HQ=HQ, total_ms=total_ms,
         compress_ms=bench(lambda: compress(k, bias, layout, cfg, q.dtype))[0],
         scoring_kernels_ms=bench(lambda: block_scores_triton(q, kc, layout, cfg, covered=cfg.topk))[0],
         scoring_gpu_ms={name[:40]: round(ms, 4) for name, (ms, _) in kernels.items() if "_sel_" in name},
         scores_sha256=_digest(scored_columns(bq, cfg, cfg.topk)), selection_sha256=_digest(sel),
         fused_topk_ms=bench(lambda: select_from_block_scores(bq, ws, layout, cfg))[0],
         index_build_ms=bench(lambda: index_for(sel, cfg, T, HQ))[0],
         index_gpu_ms=round(sum(ms for ms, _ in index_gpu.values()), 4),
         index_gpu_by_kernel={name[:40]: round(ms, 4) for name, (ms, _) in index_gpu.items()},
         index_host_us=host_us_alone(lambda: index_for(sel, cfg, T, HQ)),
         prepare_ms=bench(lambda: prepare_selection(q, k, bias, cfg, backend="triton"))[0],
         prepare_sync_free=sync_free, fused_equals_torch=exact, **extra)
