"""What every Triton module of ``nosa_layers.ops`` shares: the log2(e) constant, the interpreter
test and the device check."""

from __future__ import annotations

import os

from torch import Tensor

LOG2E = 1.4426950408889634  # softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E)


def interpreting() -> bool:
    """True when the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(*tensors: Tensor | None) -> None:
    """Triton kernels need CUDA tensors, or ``TRITON_INTERPRET=1`` (CPU tests)."""
    if interpreting():
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise RuntimeError("nosa_layers.ops: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); "
                               "use backend='reference' on CPU")
