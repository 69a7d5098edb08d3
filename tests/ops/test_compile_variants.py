"""Compiled kernel variants must not depend on the data: a packed batch with other document
lengths (same shapes) launches every Triton kernel with the same compile-time constants and the
same specialisation classes of its runtime arguments (Triton compiles a variant per class of an
integer: 1, a multiple of 16, other; and per 16-byte alignment of a pointer), unless the argument
is declared ``do_not_specialize``. Otherwise a training run compiles kernels again for each new
longest-document length: each compile stalls the GPU for 0.1-0.9 s (measured on the H200 before
the selection width became an unspecialised runtime argument)."""

import torch

from nosa_layers.config import tiny_geometry
from nosa_layers.dispatch import nosa_attention, prepare_selection
from nosa_layers.ops import attention_op, block_selection, sparse_index, topk
from nosa_layers.ops._common import UNSPECIALIZED

KERNELS = {
    block_selection: ("_compress_kernel", "_sel_lse_kernel", "_sel_block_kernel"),
    topk: ("_select_kernel",),
    sparse_index: ("_pack_lists_kernel", "_inv_count_kernel", "_scan_kernel", "_inv_fill_kernel"),
    attention_op: ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_dkdv_reduce_kernel", "_bwd_delta_kernel"),
}


def _spec_class(v):
    """Triton's specialisation class of a runtime argument (what selects a compiled variant)."""
    if isinstance(v, torch.Tensor):
        return ("ptr", v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or not isinstance(v, int):
        return type(v).__name__
    return "1" if v == 1 else "D" if v % 16 == 0 else "int"


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records constants and argument classes per launch."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            names = self.kernel.arg_names
            self.log.setdefault(self.name, set()).add(
                (tuple(sorted(kw.items())), tuple((n, _spec_class(a)) for n, a in zip(names, args))))
            return self.kernel[grid](*args, **kw)
        return launch


def _launches(monkeypatch, dev, cu_list, seed):
    log: dict = {}
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


def test_compiled_variants_do_not_depend_on_document_lengths(monkeypatch, dev):
    a = _launches(monkeypatch, dev, [0, 37, 160], seed=1)  # longest document: 8 blocks (width 8)
    b = _launches(monkeypatch, dev, [0, 16, 32, 48, 160], seed=2)  # longest: 7 blocks (width 7)
    # ten 1-block documents: every row's blocks fit the budget, so the selection scores nothing
    short = _launches(monkeypatch, dev, list(range(0, 161, 16)), seed=3)
    assert set(a) >= {n for names in KERNELS.values() for n in names} - {"_dkdv_reduce_kernel"}
    assert set(a) == set(b) and set(short) == set(a) - {"_compress_kernel", "_sel_lse_kernel", "_sel_block_kernel"}
    for other in (b, short):
        for name in other:
            consts_a = {k for k, _ in a[name]}
            assert consts_a == {k for k, _ in other[name]}, f"{name}: compile-time constants depend on the data"
            free = set(UNSPECIALIZED.get(name, ()))
            for (_, args_a) in a[name]:
                for (_, args_b) in other[name]:
                    differ = {n for (n, x), (_, y) in zip(args_a, args_b) if x != y}
                    assert differ <= free, f"{name}: {sorted(differ - free)} change specialisation with the data"
