"""Imports a reference-format checkpoint with ``from_hf`` (reference geometry, and a tiny geometry
override) and records the Megatron forward (TP = PP = 1, reference attention, fp32) of each import:
the megatron-core half of tests/convert/test_reference_format.py, run in a subprocess."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

lean_megatron_import()  # before anything imports megatron-core

from checkpoints_convert.common import read_model_config
from checkpoints_convert.from_hf import main as from_hf
from checkpoints_convert.megatron_io import megatron_logits
from checkpoints_convert.verify import main as verify

MUP = "scale_emb=12,scale_depth=1.4,dim_model_base=16"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny-geometry", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    tokens = torch.load(out / "tokens.pt")
    results = {}
    runs = (("reference", []), ("tiny", ["--geometry", args.tiny_geometry]),
            ("mup", ["--mup", "unfold", "--mup-constants", MUP]))
    for name, extra in runs:
        t0 = time.time()
        rc = from_hf(["--hf", args.ref, "--out", str(out / name), *extra])
        if rc:
            sys.exit(rc)
        if name not in tokens:
            continue
        ckpt = out / name / "iter_0000000"
        model, attn, _ = read_model_config(ckpt)
        results[name] = megatron_logits(ckpt, model, attn, tokens[name])
        print(f"{name}: import + Megatron forward {time.time() - t0:.1f}s", flush=True)
    torch.save(results, out / "megatron_logits.pt")
    # verify on the source itself: tensors bitwise through Megatron, Megatron vs shipped-code logits, decode
    sys.exit(verify(["--hf", args.ref, "--ckpt", str(out / "reference"), "--seq-len", "300", "--random", "1",
                     "--decode-steps", "4", "--json", str(out / "verify.json")]))


if __name__ == "__main__":
    main()
