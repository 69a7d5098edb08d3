"""Compile every NOSA Triton kernel for the sm80 (A100 / A800) and sm90 (H100 / H200) targets with
the launch configuration each would get, without a GPU, and the hand-scheduled Gluon kernels
(``attention_sm90_fwd_dq``, ``attention_sm90_pairs``, ``attention_sm90_dkdv``, with the descriptors of
``attention_sm90``) for sm90; prints one JSON line per kernel and target
(shared memory in bytes).
Arguments get the specialisation a real launch gives them (pointers and strides that are multiples of
16 marked so, unit strides constant), so loads vectorise and pipeline as on the GPU and the shared
memory is what the GPU would allocate. Arguments: KV group sizes (every kernel at the first, the kernels
that depend on the group at the others). Run by ``test_arch.py`` in a process without
``TRITON_INTERPRET``."""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from nosa_layers.ops import attention_kernels as ak
from nosa_layers.ops import block_selection as bsel
from nosa_layers.ops import sparse_index as si
from nosa_layers.ops import attention_sm90, attention_sm90_dkdv, attention_sm90_fwd_dq, attention_sm90_pairs
from nosa_layers.ops import gated_score, rms_norm, rope, topk
from nosa_layers.ops._common import padded_heads
from nosa_layers.ops.attention_op import heads_per_program
from nosa_layers.ops.launch import CONFIG, SEL_CONFIG, triton_settings
from nosa_layers.ops.sparse_index import query_tile

FP32 = {"LSE", "Delta", "Bias", "WDK", "WDV", "WDB", "DB", "WS", "BQA"}
I32 = {"Blocks", "Count", "KStart", "InvPtr", "QStart", "PiecePtr", "PieceList", "SlotPtr", "InvCount",
       "QTiles", "QRow", "QRange", "Live"}
FLOATS = {"qk_scale", "sm_scale", "eps"}
INT_ARGS = {"T", "H", "N", "K1", "K2", "NBW", "B"}  # upper-case scalars
UNIT = {"s_bh", "s_db_h"}  # strides of 1 in a real launch (the bias / db head stride): constants
# scalars that are not multiples of 16 in a real launch (counts, the bias / db token stride = Hkv)
NOT_DIV16 = {"s_bt", "s_db_t", "n_tiles", "cap", "n_lists", "chunk", "T", "H", "N", "NBW", "K1", "K2",
             "rows_per_program", "B", "s_st", "s_zt", "s_gt", "s_gh", "n_parts"}


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


def specialise(fn, const: dict, ptr: dict):
    """(signature, constants, attributes) of a real launch: unit strides constant, pointers and the
    other integer arguments marked divisible by 16 (Triton's runtime specialisation)."""
    const = dict(const, **{p.name: 1 for p in fn.params if p.name in UNIT and p.name not in const})
    if any(p.name == "SUBSET" for p in fn.params):  # the whole-row launch (query chunks: a variant of it)
        const.setdefault("SUBSET", False)
    sig = signature(fn, const, ptr)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name].startswith("*") or (sig[p.name] == "i32" and p.name not in NOT_DIV16)}
    return sig, const, attrs


def kv_descriptor_type() -> str:
    """Signature of a K/V TMA descriptor argument (``attention_sm90.kv_descriptor``, D = 128)."""
    return mangle_type(attention_sm90.kv_descriptor(torch.empty(1, 256, 2, 128, dtype=torch.bfloat16), 64))


