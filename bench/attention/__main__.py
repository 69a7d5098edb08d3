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
import os
import sys
import time

import torch

from bench.attention.breakdown import call_overhead, index_host_check, packed_documents, profile_index
from bench.attention.breakdown import profile_kernels
from bench.attention.inputs import make_inputs, p1_lists, synthetic_nosa_inputs, useful_keys
from bench.attention.rows import ROWS, bench, dense, emit, flex, ours, table
from bench.attention.selection import selection_bench, selection_breakdown
from bench.attention.sweeps import (BALANCE_CANDIDATES, DKDV_CANDIDATES, FWD_CANDIDATES, TILE_CANDIDATES,
                                    config_sweep, sweep, under)
from nosa_layers import NOSAConfig
from nosa_layers.ops import select_blocks_triton
from runtime.outputs import write_json


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
