"""Locality demo: a small random stack of NOSA attention layers, forward + backward, then a
token-by-token decode walk that reports gamma, cache hits and fetched blocks per layer and head.

    python -m nosa_layers.demo --out runs/demo/locality [--seq-len 8192] [--layers 2]

Inputs are random (no trained weights): ``A`` of the eviction head is drawn from U(0.5, 1.5)
instead of the training-time zeros, so that the query-agnostic ranking is not pure tie-breaking.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from nosa_layers.config import NOSAConfig, tiny_geometry
from nosa_layers.reference_layer import NOSAReferenceSelfAttention
from nosa_layers.locality import LocalityStats, format_locality_table, measure_locality


def build_stack(cfg: NOSAConfig, layers: int, hidden: int, heads: int, kv_heads: int, seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    stack = nn.ModuleList(NOSAReferenceSelfAttention(hidden, heads, kv_heads, cfg) for _ in range(layers))
    for layer in stack:
        if hasattr(layer.eviction, "A"):
            nn.init.uniform_(layer.eviction.A, 0.5, 1.5)
    return stack


def run_variant(cfg: NOSAConfig, args: argparse.Namespace) -> dict:
    stack = build_stack(cfg, args.layers, args.hidden, args.heads, args.kv_heads, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(1, args.seq_len, args.hidden, generator=gen, requires_grad=True)

    t0 = time.perf_counter()
    h, per_layer_inputs = x, []
    for layer in stack:
        q, k, _, ev = layer.project(h)
        per_layer_inputs.append((q.detach(), k.detach(), None if ev.score is None else ev.score.detach()))
        h = h + layer(h)
    h.square().mean().backward()
    fwd_bwd_s = time.perf_counter() - t0
    grad_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in stack.parameters())

    stats: dict[str, LocalityStats] = {}
    t0 = time.perf_counter()
    for i, (q, k, score) in enumerate(per_layer_inputs):
        stats[f"layer{i}"] = measure_locality(q, k, score, cfg, walk=args.walk)
        print(f"  [{cfg.eviction_head}] layer {i}: walked {args.seq_len} tokens "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    sparse_from = cfg.dense_len  # first step whose prefix exceeds the block budget
    summary = {name: s.summary() for name, s in stats.items()}
    every = torch.cat([s.gamma[..., 1:].flatten() for s in stats.values()])
    sparse = torch.cat([s.gamma[..., sparse_from:].flatten() for s in stats.values()])
    return {
        "eviction_head": cfg.eviction_head,
        "fwd_bwd_seconds": fwd_bwd_s,
        "grads_finite": bool(grad_ok),
        "gamma_mean": float(every.nanmean()),
        "gamma_min": float(every.nan_to_num(2.0).min()),
        "sparse_from_step": sparse_from,
        "gamma_mean_sparse": float(sparse.nanmean()) if sparse.numel() else None,
        "gamma_min_sparse": float(sparse.min()) if sparse.numel() else None,
        "bound_k_e_over_k": cfg.query_agnostic_blocks / cfg.topk if cfg.eviction_head != "none" else None,
        "per_layer": summary,
        "per_head": {name: s.per_head() for name, s in stats.items()},
        "table": format_locality_table(stats),
        "table_sparse": format_locality_table(stats, sparse_from),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo/locality"))
    p.add_argument("--seq-len", type=int, default=6144, help="tokens (sparse above topk*block_size)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--heads-variants", default="ed_dma,none", help="comma-separated eviction heads")
    p.add_argument("--walk", choices=("decode", "parallel"), default="decode")
    p.add_argument("--tiny", action="store_true", help="tiny geometry (block 16, kernel 8/4, topk 7)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {}
    for name in args.heads_variants.split(","):
        cfg = (tiny_geometry(topk=7, eviction_head=name) if args.tiny else NOSAConfig(eviction_head=name)).validate()
        print(f"NOSA locality demo: head={name} T={args.seq_len} layers={args.layers} "
              f"block={cfg.block_size} topk={cfg.topk} (dense up to {cfg.dense_len} tokens)", flush=True)
        results[name] = run_variant(cfg, args)
        print(f"all steps t >= 1:\n{results[name]['table']}", flush=True)
        print(f"sparse steps t >= {cfg.dense_len}:\n{results[name]['table_sparse']}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "locality.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    print("\nsummary (all layers and heads, steps t >= 1):")
    for name, r in results.items():
        bound = "" if r["bound_k_e_over_k"] is None else f"  bound k_e/k={r['bound_k_e_over_k']:.3f}"
        sparse = ("" if r["gamma_mean_sparse"] is None else
                  f" | sparse steps: mean={r['gamma_mean_sparse']:.4f} min={r['gamma_min_sparse']:.4f}")
        print(f"  {name:>7}: gamma mean={r['gamma_mean']:.4f} min={r['gamma_min']:.4f}{sparse}{bound}  "
              f"fwd+bwd {r['fwd_bwd_seconds']:.1f} s, grads finite={r['grads_finite']}")
    print(f"wrote {args.out / 'locality.json'}")
    return results


if __name__ == "__main__":
    main()
