"""Benchmark of the value-gated eviction score (ED-DMA / DMA / S-DMA): the fused Triton kernels
(``nosa_layers.ops.gated_score``) against the PyTorch reference (``nosa_layers.eviction.value_gated_score``).

One GPU, identical inputs: ``v [1, T, Hkv, D]`` bf16 (a strided view of a fused QKV buffer, as the
attention layer hands it over), the head's parameters in bf16 (as ``Float16Module`` keeps them).
Per shape and implementation: forward ms, forward + backward ms (median of
``triton.testing.do_bench``; at these sizes mostly the host's launch path), CUDA kernels launched
per forward + backward and their summed GPU time (torch.profiler, mean of 5 calls), and
the largest difference of the score and the gradients from the fp32 reference.

Usage: python bench/eviction_score.py --out DIR [--shapes 16384x8x64,32768x8x64]
Writes ``DIR/eviction_score.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triton.testing import do_bench  # noqa: E402

from nosa_layers.eviction import value_gated_score  # noqa: E402
from nosa_layers.ops.gated_score import fused_gated_score, supports_gated_score  # noqa: E402
from train.profiling import device_ms_per_call  # noqa: E402

DT = torch.bfloat16


def inputs(T: int, hkv: int, d: int, seed: int = 0):
    """``v`` as a view of a ``[1, T, 3 * Hkv, D]`` buffer, the parameters (bf16, requiring grad) and
    an upstream gradient of the score."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(1, T, 3 * hkv, d, device="cuda", dtype=DT, generator=g)
    v = qkv[:, :, 2 * hkv:].detach().requires_grad_()
    w = (torch.randn(hkv, hkv * d, device="cuda", generator=g) / (hkv * d) ** 0.5).to(DT).requires_grad_()
    b = (0.1 * torch.randn(hkv, device="cuda", generator=g)).to(DT).requires_grad_()
    a = torch.rand(hkv, device="cuda", generator=g).to(DT).requires_grad_()
    gs = torch.randn(1, T, hkv, device="cuda", generator=g)
    return (v, w, b, a), gs


def fwd_bwd(op, args, gs):
    for t in args:
        t.grad = None
    s = op(*args)
    s.backward(gs)
    return s, [t.grad for t in args]


def measure(T: int, hkv: int, d: int) -> list[dict]:
    args, gs = inputs(T, hkv, d)
    assert supports_gated_score(args[0]), "the fused kernels do not cover this shape"
    exact = [t.detach().float().requires_grad_() for t in args]
    s_ref, g_ref = fwd_bwd(value_gated_score, exact, gs)
    rows = []
    for name, op in (("reference", value_gated_score), ("fused", fused_gated_score)):
        s, grads = fwd_bwd(op, args, gs)
        err = {"score": (s - s_ref).abs().max().item() / s_ref.abs().max().item()}
        for key, got, want in zip(("dv", "dw", "db", "dA"), grads, g_ref):
            err[key] = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        with torch.no_grad():
            fwd_ms = do_bench(lambda: op(*args))
        both_ms = do_bench(lambda: fwd_bwd(op, args, gs))
        kernels = device_ms_per_call(lambda: fwd_bwd(op, args, gs))
        n_kernels, gpu_us = sum(c for _, c in kernels.values()), 1e3 * sum(ms for ms, _ in kernels.values())
        rows.append({"T": T, "Hkv": hkv, "D": d, "impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
                     "kernels_fwd_bwd": n_kernels, "kernel_us_fwd_bwd": gpu_us, "max_rel_err_vs_fp32": err})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--shapes", default="16384x8x64,32768x8x64,16384x2x128", help="TxHkvxD, comma separated")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/eviction_score.py needs a CUDA GPU")
    rows = []
    for shape in a.shapes.split(","):
        T, hkv, d = (int(x) for x in shape.split("x"))
        rows += measure(T, hkv, d)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    os.makedirs(a.out, exist_ok=True)
    tmp = os.path.join(a.out, "eviction_score.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    os.replace(tmp, os.path.join(a.out, "eviction_score.json"))
    print("\n| T | Hkv | D | impl | fwd ms | fwd+bwd ms | kernels fwd+bwd | their GPU us "
          "| max rel. err (score, dv, dW) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = r["max_rel_err_vs_fp32"]
        print(f"| {r['T']} | {r['Hkv']} | {r['D']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
              f"{r['kernels_fwd_bwd']} | {r['kernel_us_fwd_bwd']:.1f} | "
              f"{e['score']:.1e}, {e['dv']:.1e}, {e['dw']:.1e} |")


if __name__ == "__main__":
    main()
