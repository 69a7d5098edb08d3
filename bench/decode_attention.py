"""Decode attention of the exported model's block KV cache: the Triton kernel that reads the selected
blocks in place (``checkpoints_convert/hf_modeling/nosa_decode_attn.py``) against the PyTorch path it
replaces (gather the blocks into new tensors, fp32 matmuls, the math of ``attend``), one layer.

Shapes: the 1B model's attention (2 KV heads, 8 query heads each, head dim 128), ``topk`` = 64
selected 64-token blocks per (sequence, KV head), random selections of a 16K-token cache per
sequence, bias on; batches 1, 15 and 48 (the GPU-resident and offloaded largest batches at 16K).
Every launch setting is checked against the PyTorch result (max abs difference, fp32 output) and
timed with CUDA events (median of 50 after 10 warm-up calls). Also the fp32 kernel (IEEE products).

Usage: python bench/decode_attention.py --out DIR [--batches 1,15,48]
Writes ``DIR/decode_attention.json`` (temp name, then rename) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checkpoints_convert.hf_modeling.nosa_decode_attn import decode_attention  # noqa: E402

HKV, G, D, BS, K, NB = 2, 8, 128, 64, 64, 256  # 16K tokens per sequence
CONFIGS = [(8, 4), (4, 4), (16, 4), (8, 8), (4, 2)]  # (blocks per program, warps)


def case(B: int, dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    on = {"device": "cuda"}
    pool_k = torch.randn(B * HKV * NB, BS, D, generator=g, **on).to(dtype)
    pool_v = torch.randn(B * HKV * NB, BS, D, generator=g, **on).to(dtype)
    q = torch.randn(B, HKV, G, D, generator=g, **on).to(dtype)
    sel = torch.rand(B * HKV, NB, generator=g, **on).argsort(-1)[:, :K].view(B, HKV, K)
    rows = torch.arange(B * HKV, **on).view(B, HKV, 1) * NB + sel
    ok = torch.ones(B, HKV, K, dtype=torch.bool, **on)
    pos = torch.full((B,), NB * BS - 1, **on)
    bias = torch.randn(B, HKV, NB * BS, generator=g, **on)
    return q, pool_k, pool_v, rows, sel, ok, pos, bias


def torch_path(q, pool_k, pool_v, rows, sel, ok, pos, bias, scale):
    """What the cache runs without the kernel: gathered copies, fp32 matmuls (``attend``)."""
    B = q.shape[0]
    kb, vb = pool_k[rows].view(B, HKV, K * BS, D), pool_v[rows].view(B, HKV, K * BS, D)
    tok = (sel[..., None] * BS + torch.arange(BS, device=q.device)).view(B, HKV, K * BS)
    allowed = ok[..., None].expand(B, HKV, K, BS).reshape(B, HKV, K * BS) & (tok <= pos[:, None, None])
    b = bias.view(B, HKV, NB, BS)[torch.arange(B, device=q.device)[:, None, None],
                                 torch.arange(HKV, device=q.device)[None, :, None], sel].view(B, HKV, K * BS)
    logits = torch.matmul(q.float(), kb.float().transpose(-1, -2)) * scale + b[:, :, None, :]
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), vb.float())


def timed(fn, n: int = 50, warm: int = 10) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(B: int, dtype) -> list[dict]:
    """The PyTorch path and every launch setting (bf16; the default one in fp32) at batch ``B``."""
    scale = D ** -0.5
    args = case(B, dtype)
    want = torch_path(*args, scale)
    selected_bytes = 2 * B * HKV * K * BS * D * args[1].element_size()
    base = {"batch": B, "dtype": str(dtype).replace("torch.", "")}
    ms = timed(lambda: torch_path(*args, scale))
    rows = [{**base, "path": "torch (gather + fp32 matmuls)", "ms": round(ms, 4),
             "gb_per_s": round(selected_bytes / ms / 1e6, 1), "max_abs_diff": 0.0}]
    bias_rows = args[7].view(-1, BS)  # the kernel reads the bias at its blocks' pool rows
    for per, warps in CONFIGS if dtype == torch.bfloat16 else CONFIGS[:1]:
        got = decode_attention(*args[:7], scale, bias_rows, per_prog=per, num_warps=warps)
        ms = timed(lambda: decode_attention(*args[:7], scale, bias_rows, per_prog=per, num_warps=warps))
        rows.append({**base, "path": f"kernel per_prog={per} warps={warps}", "ms": round(ms, 4),
                     "gb_per_s": round(selected_bytes / ms / 1e6, 1),
                     "max_abs_diff": float((got - want).abs().max())})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for decode_attention.json")
    p.add_argument("--batches", default="1,15,48")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(x) for x in a.batches.split(",")]
    rows = []
    for B in batches:
        for dtype in (torch.bfloat16, torch.float32):
            rows += measure(B, dtype)
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": {"kv_heads": HKV, "group": G, "head_dim": D, "block": BS, "topk": K, "blocks_per_seq": NB}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "decode_attention.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, out / "decode_attention.json")
    print(f"{meta['device']}, torch {meta['torch']}; GB/s = selected K/V bytes / time\n")
    print("| batch | dtype | path | ms | GB/s | max abs diff vs torch |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['dtype']} | {r['path']} | {r['ms']} | {r['gb_per_s']} | {r['max_abs_diff']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
