"""Timed rows of the attention benchmark: ``bench`` (median of ``do_bench``, L2 flushed), ``emit`` (one JSON
row printed and kept in ``ROWS``), the dense cuDNN SDPA row, ours on a selection, FlexAttention on the P1
lists, and the markdown table of the kernel rows."""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.attention.inputs import DEV, DT, HKV, D, index_for
from nosa_layers.ops import sparse_attention
from nosa_layers.ops.sparse_index import union_inflation


ROWS: list[dict] = []  # every row emitted by this process, in order (the JSON result of ``__main__``)


def bench(fn):
    ms = do_bench(fn, warmup=50, rep=300, quantiles=[0.5, 0.2, 0.8])
    return ms[0], ms[1], ms[2]


def emit(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


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
