"""``runtime.megatron_compat.use_sync_free_multi_tensor_ops``: megatron-core's gradient norm and
clipping without TE / Apex give the same values as its local fallback, with no host read per tensor."""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.megatron_compat import multi_tensor_l2_norm, multi_tensor_scale, use_sync_free_multi_tensor_ops

megatron_utils = pytest.importorskip("megatron.core.utils")


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (``.item()``, ``float(t)``: a host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_local_scalar_dense" in str(func):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _grads(seed: int, dtype=torch.float32) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = [(17, 5), (3,), (0,), (64, 33), (1,), (7, 7, 3)]
    return [(torch.randn(s, generator=g) * float(torch.rand(1, generator=g)) * 4).to(dtype) for s in shapes]


def _fallback_norm(grads) -> float:
    """megatron-core's ``local_multi_tensor_l2_norm`` restated on the CPU (it allocates on "cuda")."""
    return float(torch.norm(torch.tensor([float(torch.norm(t)) for t in grads])))


def _exact_norm(grads) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in grads))


@pytest.mark.parametrize("seed", [0, 11, 2024])
def test_l2_norm_equals_megatrons_fallback_without_scalar_reads(seed):
    grads = _grads(seed)
    with _ScalarReads() as reads:
        got, per_tensor = multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert reads.n == 0 and per_tensor is None
    assert got.shape == (1,) and got.dtype == torch.float32
    assert float(got) == pytest.approx(_exact_norm(grads), rel=1e-6)
    assert float(got) == pytest.approx(_fallback_norm(grads), rel=1e-6)


def test_l2_norm_of_bf16_gradients_and_of_a_non_finite_one():
    grads = _grads(5, torch.bfloat16)
    got, _ = multi_tensor_l2_norm(0, None, [grads], False)
    assert float(got) == pytest.approx(_fallback_norm(grads), rel=1e-2)
    grads[3][2, 1] = float("nan")
    assert math.isnan(float(multi_tensor_l2_norm(0, None, [grads], False)[0]))
    assert float(multi_tensor_l2_norm(0, None, [[]], False)[0]) == 0.0


@pytest.mark.parametrize("case", ["in_place", "copy", "scaled_copy"])
def test_scale_equals_megatrons_fallback(case):
    src = _grads(3)
    if case == "in_place":
        dst, ref_dst, scale = src, [t.clone() for t in src], 0.37
        ref_src = ref_dst
    else:
        dst = [torch.full_like(t, 9.0, dtype=torch.bfloat16) for t in src]
        ref_src, ref_dst = src, [t.clone() for t in dst]
        scale = 1.0 if case == "copy" else 0.37
    megatron_utils.local_multi_tensor_scale(0, None, [ref_src, ref_dst], scale)
    multi_tensor_scale(0, None, [src, dst], scale)
    for got, want in zip(dst, ref_dst):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _norm_and_clip(rank, init, out):
    import json

    import torch.distributed as dist

    from runtime.megatron_cpu import apply_cpu_shim

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    apply_cpu_shim()  # megatron's clipping allocates on "cuda"
    from megatron.core.optimizer import clip_grads

    # megatron's local fallback, or ours already in its place (a run earlier in the forked test process)
    result = {"was_fallback": clip_grads.l2_norm_impl in (megatron_utils.local_multi_tensor_l2_norm,
                                                          multi_tensor_l2_norm)}
    result["patched"] = use_sync_free_multi_tensor_ops() and use_sync_free_multi_tensor_ops()  # idempotent
    result["impls"] = [clip_grads.l2_norm_impl is multi_tensor_l2_norm,
                       clip_grads.multi_tensor_scale_impl is multi_tensor_scale]
    grads = _grads(100 + rank)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with _ScalarReads() as reads:
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    result["norm"], result["scalar_reads"] = norm, reads.n
    # megatron's own fallback (on a GPU its torch.tensor([...]) of device scalars reads each one back)
    result["fallback_norm"] = float(megatron_utils.local_multi_tensor_l2_norm(0, None, [grads], False)[0])
    clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
    coeff = 1.0 / (norm + 1.0e-6)
    result["clipped_ok"] = all(torch.allclose(p.grad, g * coeff, rtol=1e-6, atol=0) for p, g in zip(params, grads))
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_megatrons_grad_norm_and_clipping_over_two_ranks(tmp_path):
    """Through megatron-core's own ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` on two
    gloo ranks: the norm is the global one, read back once (not once per tensor), and clipping scales
    every gradient by megatron's coefficient."""
    import json

    mp.start_processes(_norm_and_clip, args=(f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    if not results[0]["was_fallback"]:
        pytest.skip("megatron-core uses Transformer Engine's or Apex's kernels here")
    exact = _exact_norm([x for r in range(2) for x in _grads(100 + r)])
    for r in results:
        assert r["patched"] and r["impls"] == [True, True]
        assert r["norm"] == pytest.approx(exact, rel=1e-6)
        assert r["scalar_reads"] == 1  # megatron's one read of the all-reduced total
        assert r["clipped_ok"]
    for rank, r in enumerate(results):  # the fallback's local norm, for comparison
        assert r["fallback_norm"] == pytest.approx(_exact_norm(_grads(100 + rank)), rel=1e-6)
