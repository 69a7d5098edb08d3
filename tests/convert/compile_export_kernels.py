"""Compile the Triton kernels shipped with sparse exports (decode attention and selection, host-store transfers) for
the sm80 and sm90 targets, without a GPU (the selection kernel also as ``torch.compile`` copies it); prints one
JSON line per kernel variant and target. Run by
``test_export_kernels.py`` in a process without ``TRITON_INTERPRET``."""

import importlib.util
import json
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nosa_layers.ops import decode_attention, decode_selection, offload_copy


def as_torch_compile_runs_it(fn):
    """``fn`` as ``torch.compile`` (Inductor) runs a user's kernel: from a copy of its source and of the jitted
    functions it names, each under its own name (a module-level alias of a jitted function would be missing
    there); ``fn`` itself where this torch has no such code generator."""
    try:
        from torch._inductor.codegen.wrapper import (
            user_defined_triton_kernel_transitive_closure_source_code as closure,
        )
    except ImportError:
        return fn
    path = Path(tempfile.mkdtemp()) / "copied_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n" + closure(fn))
    spec = importlib.util.spec_from_file_location("copied_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)


def variants():
    """(name, jit function, signature, constexprs) of every shipped kernel in the variants a cache runs."""
    attn = decode_attention._build()["attn"]
    uva = offload_copy._build()
    for fp32 in (False, True):
        x = "*fp32" if fp32 else "*bf16"
        for has_bias in (False, True):
            for has_host in (False, True):
                const = dict(G=8, GP=16, D=128, BS=64, PER=8, HAS_BIAS=has_bias, HAS_HOST=has_host, FP32=fp32)
                ptr = dict(Q=x, PK=x, PV=x, PB="*fp32", HK=x, HV=x, HB="*fp32", ROWS="*i64", HROWS="*i64",
                           BLOCKS="*i64", OK="*u8", POS="*i64", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32",
                           scale="fp32", Hkv="i32", K="i32", n_split="i32")
                yield f"decode_attn fp32={fp32} bias={has_bias} host={has_host}", attn, ptr, const
    select = decode_selection._build()["select"]
    copied = as_torch_compile_runs_it(select)
    for kc, has_wsc in (("*bf16", True), ("*fp32", False)):  # both dtypes and stage counts, compiled and eager
        # the released geometry, G 8, D 128; 64 blocks ranked at a time for a top 16 (the halving and merging
        # code of the top-k; the cache's own 256 / 64 take longer to compile, not other code)
        const = dict(G=8, GP=16, D=128, BW=64, CB=64, LOG_CB=6, KP=16, LOG_KP=4, WPB=6, QA=16, K=16, BLOCK_SIZE=64,
                     KERNEL_SIZE=32, KERNEL_STRIDE=16, INIT=1, LOCAL=16, HAS_WSC=has_wsc)
        ptr = dict(Q=kc, KC=kc, WSC="*fp32", POS="*i64", INDEX="*i64", SCORES="*fp32", BLOCKS="*i64", OK="*u8",
                   scale="fp32", **{n: "i32" for n in ("Hkv", "NW1", "NB", "sq_b", "sq_h", "sq_g", "sq_d", "sk_b",
                                                       "sk_h", "sk_w", "sk_d", "sw_b", "sw_h", "sw_w")})
        yield f"decode_select kc={kc[1:]} wsc={has_wsc}", copied if has_wsc else select, ptr, const
    for has_b in (False, True):
        ptr = dict(src_k="*bf16", src_v="*bf16", src_b="*fp32", dst_k="*bf16", dst_v="*bf16", dst_b="*fp32",
                   src_row="*i64", dst_row="*i64", n="i32")
        yield f"fetch_rows bias={has_b}", uva["fetch"], ptr, dict(ELEMS=8192, CHUNK=1024, BELEMS=64, HAS_B=has_b)
    yield "store_tokens", uva["store"], dict(k="*bf16", v="*bf16", dst_k="*bf16", dst_v="*bf16", dst_elem="*i64"), \
        dict(D=128)
    yield "store_values", uva["store_values"], dict(x="*fp32", dst="*fp32", dst_elem="*i64", n="i32"), dict(BLOCK=128)


def main() -> None:
    for arch, cap in (("sm80", 80), ("sm90", 90)):
        for name, fn, ptr, const in variants():
            sig = {p.name: ("constexpr" if p.name in const else ptr[p.name]) for p in fn.params}
            compiled = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", cap, 32),
                                      options=dict(num_warps=4))
            print(json.dumps(dict(arch=arch, kernel=name, shared=compiled.metadata.shared)), flush=True)


if __name__ == "__main__":
    main()
