"""Weight-gradient GEMMs with and without accumulation into the fp32 main gradient (gradient accumulation fusion).

megatron-core's linear layers add each weight gradient to the fp32 ``main_grad`` of its parameter. Unfused, that
is a bf16 GEMM ``dy^T @ x`` written out and then added by a separate kernel; fused
(``runtime.megatron_compat.TorchWgradAccumulation``, what GPU runs with ``train.fusions`` use without Apex), one
GEMM with fp32 output reads and writes ``main_grad`` in its epilogue. Per shape this script times both (median of
``triton.testing.do_bench``) and checks both against an fp64 product. Shapes are ``OUTxIN`` of the weight;
the defaults are the 1B model's (fc1 11264x2048, fc2 2048x5632, QKV 2560x2048, output projection 2048x2048)
over the 32,768 tokens of a 16K step with 2 sequences. Needs CUDA (torch's fp32-output bf16 GEMM). Usage::

    python bench/wgrad_gemm.py --out DIR [--tokens 32768] [--shapes 11264x2048,2048x5632,2560x2048,2048x2048]

Writes ``DIR/wgrad_gemm.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eval.report import write_json  # noqa: E402

DEFAULT_SHAPES = "11264x2048,2048x5632,2560x2048,2048x2048"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"OUTxIN,..."`` -> ``[(out, in), ...]``; a clear error for anything else."""
    shapes = []
    for part in text.split(","):
        try:
            out_f, in_f = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: '{part}' is not OUTxIN (e.g. 2048x5632)") from None
        if out_f <= 0 or in_f <= 0:
            raise ValueError(f"--shapes: '{part}' has a dimension <= 0")
        shapes.append((out_f, in_f))
    return shapes


def unfused(x: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += dy^T @ x`` as two kernels: the GEMM in the inputs' dtype, then the fp32 add."""
    main_grad.add_(dy.t().matmul(x))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius-norm error of ``got`` relative to ``want`` (both promoted to fp64)."""
    return float((got.double() - want).norm() / want.norm())


def measure(out_f: int, in_f: int, tokens: int, seed: int = 0) -> dict:
    """Both paths on one ``[out_f, in_f]`` weight over ``tokens`` rows: ms per call and error against fp64."""
    from triton.testing import do_bench

    from runtime.megatron_compat import TorchWgradAccumulation

    fused = TorchWgradAccumulation.wgrad_gemm_accum_fp32
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=g)
    start = torch.randn(out_f, in_f, device="cuda", dtype=torch.float32, generator=g)
    want = start.double() + dy.double().t() @ x.double()
    errors = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        grad = start.clone()
        fn(x, dy, grad)
        errors[name] = relative_error(grad, want)
    grad = start.clone()  # timing accumulates into it: values grow, the work per call does not
    ms = {name: do_bench(lambda: fn(x, dy, grad), return_mode="median")
          for name, fn in (("unfused", unfused), ("fused", fused))}
    flops = 2.0 * tokens * out_f * in_f
    return {"weight": f"{out_f}x{in_f}", "tokens": tokens, "unfused_ms": round(ms["unfused"], 4),
            "fused_ms": round(ms["fused"], 4), "fused_tflops": round(flops / ms["fused"] / 1e9, 1),
            "unfused_rel_err": errors["unfused"], "fused_rel_err": errors["fused"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for wgrad_gemm.json")
    ap.add_argument("--tokens", type=int, default=32768, help="rows of x and dy (tokens of one step)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="weights as OUTxIN, comma separated")
    a = ap.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.tokens <= 0:
        print(f"error: --tokens={a.tokens} must be > 0", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench/wgrad_gemm.py needs a CUDA GPU (torch's fp32-output bf16 GEMM)", file=sys.stderr)
        return 2
    rows = []
    print("| weight | tokens | bf16 GEMM + fp32 add ms | fused ms | fused TFLOP/s | rel. error unfused / fused |")
    print("|---|---|---|---|---|---|")
    for out_f, in_f in shapes:
        r = measure(out_f, in_f, a.tokens)
        rows.append(r)
        print(f"| {r['weight']} | {r['tokens']} | {r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | {r['fused_tflops']} "
              f"| {r['unfused_rel_err']:.1e} / {r['fused_rel_err']:.1e} |", flush=True)
    write_json(Path(a.out) / "wgrad_gemm.json", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "cmd": " ".join(sys.argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