def cases(arch: str, G: int):
    cfg = triton_settings(CONFIG[arch])  # the Triton kernels with the settings they run with
    BS, D, KS, ST, R, E = 64, 128, 32, 16, 4, 1
    qt, _ = query_tile(G, BS, cfg["tile"]["rows"])
    word = "*i64" if qt > 32 else "*i32"
    common = dict(HKV=2, G=G, QT=qt, BS=BS, D=D, HAS_BIAS=True)
    for name, fn in (("fwd", ak._fwd_kernel), ("dq", ak._bwd_dq_kernel), ("dkdv", ak._bwd_dkdv_kernel)):
        c = cfg[name]
        hp = heads_per_program(G, qt, c["rows"])
        const = dict(common, HP=hp, HPP=padded_heads(hp),
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
    c = SEL_CONFIG["lse"]
    yield "sel_lse", bsel._sel_lse_kernel, dict(G=G, HP=bsel.lse_heads_per_program(G), BW=c["BW"], D=D, BS=BS,
                                                KS=KS, ST=ST, R=R), {}, c["num_warps"], c["num_stages"]
    c = SEL_CONFIG["block"]
    yield "sel_block", bsel._sel_block_kernel, dict(G=G, NBC=c["NW"] // R, NBT=c["NT"] // R, D=D, BS=BS, KS=KS, ST=ST,
                                                    R=R, E=E, EP=1, INIT=1, LOCAL=16), {"Out": "*fp32"}, \
        c["num_warps"], c["num_stages"]
    for nbp in (64, 512):
        br, rs, warps = topk.launch_shape(nbp, BS, "cuda")
        yield f"topk_nb{nbp}", topk._select_kernel, dict(BR=br, NBP=nbp, NCLS=topk.width_classes(nbp, 64), RS=rs,
                                                          BS=BS, KS=KS, ST=ST, R=R, E=E, INIT=1, LOCAL=16,
                                                          EVICT=True), {"Out": "*u8"}, warps, 3
    for hidden in (2048, 4096):  # the fused RMSNorm of the 1B and 8B shapes
        bh, warps = triton.next_power_of_2(hidden), rms_norm._num_warps(hidden)
        yield f"rms_norm_fwd_h{hidden}", rms_norm._rms_norm_fwd_kernel, dict(BH=bh), {"RSTD": "*fp32"}, warps, 3
        yield f"rms_norm_bwd_h{hidden}", rms_norm._rms_norm_bwd_kernel, dict(BH=bh), \
            {"RSTD": "*fp32", "DWP": "*fp32"}, warps, 3
    for hkv in (2, 8):  # the fused eviction score of the 1B (2 KV heads) and 8B-like (8) shapes, head dim 128
        f32 = {"S": "*fp32", "Z": "*fp32", "G": "*fp32", "P": "*fp32", "DB": "*bf16"}
        common = dict(HKV=hkv, HP=triton.next_power_of_2(hkv), D=D, ROWS=gated_score.rows_per_program(D))
        yield f"gated_score_h{hkv}_fwd", gated_score._gated_score_fwd_kernel, \
            dict(common, HAS_BIAS=False, COPY_V=True, LIBDEVICE=True), f32, 4, 3
        yield f"gated_score_h{hkv}_bwd", gated_score._gated_score_bwd_kernel, \
            dict(common, NEED_DV=True, LIBDEVICE=True), f32, 4, 3
        yield f"gated_score_h{hkv}_reduce", gated_score._partials_reduce_kernel, \
            dict(HKV=hkv, D=D, HAS_BIAS=False, COLS=256), f32, 4, 3
    for heads in (2, 16, 32):  # the fused RoPE of k (2 KV heads) and q (16 / 32 heads), head dim 128
        for sign, has_pos in ((1, True), (-1, False)):
            yield f"rope_h{heads}_{'fwd' if sign == 1 else 'bwd'}", rope._rope_kernel, \
                dict(SIGN=sign, HAS_POS=has_pos, HALF=64, BH=heads), {"POS": "*i64"}, 4, 3


def gluon_cases(G: int):
    """The Gluon kernels with sm90's launch settings (whatever each kernel's ``impl``)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    cfg = CONFIG["sm90"]
    qt, _ = query_tile(G, 64, cfg["tile"]["rows"])
    desc = kv_descriptor_type()
    ptr = {"k_desc": desc, "v_desc": desc, "Word": "*i64" if qt > 32 else "*i32"}
    fwd_dq = attention_sm90_fwd_dq
    for name, fn in (("fwd", fwd_dq._fwd_kernel_sm90), ("dq", fwd_dq._bwd_dq_kernel_sm90)):
        c = cfg[name]
        hp = heads_per_program(G, qt, c["rows"])
        const = dict(HKV=2, G=G, HP=hp, HPP=padded_heads(hp), QT=qt, BS=64, D=128, HAS_BIAS=True,
                     STAGES=c["num_stages"], IN_REGS=c["regs"], num_warps=4)
        yield f"{name}_sm90", GluonASTSource, fn, const, ptr, 4, 1
    hp = heads_per_program(G, qt, cfg["fwd"]["rows"])
    const = dict(HKV=2, G=G, HP=hp, HPP=padded_heads(hp), QT=qt, BS=64, D=128, HAS_BIAS=True,
                 num_warps=4)  # the forward over pairs of list entries (``keys_per_step = 128``)
    yield "fwd_pairs_sm90", GluonASTSource, attention_sm90_pairs._fwd_kernel_sm90_pairs, const, ptr, 4, 1
    c = cfg["dkdv"]
    hp = heads_per_program(G, qt, c["rows"])
    const = dict(HKV=2, G=G, HP=hp, HPP=padded_heads(hp), QT=qt, BS=64, KB=c["blocks"], D=128,
                 HAS_BIAS=True, NEED_DB=True, STAGES=c["num_stages"], num_warps=4)
    rows = mangle_type(attention_sm90.rows_descriptor(torch.empty(1, 256, 2 * G, 128, dtype=torch.bfloat16), qt,
                                                      padded_heads(hp)))
    yield "dkdv_sm90", GluonASTSource, attention_sm90_dkdv._bwd_dkdv_kernel_sm90, const, \
        dict(ptr, q_desc=rows, do_desc=rows), 4, 1, dict(maxnreg=attention_sm90.dkdv_maxnreg(c["blocks"]))


# kernels whose constants follow the KV group size (its heads, or the query tile it shapes)
GROUP_KERNELS = {"fwd", "dq", "dkdv", "pack_lists", "inv_count", "inv_fill", "sel_lse", "sel_block",
                 "fwd_sm90", "dq_sm90", "fwd_pairs_sm90", "dkdv_sm90"}


def main(groups: list[int]) -> None:
    """Every kernel at the first group size; at the others, the kernels that depend on it."""
    for i, G in enumerate(groups):
        for arch, cap in (("sm80", 80), ("sm90", 90)):
            rows = [(n, ASTSource, fn, const, ptr, w, st) for n, fn, const, ptr, w, st in cases(arch, G)]
            rows += list(gluon_cases(G)) if arch == "sm90" else []
            for name, source, fn, const, ptr, warps, stages, *extra in rows:
                if i and name not in GROUP_KERNELS:
                    continue
                sig, const, attrs = specialise(fn, const, ptr)
                k = triton.compile(source(fn, sig, const, attrs), target=GPUTarget("cuda", cap, 32),
                                   options=dict(num_warps=warps, num_stages=stages, **(extra[0] if extra else {})))
                print(json.dumps(dict(arch=arch, kernel=name, G=G, shared=k.metadata.shared)), flush=True)


if __name__ == "__main__":
    main([int(g) for g in sys.argv[1:]] or [8])
