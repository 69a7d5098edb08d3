"""Benchmark of the NOSA Triton attention kernels against dense cuDNN SDPA and FlexAttention.

One process, one GPU, identical inputs. For every shape (T, HQ) with Hkv=2, D=128, bf16:

* dense causal SDPA (cuDNN backend; K/V expanded to HQ heads outside the timed region);
* "P1" block lists: per 128-token query block, sink + 8-block window (diagonal included) + random
  past blocks up to 32 blocks of 128 tokens. FlexAttention runs them as 128x128 blocks (its
  64-token sparse backward does not compile on torch 2.11) without bias and with a per-key bias
  with gradient; ours runs the very same key sets as 64-token blocks (64 blocks per row), with the
  bias gradient (db) and without it. Identical math and density for Flex and ours.
* "NOSA": a real NOSA selection (``select_blocks_triton``, default config, k=64 blocks of 64) of
  synthetic inputs: per-token lists, run by ours as union lists + token bitmask over query tiles of
  one KV group's heads (``_tiles64``: the same with 64-token tiles of one head, the earlier layout);
  reports the selection time, the index build time and the union inflation.
* ``--packed``: selection + index + forward + backward per token with 1, 8 and 64 documents per sample,
  against FlashAttention-2 varlen forward + backward on the same packing (the dense document-masked
  baseline of training), with the GPU kernel time of both by stage (torch.profiler).

Per row: ms (median of ``triton.testing.do_bench``, L2 flushed), useful TFLOP/s (fwd = 4 x D x HQ
x sum over rows of visible keys, bwd = 2.5 x fwd), density = useful / dense causal FLOPs, and
"x ideal" = time / (density x dense cuDNN time of the same run).

Usage: python -m bench.attention --out DIR [--shapes 32768x32,16384x32,...] [--sweep] [--profile] [--packed]
       [--no-flex] [--tiles64] [--dkdv-sweep] [--fwd-sweep] [--tile-sweep] [--balance-sweep]
       [--selection [--sel-sweep]]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.host_timing import SLEEP_CYCLES, gpu_ms_back_to_back, host_top, host_us_alone
from nosa_layers import NOSAConfig, prepare_selection
from nosa_layers.megatron.dense_varlen import causal_varlen_attention
from nosa_layers.ops import build_sparse_index, select_blocks_triton, sparse_attention
from nosa_layers.ops.launch import CONFIG, SEL_CONFIG, TOPK_CONFIG, arch, hopper_device, launch_config, overrides
from nosa_layers.ops.block_selection import block_scores_triton, compress
from nosa_layers.ops.layout import block_layout
from nosa_layers.ops.sparse_index import union_inflation
from nosa_layers.ops.topk import select_from_block_scores, select_from_block_scores_torch
from runtime.outputs import write_json
from train.profiling import PARTS, device_ms_per_call, part_of

D, HKV = 128, 2
DT = torch.bfloat16
DEV = "cuda"
ROWS: list[dict] = []


def attention_table():
    """The attention kernels' launch table of this GPU's architecture."""
    return CONFIG[arch(torch.device(DEV))]


def under(chosen: list) -> contextlib.ExitStack:
    """A ``with`` block that runs under the launch settings ``chosen`` by the sweeps: ``[(table, {entry:
    settings})]``, later ones over earlier ones (``launch.overrides``; the tables themselves stay as they are)."""
    stack = contextlib.ExitStack()
    for table, entries in chosen:
        stack.enter_context(overrides(table, **entries))
    return stack


def index_for(sel, cfg, T, HQ, qt=None, cu=None):
    return build_sparse_index(sel, cfg, T, cu, num_q_heads=HQ, row_budget=cfg.topk, qt=qt)


def bench(fn):
    ms = do_bench(fn, warmup=50, rep=300, quantiles=[0.5, 0.2, 0.8])
    return ms[0], ms[1], ms[2]


def emit(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def p1_lists(T: int, seed: int, qb: int = 128, topk: int = 32, win: int = 8):
    """Per 128-query-block lists; returns (flex BlockMask pieces, 64-block selection, useful keys)."""
    g = torch.Generator().manual_seed(seed)
    nqb = T // qb
    full_idx = torch.zeros(nqb, nqb, dtype=torch.int32)
    full_num = torch.zeros(nqb, dtype=torch.int32)
    part_idx = torch.zeros(nqb, nqb, dtype=torch.int32)
    part_num = torch.ones(nqb, dtype=torch.int32)
    sel128 = torch.zeros(nqb, nqb, dtype=torch.bool)
    for i in range(nqb):
        fb = set(range(max(0, i + 1 - win), i))
        if i > 0:
            fb.add(0)
        cand = [j for j in range(1, i) if j not in fb]
        need = topk - 1 - len(fb)
        if need > 0 and cand:
            fb.update(cand[p] for p in torch.randperm(len(cand), generator=g)[:need].tolist())
        fb = sorted(fb)
        full_num[i] = len(fb)
        full_idx[i, :len(fb)] = torch.tensor(fb, dtype=torch.int32)
        part_idx[i, 0] = i
        sel128[i, fb] = True
        sel128[i, i] = True
    # 64-token view: query half-block r of 128-block i takes the 64-blocks of sel128[i], causal
    sel64 = sel128.repeat_interleave(2, 0).repeat_interleave(2, 1)  # [nqb64, nb64]
    nqb64 = 2 * nqb
    sel64 &= torch.arange(nqb64)[None, :] <= torch.arange(nqb64)[:, None]
    keys = 0
    for i in range(nqb64):
        nfull = int(sel64[i, :i].sum())
        keys += 64 * 64 * nfull + 64 * 65 // 2
    sel = sel64.repeat_interleave(64, 0)[None, None].expand(1, HKV, T, nqb64).contiguous()
    return (part_num, part_idx, full_num, full_idx), sel.to(DEV), keys


def useful_keys(sel: torch.Tensor, bs: int) -> int:
    """sum over (KV head, row) of visible keys of the selected blocks, divided by Hkv (per head avg)."""
    B, H, T, nb = sel.shape
    t = torch.arange(T, device=sel.device)
    blk = torch.arange(nb, device=sel.device)
    nkeys = ((t[:, None] + 1 - blk[None, :] * bs).clamp(0, bs))  # [T, nb] visible keys of block
    return int((sel.float() * nkeys.float()).sum().item()) // H


def dense(T, HQ, dense_ms):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, T, D, device=DEV, dtype=DT, requires_grad=True)
    k = torch.randn(1, HQ, T, D, device=DEV, dtype=DT, requires_grad=True)
    v = torch.randn(1, HQ, T, D, device=DEV, dtype=DT, requires_grad=True)
    do = torch.randn_like(q)
    fl = 2.0 * HQ * T * T * D
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        tf = bench(f)
        o = f()
        tb = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    dense_ms[(T, HQ)] = (tf[0], tb[0])
    emit(kind="dense_sdpa_cudnn", T=T, HQ=HQ, fwd_ms=tf[0], bwd_ms=tb[0], fwd_tflops=fl / tf[0] / 1e9,
         bwd_tflops=2.5 * fl / tb[0] / 1e9, density=1.0)


def _row(kind, T, HQ, keys, tf, tb, dense_ms, **extra):
    fl = 4.0 * HQ * keys * D
    fl_dense = 2.0 * HQ * T * T * D
    dens = fl / fl_dense
    df, db = dense_ms.get((T, HQ), (float("nan"), float("nan")))
    emit(kind=kind, T=T, HQ=HQ, density=round(dens, 4), fwd_ms=tf, bwd_ms=tb,
         fwd_tflops=fl / tf / 1e9 if tf else None, bwd_tflops=2.5 * fl / tb / 1e9 if tb else None,
         fwd_x_ideal=tf / (dens * df) if tf else None, bwd_x_ideal=tb / (dens * db) if tb else None, **extra)


def make_inputs(T, HQ, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device=DEV, dtype=DT, generator=g)
    k = torch.randn(1, T, HKV, D, device=DEV, dtype=DT, generator=g)
    v = torch.randn(1, T, HKV, D, device=DEV, dtype=DT, generator=g)
    bias = 0.1 * torch.randn(1, T, HKV, device=DEV, dtype=torch.float32, generator=g)
    return q, k, v, bias


def ours(T, HQ, sel, keys, dense_ms, kind, cfg, inputs, extra=None, qt=None):
    q, k, v, bias = inputs
    t0 = time.time()
    idx = index_for(sel, cfg, T, HQ, qt)
    torch.cuda.synchronize()
    t_index = bench(lambda: index_for(sel, cfg, T, HQ, qt))[0]
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    bg = bias.clone().requires_grad_(True)
    f = lambda: sparse_attention(qg, kg, vg, idx, bias=bg)  # noqa: E731
    o = f()
    do = torch.randn_like(o)
    torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True)
    torch.cuda.synchronize()
    ct = time.time() - t0
    tf = bench(f)
    tb = bench(lambda: torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True))
    o2 = sparse_attention(qg, kg, vg, idx, bias=bias)
    tb_nodb = bench(lambda: torch.autograd.grad(o2, (qg, kg, vg), do, retain_graph=True))
    infl = union_inflation(idx, sel)
    _row(kind, T, HQ, keys, tf[0], tb[0], dense_ms, bwd_nodb_ms=tb_nodb[0], fwd_p20_p80=tf[1:], bwd_p20_p80=tb[1:],
         index_ms=t_index, first_call_s=round(ct, 2), qt=idx.qt, inflation=round(infl["inflation"], 3),
         bitmask_fill=round(infl["bitmask_fill"], 3), **(extra or {}))
    return o.detach()


def flex(T, HQ, pieces, keys, dense_ms, inputs, ours_out):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    import torch._dynamo
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    G = HQ // HKV
    pn, pi, fn_, fi = (x[None, None].to(DEV) for x in pieces)
    bm = BlockMask.from_kv_blocks(pn, pi, fn_, fi, BLOCK_SIZE=(128, 128), mask_mod=lambda b, h, qi, ki: qi >= ki,
                                  seq_lengths=(T, T))
    q, k, v, bias = inputs
    qf, kf, vf = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    bias_t = bias.transpose(1, 2).contiguous()  # [1, Hkv, T]
    bias_g = bias_t.clone().requires_grad_(True)
    do = torch.randn_like(qf)
    cf = torch.compile(flex_attention, dynamic=False)

    def sm_grad(s, b, h, qi, ki):
        return s + bias_g[b, h // G, ki]

    for name, sm, ins in (("flex_p1_nobias", None, (qf, kf, vf)), ("flex_p1_bias_grad", sm_grad, (qf, kf, vf, bias_g))):
        try:
            t0 = time.time()
            f = lambda: cf(qf, kf, vf, score_mod=sm, block_mask=bm, enable_gqa=True)  # noqa: E731
            o = f()
            torch.autograd.grad(o, ins, do, retain_graph=True)
            torch.cuda.synchronize()
            ct = time.time() - t0
            err = None
            if sm is not None and ours_out is not None:
                err = (o.transpose(1, 2).float() - ours_out.float()).abs().max().item()
            tf = bench(f)
            tb = bench(lambda: torch.autograd.grad(o, ins, do, retain_graph=True))
            _row(name, T, HQ, keys, tf[0], tb[0], dense_ms, compile_s=round(ct, 1), max_abs_diff_vs_ours=err)
        except Exception as e:  # noqa: BLE001
            emit(kind=name, T=T, HQ=HQ, error=(type(e).__name__ + ": " + str(e))[:300])


def synthetic_nosa_inputs(T, HQ, seed, smooth):
    """q/k for a NOSA selection: iid (smooth=0) or with a slowly varying shared component."""
    q, k, v, bias = make_inputs(T, HQ, seed)
    if smooth:
        g = torch.Generator(device=DEV).manual_seed(seed + 1)
        walk = torch.randn(1, T // 256 + 2, 1, D, device=DEV, generator=g)
        walk = F.interpolate(walk.permute(0, 2, 3, 1).reshape(1, D, -1), size=T, mode="linear").reshape(1, D, T)
        walk = walk.permute(0, 2, 1)[:, :, None, :]
        q = (q.float() * 0.5 + 2.0 * walk).to(DT)
        k = (k.float() * 0.5 + 2.0 * walk).to(DT)
    return q, k, v, bias


def p1_case(T, HQ):
    """P1 lists and inputs at one shape: ``(sel, keys, cfg, index, (q, k, v, bias) gradient leaves, dO)``."""
    _, sel, keys = p1_lists(T, seed=1)
    cfg = NOSAConfig()
    q, k, v, bias = make_inputs(T, HQ)
    leaves = tuple(x.clone().requires_grad_(True) for x in (q, k, v, bias))
    return sel, keys, cfg, index_for(sel, cfg, T, HQ), leaves, torch.randn_like(q)


def _try_configs(kernel, cands, run, chosen: list) -> None:
    """Time ``run()`` with each candidate (settings over ``kernel``'s entry of the attention table), on top of
    the settings ``chosen`` so far; the fastest joins ``chosen``."""
    table = attention_table()
    best = None
    with under(chosen):
        for c in cands:
            entry = dict(table[kernel], **c)
            try:
                with overrides(table, **{kernel: entry}):
                    t = run()
                emit(kind="sweep", kernel=kernel, cfg=c, ms=t)
                if best is None or t < best[0]:
                    best = (t, entry)
            except Exception as e:  # noqa: BLE001
                emit(kind="sweep", kernel=kernel, cfg=c, error=(type(e).__name__ + ": " + str(e))[:300])
    if best:
        chosen.append((table, {kernel: best[1]}))


def sweep(T, HQ, dense_ms) -> list:
    """The fastest launch config of each kernel at one shape (others fixed): real NOSA lists (iid inputs,
    the union-inflation worst case) at the default query tile. Returns them for ``under``."""
    cfg = NOSAConfig()
    q, k, v, bias = synthetic_nosa_inputs(T, HQ, seed=2, smooth=0)
    sel = select_blocks_triton(q, k, bias, cfg)
    qg, kg, vg, bg = (x.clone().requires_grad_(True) for x in (q, k, v, bias))
    do = torch.randn_like(q)

    def fwd():
        idx = index_for(sel, cfg, T, HQ)
        return bench(lambda: sparse_attention(qg, kg, vg, idx, bias=bg))[0]

    def bwd():
        idx = index_for(sel, cfg, T, HQ)
        o = sparse_attention(qg, kg, vg, idx, bias=bg)
        return bench(lambda: torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True))[0]

    chosen = []
    _try_configs("fwd", [dict(num_warps=w, num_stages=s, rows=r) for r, w, s in
                         ((64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2))], fwd, chosen)
    _try_configs("dq", [dict(num_warps=w, num_stages=s, rows=r) for r, w, s in
                        ((64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2))], bwd, chosen)
    # dK/dV: the key-group size is part of each candidate (inherited, two-block groups spill at 4 warps)
    _try_configs("dkdv", [dict(num_warps=w, num_stages=s, rows=r, blocks=b) for b, r, w, s in
                          ((1, 64, 4, 2), (1, 64, 4, 3), (1, 64, 8, 2), (1, 128, 8, 2), (2, 32, 8, 4))], bwd, chosen)
    _try_configs("dkdv", [dict(CHUNK=c) for c in (256, 1024, 4096)], bwd, chosen)
    _try_configs("tile", [dict(rows=r) for r in (64, 128, 256)], lambda: fwd() + bwd(), chosen)
    chosen += sweep_selection(T, HQ)
    with under(chosen):
        emit(kind="config", config={k: dict(v) for k, v in launch_config(torch.device(DEV)).items()},
             selection={k: dict(v) for k, v in SEL_CONFIG.items()})
    return chosen


# dK/dV: the Triton kernel (two- and one-block groups, 8 warps) against the warp-specialised Hopper
# kernel (attention_sm90: key blocks per group = consumer warpgroups, rows per step, ring slots)
# (``triton={}``: the candidate's groups and stages hold on GPUs where the Hopper kernels cannot run too)
DKDV_CANDIDATES = [dict(dkdv=dict(impl=i, blocks=b, rows=r, num_warps=8, num_stages=s, triton={})) for i, b, r, s in (
    ("triton", 2, 32, 4), ("triton", 1, 32, 3), ("gluon", 2, 32, 4), ("gluon", 1, 32, 2), ("gluon", 1, 32, 3),
    ("gluon", 1, 32, 4), ("gluon", 1, 64, 2), ("gluon", 1, 64, 3))]


# forward / dQ: the Triton kernels against the hand-scheduled Hopper kernels (attention_sm90) at 2 or 3
# K/V ring slots each, dQ's A operands Q / dO in registers or shared memory; dK/dV is the same in every
# candidate (``triton={}``: the candidate's stages hold where the Hopper kernels cannot run too)
# (two forward slots with registers capped at 168 per thread, three programs per SM instead of
# two, against the default three slots at 220 registers); the one-entry-per-step forward (``keys_per_step``
# 64) against the default two entries per step (128). Also measured on an H200 in 2026-12, at commit c565288
# of this sweep: two warpgroups taking turns (ping-pong) and two 64-key products per pair, both slower.
FWD_CANDIDATES = [dict(fwd=dict(impl=i, num_stages=fs, regs=True, triton={}, maxnreg=mr, keys_per_step=64),
                       dq=dict(impl=i, num_stages=qs, regs=qr))
                  for i, fs, qs, qr, mr in (("triton", 2, 2, True, None), ("gluon", 2, 2, True, None),
                                            ("gluon", 3, 2, True, None), ("gluon", 2, 2, False, None),
                                            ("gluon", 2, 3, True, None), ("gluon", 2, 2, False, 168))]
# two list entries per step, one 128-key product each (attention_sm90_pairs, the default on Hopper)
FWD_CANDIDATES += [dict(fwd=dict(impl="gluon", num_stages=3, regs=True, triton={}, keys_per_step=128),
                        dq=dict(impl="gluon", num_stages=2, regs=False))]


# query tiles of more or fewer tokens (the G heads of a KV group x 16 / 8 / 4 tokens at G = 8): larger
# matmuls per list entry against larger unions of the tokens' selections (more work on real selections);
# on Hopper 128-row tiles run the Gluon forward / dQ with two warpgroups (``attention_sm90.warps_for``)
TILE_CANDIDATES = [dict(tile=dict(rows=r), fwd=dict(rows=r, num_warps=w), dq=dict(rows=r, num_warps=w))
                   for r, w in ((64, 4), (128, 8), (128, 4), (32, 4))]


# dK/dV load balance: list pieces of CHUNK units (64 query rows x one KV block) and the budget of fp32
# partial slots (one-block partials); lists past the budget run whole in one program. Real NOSA
# selections share their query-agnostic blocks across all later queries: long inverse lists.
BALANCE_CANDIDATES = [dict(dkdv=dict(CHUNK=c, SLOTS=s)) for c, s in (
    (1024, 512), (1024, 4096), (1024, 16384), (512, 8192), (512, 16384), (256, 16384))]


def _sweep_cases(T, HQ):
    """(name, selection, useful keys, inputs) of the P1 lists and real NOSA selections (iid, smooth)."""
    cfg = NOSAConfig()
    _, p1_sel, p1_keys = p1_lists(T, seed=1)
    cases = [("p1", p1_sel, p1_keys, make_inputs(T, HQ))]
    for smooth in (0, 1):
        q, k, v, bias = synthetic_nosa_inputs(T, HQ, seed=2, smooth=smooth)
        sel = select_blocks_triton(q, k, bias, cfg)
        cases.append(("smooth" if smooth else "iid", sel, useful_keys(sel, cfg.block_size), (q, k, v, bias)))
    return cfg, cases


def _longest_piece(idx) -> int:
    """List entries of the longest dK/dV program (a piece of a split list, or a whole list)."""
    n = torch.diff(idx.inv_ptr.long())
    split = idx.slot_ptr[:-1].long() >= 0
    return int(torch.where(split, n.clamp(max=idx.chunk), n).max()) if n.numel() else 0


def _workspace_mib(idx) -> float:
    """MiB of the fp32 dK/dV/db partials the backward allocates for this index."""
    slots, keys = idx.workspace_shape()
    return slots * keys * (2 * D + 1) * 4 / 2**20  # dK and dV [slots, keys, D] and db [slots, keys], fp32


def config_sweep(kind, candidates, T, HQ, dense_ms):
    """Forward and backward (with db) time of each candidate launch config (``{kernel: overrides}``)
    on the P1 lists and real NOSA selections, and the largest output / gradient difference against
    the first candidate (same inputs, same dO)."""
    cfg, cases = _sweep_cases(T, HQ)
    table = attention_table()
    for name, sel, keys, (q, k, v, bias) in cases:
        qg, kg, vg, bg = (x.clone().requires_grad_(True) for x in (q, k, v, bias))
        do = torch.randn_like(q)
        ref = None
        dens = 4.0 * HQ * keys * D / (2.0 * HQ * T * T * D)
        for cand in candidates:
            try:
                with overrides(table, **{kernel: dict(table[kernel], **over) for kernel, over in cand.items()}):
                    idx = index_for(sel, cfg, T, HQ)
                    o = sparse_attention(qg, kg, vg, idx, bias=bg)
                    outs = (o, *torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True))
                    ref = outs if ref is None else ref
                    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, ref))
                    tf = bench(lambda: sparse_attention(qg, kg, vg, idx, bias=bg))[0]
                    tb = bench(lambda: torch.autograd.grad(o, (qg, kg, vg, bg), do, retain_graph=True))[0]
                emit(kind=kind, case=name, T=T, HQ=HQ, cfg=cand, hopper_kernels=hopper_device(qg.device),
                     fwd_ms=tf, bwd_ms=tb,
                     fwd_x_ideal=tf / (dens * dense_ms[(T, HQ)][0]), bwd_x_ideal=tb / (dens * dense_ms[(T, HQ)][1]),
                     fwd_entries=int(idx.fwd_count.sum()), inv_entries=int(idx.inv_ptr[-1]),
                     dkdv_pieces=int(idx.piece_ptr[-1]), longest_piece=_longest_piece(idx),
                     dkdv_workspace_mib=_workspace_mib(idx), max_diff_vs_first=diff)
            except Exception as e:  # noqa: BLE001
                emit(kind=kind, case=name, T=T, HQ=HQ, cfg=cand, error=(type(e).__name__ + ": " + str(e))[:300])


def sweep_selection(T, HQ) -> list:
    """The fastest launch config of each selection scoring kernel (block_scores_triton time) and of the
    top-k kernel (register tile x row splits), on iid inputs; returned for ``under``."""
    q, k, _, bias = synthetic_nosa_inputs(T, HQ, seed=2, smooth=0)
    cfg = NOSAConfig()
    layout = block_layout(1, T, None, cfg.block_size, q.device)
    kc, _ = compress(k, None, layout, cfg, q.dtype)
    space = {  # LSE: query heads per program (one compressed-key tile feeds HP x 64 rows), keys per step
        "lse": [dict(BW=bw, HP=hp, num_warps=nw, num_stages=ns) for hp, bw, nw, ns in
                ((1, 64, 4, 2), (2, 64, 4, 2), (2, 64, 8, 2), (4, 64, 8, 2), (2, 128, 8, 2), (4, 32, 8, 2),
                 (2, 64, 4, 3))],
        "block": [dict(NW=w, NT=t, num_warps=nw, num_stages=ns) for w, t, nw, ns in
                  ((256, 64, 8, 2), (256, 256, 8, 2), (256, 128, 8, 2), (256, 32, 8, 2), (128, 64, 8, 2),
                   (128, 64, 4, 2), (64, 64, 4, 2), (256, 64, 8, 1))],
    }
    chosen = []
    for kern, cands in space.items():
        best = None
        with under(chosen):
            for c in cands:
                try:
                    with overrides(SEL_CONFIG, **{kern: c}):
                        t = bench(lambda: block_scores_triton(q, kc, layout, cfg, covered=cfg.topk))[0]
                    emit(kind="sweep", kernel="sel_" + kern, cfg=c, T=T, HQ=HQ, ms=t)
                    if best is None or t < best[0]:
                        best = (t, c)
                except Exception as e:  # noqa: BLE001
                    emit(kind="sweep", kernel="sel_" + kern, cfg=c, error=(type(e).__name__ + ": " + str(e))[:300])
        if best:
            chosen.append((SEL_CONFIG, {kern: best[1]}))
    # top-k: elements per register tile (rows per step = TILE / width class) x programs per (KV block, KV head)
    # x warps per program (0: the default rule)
    with under(chosen):
        bq = block_scores_triton(q, kc, layout, cfg, covered=cfg.topk)
        _, ws = compress(k, bias, layout, cfg, q.dtype)
    best = None
    for tile in (256, 512, 1024, 2048):
        for splits in (1, 2, 4, 8, 16):
            for warps in (0, 1, 4):
                c = dict(TILE=tile, ROW_SPLITS=splits, WARPS=warps)
                with overrides(TOPK_CONFIG, cuda=c):
                    t = bench(lambda: select_from_block_scores(bq, ws, layout, cfg))[0]
                emit(kind="sweep", kernel="topk", cfg=c, T=T, HQ=HQ, ms=t)
                if best is None or t < best[0]:
                    best = (t, c)
    return chosen + [(TOPK_CONFIG, {"cuda": best[1]})]


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


def kernel_rows(T, HQ, dense_ms, args, t_start):
    """The default table's rows at one shape: P1 lists (ours, Flex), real NOSA selections (iid, smooth)."""
    cfg = NOSAConfig()
    pieces, sel, keys = p1_lists(T, seed=1)
    inputs = make_inputs(T, HQ)
    out = ours(T, HQ, sel, keys, dense_ms, "ours_p1_db", cfg, inputs)
    if not args.no_flex and time.time() - t_start < args.budget_s:
        flex(T, HQ, pieces, keys, dense_ms, inputs, out)
    del sel
    for smooth in (0, 1):
        q, k, v, bias = synthetic_nosa_inputs(T, HQ, seed=2, smooth=smooth)
        sel = select_blocks_triton(q, k, bias, cfg)
        t_sel = bench(lambda: select_blocks_triton(q, k, bias, cfg))[0]
        if smooth == 0:
            selection_breakdown(q, k, bias, cfg, t_sel)
        keys_n = useful_keys(sel, cfg.block_size)
        name = f"ours_nosa_{'smooth' if smooth else 'iid'}_db"
        ours(T, HQ, sel, keys_n, dense_ms, name, cfg, (q, k, v, bias), extra=dict(select_ms=t_sel))
        if args.tiles64:
            ours(T, HQ, sel, keys_n, dense_ms, name + "_tiles64", cfg, (q, k, v, bias), qt=cfg.block_size)
        del sel
    if args.packed:
        packed_documents(T, HQ)


def table():
    lines = ["| case | T | HQ | density | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd x ideal | bwd x ideal "
             "| notes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        if "fwd_ms" not in r:
            continue
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        notes = []
        for key in ("qt", "bwd_nodb_ms", "index_ms", "select_ms", "inflation", "bitmask_fill", "compile_s",
                    "max_abs_diff_vs_ours"):
            if r.get(key) is not None:
                notes.append(f"{key}={r[key]:.3g}" if isinstance(r[key], float) else f"{key}={r[key]}")
        lines.append(f"| {r['kind']} | {r['T']} | {r['HQ']} | {r['density']:.3f} | {f(r['fwd_ms'])} | "
                     f"{f(r['bwd_ms'])} | {f(r['fwd_tflops'], 0)} | {f(r['bwd_tflops'], 0)} | "
                     f"{f(r.get('fwd_x_ideal'))} | {f(r.get('bwd_x_ideal'))} | {' '.join(notes)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="32768x32,32768x16,16384x32,16384x16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel device times and the calls' host overhead at the first shape")
    ap.add_argument("--packed", action="store_true", help="1 / 8 / 64 documents per sample at every shape")
    ap.add_argument("--index-profile", action="store_true", help="only profile the index build at the first shape")
    ap.add_argument("--dkdv-sweep", action="store_true", help="only the dK/dV key-group sweep at every shape")
    ap.add_argument("--fwd-sweep", action="store_true",
                    help="only the forward / dQ launch-settings sweep at every shape")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="only query tiles of 64 / 128 / 32 rows (the KV group's heads x more or fewer tokens) "
                         "at every shape")
    ap.add_argument("--balance-sweep", action="store_true",
                    help="only the dK/dV piece length / partial-slot budget sweep at every shape")
    ap.add_argument("--selection", action="store_true",
                    help="only the selection: its stages on iid / smooth inputs against the P1 forward, at every shape")
    ap.add_argument("--sel-sweep", action="store_true",
                    help="with --selection: first pick the scoring and top-k kernels' launch settings")
    ap.add_argument("--tiles64", action="store_true", help="also the NOSA lists with 64-token tiles of one head")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining Flex runs past this")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, cmd=" ".join(sys.argv))
    emit(kind="meta", **meta)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.index_profile:
        profile_index(*shapes[0])
        index_host_check(*shapes[0])
        return
    dense_ms: dict = {}
    for T, HQ in shapes:
        dense(T, HQ, dense_ms)
    if args.dkdv_sweep or args.fwd_sweep or args.tile_sweep or args.balance_sweep:
        for T, HQ in shapes:
            if args.fwd_sweep:
                config_sweep("fwd_sweep", FWD_CANDIDATES, T, HQ, dense_ms)
            if args.tile_sweep:
                config_sweep("tile_sweep", TILE_CANDIDATES, T, HQ, dense_ms)
            if args.dkdv_sweep:
                config_sweep("dkdv_sweep", DKDV_CANDIDATES, T, HQ, dense_ms)
            if args.balance_sweep:
                config_sweep("balance_sweep", BALANCE_CANDIDATES, T, HQ, dense_ms)
        write_json(os.path.join(args.out, "attention_kernel_sweep.json"), dict(meta=meta, rows=ROWS), indent=1)
        return
    if args.selection:
        for T, HQ in shapes:
            selection_bench(T, HQ, dense_ms, args.sel_sweep)
            torch.cuda.empty_cache()
        meta["wall_s"] = round(time.time() - t_start, 1)
        write_json(os.path.join(args.out, "attention_selection.json"), dict(meta=meta, rows=ROWS), indent=1)
        return
    chosen = sweep(*shapes[0], dense_ms) if args.sweep else []
    with under(chosen):
        if args.profile:
            profile_kernels(*shapes[0])
            call_overhead(*shapes[0])
        for T, HQ in shapes:
            kernel_rows(T, HQ, dense_ms, args, t_start)
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    write_json(os.path.join(args.out, "attention_bench.json"), dict(meta=meta, rows=ROWS), indent=1)
    print(table())


if __name__ == "__main__":
    main()
