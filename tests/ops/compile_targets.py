"""Compile every NOSA Triton kernel for the sm80 (A100 / A800) and sm90 (H100 / H200) targets with
the launch configuration each would get, without a GPU; prints one JSON line per kernel and target
(shared memory in bytes). Run by ``test_arch.py`` in a process without ``TRITON_INTERPRET``."""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nosa_layers.ops import attention_kernels as ak
from nosa_layers.ops import block_selection as bsel
from nosa_layers.ops import sparse_index as si
from nosa_layers.ops import topk
from nosa_layers.ops.attention_op import CONFIG, heads_per_program
from nosa_layers.ops.sparse_index import query_tile

FP32 = {"LSE", "Delta", "Bias", "WDK", "WDV", "WDB", "DB", "WS", "BQA"}
I32 = {"Blocks", "Count", "KStart", "InvPtr", "QStart", "PiecePtr", "PieceList", "SlotPtr", "InvCount"}
FLOATS = {"qk_scale", "sm_scale"}
INT_ARGS = {"T", "H", "K1", "K2", "NBW"}  # upper-case scalars


def signature(fn, const: dict, ptr: dict) -> dict:
    sig = {}
    for p in fn.params:
        n = p.name
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = ptr[n]
        elif n[0].isupper() and n not in INT_ARGS:
            sig[n] = "*fp32" if n in FP32 else "*i32" if n in I32 else "*bf16"
        else:
            sig[n] = "fp32" if n in FLOATS else "i32"
    return sig


def cases(arch: str, G: int):
    cfg = CONFIG[arch]
    BS, D, KS, ST, R, E = 64, 128, 32, 16, 4, 1
    qt, _ = query_tile(G, BS, cfg["tile"]["rows"])
    word = "*i64" if qt > 32 else "*i32"
    common = dict(HKV=2, G=G, QT=qt, BS=BS, D=D, HAS_BIAS=True)
    for name, fn in (("fwd", ak._fwd_kernel), ("dq", ak._bwd_dq_kernel), ("dkdv", ak._bwd_dkdv_kernel)):
        c = cfg[name]
        const = dict(common, HP=heads_per_program(G, qt, c["rows"]),
                     **({"KB": c["blocks"], "NEED_DB": True} if name == "dkdv" else {}))
        yield name, fn, const, {"Word": word}, c["num_warps"], c["num_stages"]
    kb = cfg["dkdv"]["blocks"]
    yield "dkdv_reduce", ak._dkdv_reduce_kernel, dict(HKV=2, N=kb * BS, D=D, NEED_DB=True), {}, 4, 3
    yield "delta", ak._bwd_delta_kernel, dict(BM=64, D=D), {}, 4, 3
    yield "pack_lists", si._pack_lists_kernel, dict(HKV=2, QT=qt, S=BS // qt, BS=BS, NBC=64), \
        {"Sel": "*u8", "Words": word, "FwdKs": "*i32", "FwdWord": word}, 4, 3
    yield "inv_count", si._inv_count_kernel, dict(HKV=2, S=BS // qt, BS=BS, KB=kb, CB=128), {"Words": word}, 4, 3
    yield "scan", si._scan_kernel, dict(CH=1024), {}, 4, 3
    yield "inv_fill", si._inv_fill_kernel, dict(HKV=2, S=BS // qt, QT=qt, BS=BS, KB=kb, CB=128), \
        {"Words": word, "InvQs": "*i32", "InvWord": word}, 4, 3
    yield "compress", bsel._compress_kernel, dict(HAS_SCORE=True, D=D, BS=BS, KS=KS, ST=ST, R=R), \
        {"S": "*fp32", "KC": "*bf16", "WS": "*fp32"}, 4, 3
    c = bsel.SEL_CONFIG["lse"]
    yield "sel_lse", bsel._sel_lse_kernel, dict(G=G, HP=bsel.lse_heads_per_program(G), BW=c["BW"], D=D, BS=BS,
                                                KS=KS, ST=ST, R=R), {}, c["num_warps"], c["num_stages"]
    c = bsel.SEL_CONFIG["block"]
    yield "sel_block", bsel._sel_block_kernel, dict(HKV=2, G=G, NBC=c["NW"] // R, D=D, BS=BS, KS=KS, ST=ST, R=R,
                                                    E=E, EP=1, INIT=1, LOCAL=16), {"Out": "*fp32"}, \
        c["num_warps"], c["num_stages"]
    for nbp in (64, 512):
        br, rs, warps = topk.launch_shape(nbp, BS, "cuda")
        yield f"topk_nb{nbp}", topk._select_kernel, dict(BR=br, NBP=nbp, NCLS=topk.width_classes(nbp, 64), RS=rs,
                                                          BS=BS, KS=KS, ST=ST, R=R, E=E, INIT=1, LOCAL=16,
                                                          EVICT=True), {"Out": "*u8"}, warps, 3


def main(G: int) -> None:
    for arch, cap in (("sm80", 80), ("sm90", 90)):
        for name, fn, const, ptr, warps, stages in cases(arch, G):
            k = triton.compile(ASTSource(fn, signature(fn, const, ptr), const), target=GPUTarget("cuda", cap, 32),
                               options=dict(num_warps=warps, num_stages=stages))
            print(json.dumps(dict(arch=arch, kernel=name, G=G, shared=k.metadata.shared)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
