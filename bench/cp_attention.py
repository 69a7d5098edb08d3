"""Context-parallel NOSA attention on one GPU, and the communication of all-gather context parallelism.

On one GPU (``--out DIR``; one process emulates the CP ranks), one layer of the 8B attention shape
(``--hq 32 --hkv 2``, D = 128, bf16) on synthetic smooth inputs (``bench.attention``), selection + index
+ forward + backward (with the bias gradient):

* ``equality``: at ``--equality-len`` (65536) and each ``--cp`` size, every rank's share (its two zigzag
  chunks of queries against all keys: ``select_blocks_triton`` / ``build_sparse_index`` with
  ``q_chunks``) against the whole-sequence call: selection rows, outputs and dQ rows, and dK / dV /
  d(bias) summed over the ranks (max |diff| / max |full|);
* ``timing``: the ranks' shares against the whole sequence at each length and CP size: the slowest
  rank's time and ``ratio = slowest share / (whole / CP)`` (target <= 1.15 for NOSA at CP = 4 and 8),
  by stage (selection, index, forward, backward);
* ``table``: at ``--lengths`` (64K, 128K): NOSA's whole-sequence times against dense causal cuDNN SDPA
  (K / V expanded to HQ heads), forward and backward.

``--comm`` (no GPU): bytes all-gathered (K, V and the eviction score, forward) and reduce-scattered (dK,
dV, d(score), backward) per layer and step by each rank, for the 8B shape at 64K and 128K in the
layouts of the recipes and others, and the time they take at NVLink (~450 GB/s per direction) and
InfiniBand (~50 GB/s per 400 Gb/s NIC) bandwidth; ring collectives: each rank sends and receives
``(CP - 1) / CP`` of the gathered tensor.

Usage: python -m bench.cp_attention --out DIR [--lengths 65536,131072] [--cp 4,8] [--equality-len 65536]
       python -m bench.cp_attention --out DIR --comm
Writes ``DIR/cp_attention.json`` (or ``DIR/cp_communication.json``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from runtime.outputs import write_json

D = 128
NVLINK_BPS = 450e9  # bytes per second per direction (H100 / H200 NVLink 4)
IB_BPS = 50e9  # one 400 Gb/s NIC per GPU
SHAPE_8B = dict(layers=32, hq=32, hkv=2, head_dim=128)
LAYOUTS = [(65536, 4, 2), (65536, 2, 4), (65536, 1, 8), (131072, 4, 4), (131072, 2, 8), (131072, 4, 8)]


# ----------------------------------------------------------------------------- communication on paper

def comm_row(seq: int, tp: int, cp: int, shape: dict = SHAPE_8B) -> dict:
    """Bytes one rank sends (= receives) per layer and step in all-gather CP, and their time.

    Per token and local KV head (``Hkv / TP``, at least 1: TP > Hkv replicates KV heads): K and V in bf16
    (2 x 2 x D bytes) and the eviction score / bias in fp32 (4 bytes; ED-DMA's bias is its score). The
    forward all-gathers them, the backward reduce-scatters their gradients (same sizes). A ring collective
    moves ``(CP - 1) / CP`` of the gathered tensor through each rank's link. Recompute gathers again in the
    backward: ``full`` re-runs the forward (K, V, score), ``selective`` (core attention) re-runs the
    attention (K, V, score) and its selection is computed before the checkpoint from gathered K and score.
    """
    kv_local = max(1, shape["hkv"] // tp)
    per_token = kv_local * (2 * 2 * shape["head_dim"] + 4)
    gathered = seq * per_token  # bytes of the gathered K, V, score on each rank
    wire = gathered * (cp - 1) / cp  # through each rank's link per collective
    score_and_k = seq * kv_local * (2 * shape["head_dim"] + 4) * (cp - 1) / cp
    per_layer = {"none": 2 * wire, "full": 3 * wire, "selective": 3 * wire + score_and_k}
    out = dict(seq=seq, tp=tp, cp=cp, gpus=tp * cp, kv_heads_per_rank=kv_local, bytes_per_token=per_token,
               gathered_mib_per_layer=gathered / 2**20, allgather_mib_per_layer=wire / 2**20,
               reduce_scatter_mib_per_layer=wire / 2**20)
    for mode, b in per_layer.items():
        out[f"step_mib_per_layer_{mode}"] = b / 2**20
        out[f"nvlink_us_per_layer_{mode}"] = b / NVLINK_BPS * 1e6
        out[f"ib_us_per_layer_{mode}"] = b / IB_BPS * 1e6
        out[f"nvlink_ms_per_step_{mode}"] = b * shape["layers"] / NVLINK_BPS * 1e3
        out[f"ib_ms_per_step_{mode}"] = b * shape["layers"] / IB_BPS * 1e3
    return out


def comm_table(rows: list[dict]) -> str:
    lines = ["| T | TP x CP | gathered K, V, score per layer | all-gather / reduce-scatter per rank and layer | "
             "per layer and step (full recompute) | NVLink | InfiniBand | 32 layers: NVLink / IB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq'] // 1024}K | {r['tp']} x {r['cp']} | {r['gathered_mib_per_layer']:.1f} MiB | "
                     f"{r['allgather_mib_per_layer']:.1f} MiB each | {r['step_mib_per_layer_full']:.1f} MiB | "
                     f"{r['nvlink_us_per_layer_full']:.0f} us | {r['ib_us_per_layer_full']:.0f} us | "
                     f"{r['nvlink_ms_per_step_full']:.1f} / {r['ib_ms_per_step_full']:.1f} ms |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- GPU measurements

def _ms(fn) -> float:
    """Median ms of ``fn`` (``triton.testing.do_bench`` on a GPU; one timed call elsewhere: the
    interpreter's smoke test)."""
    import torch

    if torch.cuda.is_available():
        from bench.device_timing import median_ms

        return median_ms(fn, warmup_ms=10, rep_ms=100)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def synthetic_inputs(T: int, hq: int, hkv: int, device, dtype, seed: int = 2):
    """q, k with a slowly varying shared component (smooth selections, ``bench.attention``), v, bias."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, T, hq, D, device=device, generator=g)
    k = torch.randn(1, T, hkv, D, device=device, generator=g)
    v = torch.randn(1, T, hkv, D, device=device, generator=g).to(dtype)
    bias = 0.1 * torch.randn(1, T, hkv, device=device, generator=g)
    walk = torch.randn(1, D, T // 256 + 2, device=device, generator=g)
    walk = F.interpolate(walk, size=T, mode="linear").permute(0, 2, 1)[:, :, None, :]
    return (q * 0.5 + 2.0 * walk).to(dtype), (k * 0.5 + 2.0 * walk).to(dtype), v, bias


def nosa_call(T: int, hq: int, inputs, cfg, chunks=None) -> dict:
    """Times of one NOSA call (the whole sequence, or one rank's ``chunks``): selection, index, forward,
    backward (with d(bias)); and its outputs and gradients."""
    import torch

    from nosa_layers.ops import build_sparse_index, select_blocks_triton, sparse_attention

    q, k, v, bias = inputs
    rows = None if chunks is None else chunks.rows(q.device)
    ql = q if rows is None else q[:, rows].contiguous()
    select = lambda: select_blocks_triton(ql, k, bias, cfg, q_chunks=chunks)  # noqa: E731
    sel = select()
    index = lambda: build_sparse_index(sel, cfg, T, None, num_q_heads=hq, row_budget=cfg.topk, q=ql,  # noqa: E731
                                       q_chunks=chunks)
    idx = index()
    xs = [x.detach().clone().requires_grad_(True) for x in (ql, k, v, bias)]
    fwd = lambda: sparse_attention(*xs[:3], idx, bias=xs[3])  # noqa: E731
    o = fwd()
    return dict(sel=sel, out=o, select_ms=_ms(select), index_ms=_ms(index), fwd_ms=_ms(fwd),
                backward=lambda dout: torch.autograd.grad(o, xs, dout, retain_graph=True))


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def measure(T: int, hq: int, hkv: int, cps: list[int], equality: bool, cfg=None, device="cuda",
            dtype=None) -> list[dict]:
    """The whole-sequence row and one ``cp_share`` row per CP size (``equality``: the chunk-by-chunk check)."""
    import torch

    from nosa_layers import NOSAConfig
    from nosa_layers.query_chunks import zigzag_chunks

    cfg = cfg or NOSAConfig()
    inputs = synthetic_inputs(T, hq, hkv, device, dtype or torch.bfloat16)
    full = nosa_call(T, hq, inputs, cfg)
    dout = torch.randn(full["out"].shape, device=device, dtype=full["out"].dtype,
                       generator=torch.Generator(device=device).manual_seed(7))
    grads = full["backward"](dout)
    full["bwd_ms"] = _ms(lambda: full["backward"](dout))
    full_ms = sum(full[f"{s}_ms"] for s in ("select", "index", "fwd", "bwd"))
    rows = [dict(kind="whole_sequence", T=T, HQ=hq, HKV=hkv, total_ms=full_ms,
                 **{f"{s}_ms": full[f"{s}_ms"] for s in ("select", "index", "fwd", "bwd")})]
    for cp in cps:
        shares, key_grads, worst = [], None, {}
        for r in range(cp):
            ch = zigzag_chunks(T, cp, r)
            part = nosa_call(T, hq, inputs, cfg, ch)
            rows_r = ch.rows(inputs[0].device)
            dout_r = dout[:, rows_r].contiguous()
            backward = part["backward"]
            g = backward(dout_r)
            part["bwd_ms"] = _ms(lambda: backward(dout_r))
            shares.append({s: part[f"{s}_ms"] for s in ("select", "index", "fwd", "bwd")})
            if equality:
                worst["selection_mismatches"] = worst.get("selection_mismatches", 0) + int(
                    (part["sel"] != full["sel"][:, :, rows_r]).sum())
                worst["out"] = max(worst.get("out", 0.0), _rel(part["out"], full["out"][:, rows_r]))
                worst["dq"] = max(worst.get("dq", 0.0), _rel(g[0], grads[0][:, rows_r]))
                key_grads = [x.float() for x in g[1:]] if key_grads is None else \
                    [a + x.float() for a, x in zip(key_grads, g[1:])]
            del part, g
        if equality:
            for name, a, b in zip(("dk", "dv", "dbias"), key_grads, grads[1:]):
                worst[name] = _rel(a, b)
        totals = [sum(s.values()) for s in shares]
        slow = max(range(cp), key=lambda i: totals[i])
        rows.append(dict(kind="cp_share", T=T, HQ=hq, HKV=hkv, cp=cp, slowest_rank=slow, slowest_ms=totals[slow],
                         mean_ms=sum(totals) / cp, whole_over_cp_ms=full_ms / cp,
                         ratio=totals[slow] / (full_ms / cp), slowest_by_stage=shares[slow],
                         equality=worst if equality else None))
        print(rows[-1], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def dense_row(T: int, hq: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, hq, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        fwd = _ms(f)
        o = f()
        bwd = _ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return dict(kind="dense_cudnn", T=T, HQ=hq, fwd_ms=fwd, bwd_ms=bwd, total_ms=fwd + bwd)


def gpu_table(rows: list[dict]) -> str:
    lines = ["| T | attention | selection ms | index ms | forward ms | backward ms | total ms | vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    dense = {r["T"]: r for r in rows if r["kind"] == "dense_cudnn"}
    for r in rows:
        if r["kind"] == "whole_sequence":
            d = dense.get(r["T"])
            lines.append(f"| {r['T'] // 1024}K | NOSA | {r['select_ms']:.2f} | {r['index_ms']:.2f} | {r['fwd_ms']:.2f} "
                         f"| {r['bwd_ms']:.2f} | {r['total_ms']:.2f} | "
                         f"{(d['total_ms'] / r['total_ms']) if d else float('nan'):.2f}x faster |")
        elif r["kind"] == "dense_cudnn":
            lines.append(f"| {r['T'] // 1024}K | dense cuDNN | - | - | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
                         f"{r['total_ms']:.2f} | 1 |")
    lines += ["", "| T | CP | slowest rank ms | whole / CP ms | ratio (target <= 1.15) |", "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "cp_share":
            lines.append(f"| {r['T'] // 1024}K | {r['cp']} | {r['slowest_ms']:.2f} | {r['whole_over_cp_ms']:.2f} | "
                         f"{r['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--comm", action="store_true", help="only the communication on paper (no GPU)")
    ap.add_argument("--lengths", default="65536,131072")
    ap.add_argument("--cp", default="4,8", help="context-parallel sizes emulated on the GPU")
    ap.add_argument("--equality-len", type=int, default=65536, help="length of the chunk-by-chunk equality check")
    ap.add_argument("--hq", type=int, default=SHAPE_8B["hq"])
    ap.add_argument("--hkv", type=int, default=SHAPE_8B["hkv"])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.comm:
        rows = [comm_row(*lay) for lay in LAYOUTS]
        write_json(os.path.join(args.out, "cp_communication.json"),
                   dict(shape=SHAPE_8B, nvlink_bytes_per_s=NVLINK_BPS, ib_bytes_per_s=IB_BPS, rows=rows))
        print(comm_table(rows))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/cp_attention.py: the attention measurements need a CUDA GPU (--comm runs without one)",
              file=sys.stderr)
        return 2
    t0 = time.time()
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        rows.append(dense_row(T, args.hq))
        rows += measure(T, args.hq, args.hkv, [int(c) for c in args.cp.split(",")], T == args.equality_len)
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cmd=" ".join(sys.argv),
                wall_s=round(time.time() - t0, 1))
    write_json(os.path.join(args.out, "cp_attention.json"), dict(meta=meta, rows=rows))
    print(gpu_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
