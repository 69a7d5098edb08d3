"""Host time of one NOSA layer's attention path at a training shape, part by part, against its GPU time.

A training step is host-bound where the host needs longer to launch a part's kernels than the GPU
needs to run them: the GPU then idles (a micro-batch's forward right after the optimizer's host sync
has nothing queued ahead of it). This measures, for each part of one NOSA layer's attention (the
eviction head, the block selection, the index build, the sparse attention, their backward) and for
the whole forward and backward of that path:

* ``host_us``: host time per call of ``n`` calls back to back with the GPU kept busy (``torch.cuda._sleep``
  queued first, so no launch waits for the GPU): what the call costs the host inside a step;
  ``host_us_alone``: the median of single calls right after a synchronisation (a cold call);
* ``gpu_ms``: GPU time per call of back-to-back calls (events around ``n`` calls queued behind a sleep);
* ``launches``: kernel launches, copies and fills per call (torch.profiler's CUDA runtime / driver
  calls);
* ``host_top``: the Python functions that hold its host time (cProfile own time, us per call; cProfile
  slows Python down, so these are shares, not times).

A part whose ``host_us`` exceeds its ``gpu_ms`` is one the GPU waits for whenever nothing is queued
ahead of it. Calibration rows: one launch of an empty Triton kernel with 1 and with 24 runtime
arguments, ``torch.empty`` and a small in-place torch op.

Usage (one CUDA GPU)::

    python -m bench.probes.layer_host --out DIR [--seq 16384] [--heads 16] [--kv-heads 2] [--docs 1] [--n 50]

Writes ``DIR/layer_host.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from bench.host_timing import gpu_ms_back_to_back, host_top, host_us_alone, host_us_back_to_back, run_calls
from runtime.outputs import write_json
from nosa_layers import NOSAConfig, prepare_selection
from nosa_layers.ops import build_sparse_index, select_blocks_triton, sparse_attention
from nosa_layers.ops.gated_score import fused_gated_score
from nosa_layers.ops.layout import remember_host_values
from train.host_time import LAUNCH_PREFIXES


@triton.jit
def _noop1(X):
    pass


@triton.jit
def _noop24(X0, X1, X2, X3, X4, X5, X6, X7, X8, X9, X10, X11,
            i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11):
    pass


def launches(fn, setup=None, batch=None, n: int = 5) -> float:
    """Kernel launches, copies and fills per call (CUDA runtime / driver calls, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    args = [setup() for _ in range(n)] if setup is not None else [None] * n
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_calls(fn, setup, batch, args)
        torch.cuda.synchronize()
    count = sum(1 for e in prof.events() if e.name.startswith(LAUNCH_PREFIXES))
    return round(count / n, 1)


def layer_inputs(T: int, HQ: int, HKV: int, D: int, docs: int, seed: int = 0):
    """Post-RoPE ``q, k, v`` (bf16, leaves), the eviction head's ``weight, A`` and ``cu_seqlens`` of
    ``docs`` equal documents (handed over to the layout cache as the trainer does), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 0.02 * torch.randn(HKV, HKV * D, device="cuda", generator=g)
    A = torch.full((HKV,), 0.5, device="cuda")
    bounds = [round(i * T / docs) for i in range(docs + 1)]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    remember_host_values(cu, bounds)
    leaves = tuple(x.requires_grad_(True) for x in (q, k, v, w, A))
    return leaves, cu


def parts(T: int, HQ: int, HKV: int, D: int, docs: int) -> dict:
    """``{name: (fn, setup, batch)}``: the calls measured (``setup`` builds what a backward consumes,
    ``batch`` runs many of them as one engine run, as a training step's backward does)."""
    cfg = NOSAConfig()
    (q, k, v, w, A), cu = layer_inputs(T, HQ, HKV, D, docs)
    do = torch.randn_like(q)
    with torch.no_grad():
        score = fused_gated_score(v, w, None, A)
        prepared = prepare_selection(q, k, score, cfg, cu, backend="triton")

    def forward(_=None):
        s = fused_gated_score(v, w, None, A)
        prep = prepare_selection(q, k, s, cfg, cu, backend="triton")
        return sparse_attention(q, k, v, prep.index, bias=s)

    def score_graph():
        return fused_gated_score(v, w, None, A)

    def attention_graph():
        return sparse_attention(q, k, v, prepared.index, bias=score.detach().requires_grad_(True))

    x0 = torch.zeros(1, device="cuda")
    p0 = torch.zeros(16, device="cuda")
    def backward_all(grad):
        return lambda outs: torch.autograd.backward(outs, [grad(o) for o in outs])  # one engine run

    ones = torch.ones_like
    rows = {
        "calibration: Triton launch, 1 argument": (lambda: _noop1[(1,)](x0), None),
        "calibration: Triton launch, 24 arguments": (lambda: _noop24[(1,)](*([p0] * 12), *range(3, 15)), None),
        "calibration: torch.empty (1 MiB)": (lambda: torch.empty(1 << 18, device="cuda"), None),
        "calibration: small torch op (add_)": (lambda: x0.add_(1.0), None),
        "eviction head forward": (lambda: fused_gated_score(v, w, None, A), None),
        "selection (select_blocks)": (lambda: select_blocks_triton(q.detach(), k.detach(), score, cfg, cu), None),
        "index build": (lambda: build_sparse_index(prepared.selected, cfg, T, cu, num_q_heads=HQ,
                                                   row_budget=cfg.topk, q=q), None),
        "attention forward": (lambda: sparse_attention(q, k, v, prepared.index, bias=score), None),
        "attention backward": (lambda o: torch.autograd.grad(o, (q, k, v), do), attention_graph,
                               backward_all(lambda o: do)),
        "eviction head backward": (lambda s: torch.autograd.grad(s, (v, w, A), ones(s)), score_graph,
                                   backward_all(ones)),
        "NOSA path forward (head + selection + index + attention)": (forward, None),
        "NOSA path backward": (lambda o: torch.autograd.grad(o, (q, k, v, w, A), do), forward,
                               backward_all(lambda o: do)),
    }
    return {name: (r + (None,))[:3] for name, r in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--docs", type=int, default=1, help="equal documents packed in the sequence")
    ap.add_argument("--n", type=int, default=50, help="calls per measurement")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: host time against GPU time needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (fn, setup, batch) in parts(a.seq, a.heads, a.kv_heads, a.head_dim, a.docs).items():
        for _ in range(3):  # compile and warm up
            fn(setup()) if setup is not None else fn()
        row = {"part": name, "host_us": host_us_back_to_back(fn, a.n, setup, batch),
               "host_us_alone": host_us_alone(fn, 15, setup), "gpu_ms": gpu_ms_back_to_back(fn, a.n, setup, batch),
               "launches": launches(fn, setup, batch), "host_top": host_top(fn, a.n, setup, batch, top=14)}
        rows.append(row)
        print(f"{name:58s} host {row['host_us']:8.1f} us (alone {row['host_us_alone']:7.1f})  "
              f"GPU {row['gpu_ms']:8.4f} ms  launches {row['launches']:5.1f}", flush=True)
    result = {"seq": a.seq, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "docs": a.docs,
              "n": a.n, "rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": sys.version.split()[0]}
    write_json(out / "layer_host.json", result)
    for r in rows:
        if not r["part"].startswith("calibration"):
            print(f"\n{r['part']}: cProfile own time, us per call")
            for k, us in list(r["host_top"].items())[:10]:
                print(f"  {us:8.1f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
