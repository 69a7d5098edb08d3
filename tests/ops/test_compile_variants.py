"""Compiled kernel variants must not depend on the data: a packed batch with other document
lengths (same shapes) launches every Triton kernel with the same compile-time constants, so a
training run compiles each kernel once instead of once per new longest-document length (each
compile stalls the GPU for 0.1-0.9 s; measured on the H200 before ``NBW`` became a runtime
argument)."""

import torch

from nosa_layers.config import tiny_geometry
from nosa_layers.dispatch import nosa_attention, prepare_selection
from nosa_layers.ops import attention_op, block_selection, sparse_index, topk

KERNELS = {
    block_selection: ("_compress_kernel", "_sel_lse_kernel", "_sel_block_kernel"),
    topk: ("_select_kernel",),
    sparse_index: ("_pack_lists_kernel", "_inv_count_kernel", "_scan_kernel", "_inv_fill_kernel"),
    attention_op: ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_dkdv_reduce_kernel", "_bwd_delta_kernel"),
}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records the keyword (compile-time) arguments."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.add((self.name, tuple(sorted((k, v) for k, v in kw.items()))))
            return self.kernel[grid](*args, **kw)
        return launch


def _constants(monkeypatch, dev, cu_list, seed):
    log: set = set()
    for mod, names in KERNELS.items():
        for n in names:
            monkeypatch.setattr(mod, n, _Recorder(n, getattr(mod, n), log))
    cfg = tiny_geometry()
    g = torch.Generator().manual_seed(seed)
    T, Hq, Hkv, D = 160, 4, 2, 32
    q, k, v = (torch.randn(1, T, h, D, generator=g).to(dev).requires_grad_() for h in (Hq, Hkv, Hkv))
    score = torch.randn(1, T, Hkv, generator=g).to(dev).requires_grad_()
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    prepared = prepare_selection(q, k, score, cfg, cu, backend="triton")
    out = nosa_attention(q, k, v, score, cfg, cu_seqlens=cu, backend="triton", selected=prepared)
    out.sum().backward()
    monkeypatch.undo()
    return log


def test_kernel_constants_do_not_depend_on_document_lengths(monkeypatch, dev):
    a = _constants(monkeypatch, dev, [0, 160], seed=1)  # one 10-block document
    b = _constants(monkeypatch, dev, [0, 37, 90, 160], seed=2)  # longest document: 5 blocks
    assert {name for name, _ in a} >= {n for names in KERNELS.values() for n in names} - {"_dkdv_reduce_kernel"}
    assert a == b
