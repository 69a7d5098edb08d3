"""Sweeps of the attention kernels' launch settings: each candidate runs under ``launch.overrides`` (the
tables themselves stay as they are), timed on the P1 lists and real NOSA selections; ``sweep`` keeps the
fastest of each kernel for ``under``, ``config_sweep`` reports every candidate with its difference to the
first, ``sweep_selection`` does the same for the selection's scoring and top-k kernels."""

from __future__ import annotations

import contextlib

import torch

from bench.attention.inputs import DEV, D, index_for, make_inputs, p1_lists, synthetic_nosa_inputs, useful_keys
from bench.attention.rows import bench, emit
from nosa_layers import NOSAConfig
from nosa_layers.ops import select_blocks_triton, sparse_attention
from nosa_layers.ops.block_selection import block_scores_triton, compress
from nosa_layers.ops.launch import CONFIG, SEL_CONFIG, TOPK_CONFIG, arch, hopper_device, launch_config, overrides
from nosa_layers.ops.layout import block_layout
from nosa_layers.ops.topk import select_from_block_scores


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
# kernel (attention_sm90_dkdv: key blocks per group = consumer warpgroups, rows per step, ring slots)
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
