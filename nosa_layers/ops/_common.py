"""What every Triton module of ``nosa_layers.ops`` shares: the log2(e) constant, the interpreter
test, the device check and the padded head count of a query tile."""

from __future__ import annotations

import os

from torch import Tensor

LOG2E = 1.4426950408889634  # softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E)


def interpreting() -> bool:
    """True when the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def padded_heads(hp: int) -> int:
    """Query heads a program's tile holds for ``hp`` heads of a KV group: ``hp`` rounded up to a power of
    two (Triton and Gluon tiles are powers of two; the extra heads' rows are masked like rows past a
    document's end), so every group size runs (G = 3, 5, 6, 7, 9, ...)."""
    return 1 << max(hp - 1, 0).bit_length()


def kernels_run_on(x: Tensor) -> bool:
    """Whether the Triton kernels run on ``x``: a CUDA tensor, or any under the interpreter (tests); the
    rule the fused layers (``train.fusions``) use to take the kernel instead of their reference."""
    return x.is_cuda or interpreting()


def check_device(*tensors: Tensor | None) -> None:
    """Triton kernels need CUDA tensors, or ``TRITON_INTERPRET=1`` (CPU tests)."""
    if interpreting():
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise RuntimeError("nosa_layers.ops: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); "
                               "use backend='reference' on CPU")


# Runtime arguments whose value follows the data (document lengths of a packed batch: the selection
# width, list capacities, tile and list counts, and strides over the width). Triton would compile a
# variant per specialisation class of each (1 / multiple of 16 / other), i.e. recompile in the
# middle of training when a batch brings a new class, so the kernels take them unspecialised
# (``@triton.jit(do_not_specialize=UNSPECIALIZED[name])``; checked by tests/ops/test_compile_variants).
UNSPECIALIZED = {
    "_select_kernel": ("s_ab", "s_ah", "s_at", "s_ob", "s_oh", "s_ot", "NBW"),
    "_sel_block_kernel": ("s_ob", "s_oh", "s_ot"),
    "_pack_lists_kernel": ("s_sb", "s_sh", "s_st", "cap", "NBW"),
    "_inv_count_kernel": ("NBW",),
    "_scan_kernel": ("n_lists", "chunk", "max_slots", "tag_base"),
    "_inv_fill_kernel": ("NBW",),
    "_fwd_kernel": ("n_tiles", "cap"),
    "_bwd_dq_kernel": ("n_tiles", "cap"),
    "_bwd_dkdv_kernel": ("n_lists", "chunk"),
}
