"""``train.optim.use_fused_adam``: the torch Adam(W) inside megatron-core's optimizer switches between
the fused kernel and the multi-tensor path, step counters untied and placed where each path keeps them."""

import torch

from train.optim import adam_is_fused, use_fused_adam


class _Wrapper:  # megatron-core's optimizers keep the torch optimizer as ``.optimizer``
    def __init__(self, inner):
        self.optimizer = inner


class _Chained:
    def __init__(self, *opts):
        self.chained_optimizers = list(opts)


def _stepped_adam(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    shared = torch.tensor(1.0)  # as megatron-core's distributed optimizer loads them: one tensor for all
    for p in params:
        opt.state[p]["step"] = shared
    return opt, params


def test_switching_sets_every_group_and_unties_the_step_counters():
    a, pa = _stepped_adam(0)
    b, _ = _stepped_adam(1)
    wrapped = _Chained(_Wrapper(a), _Wrapper(b), _Wrapper(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1)))
    assert not adam_is_fused(wrapped)
    assert use_fused_adam(wrapped, True) == 2  # the SGD is left alone
    assert adam_is_fused(wrapped)
    for opt in (a, b):
        for group in opt.param_groups:
            assert group["fused"] is True and group["foreach"] is None
    steps = [a.state[p]["step"] for p in pa]
    assert steps[0] is not steps[1] and all(s.dtype == torch.float32 and float(s) == 1.0 for s in steps)
    before = [p.detach().clone() for p in pa]
    for p in pa:
        p.grad = torch.ones_like(p)
    a.step()  # the fused kernel runs (torch has a CPU one) and counts every parameter once
    assert all(float(a.state[p]["step"]) == 2.0 for p in pa)
    assert all(not torch.equal(x, p) for x, p in zip(before, pa))
    assert use_fused_adam(wrapped, False) == 2 and not adam_is_fused(wrapped)
    assert all(g["fused"] is None and g["foreach"] is None for g in a.param_groups)
    assert all(a.state[p]["step"].device.type == "cpu" for p in pa)
    a.step()
    assert all(float(a.state[p]["step"]) == 3.0 for p in pa)


def test_a_fresh_optimizer_creates_its_counters_for_the_chosen_path():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-2)
    use_fused_adam(_Wrapper(opt), True)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.param_groups[0]["fused"] and float(opt.state[p]["step"]) == 1.0


def test_eviction_lr_mult_scales_only_the_eviction_heads_update(tmp_path, data_args):
    """``optim.eviction_lr_mult``: megatron-core's parameter-group override gives the eviction heads
    ``lr * mult``. After one step from the same weights (``A = 0`` at init, so the forward and every
    gradient are the same) every other tensor is bitwise equal and the heads' gate ``A`` moved ``mult``
    times as far (AdamW's first step moves a parameter by about lr)."""
    from checkpoints_convert.common import load_megatron_tensors
    from tests.train.conftest import train_here

    args = ["recipe=tiny_pretrain", "attention=nosa", "train.seq_length=128", "train.global_batch_size=2",
            "train.micro_batch_size=1", "train.max_steps=1", "train.eval_interval=0", "train.eval_iters=0",
            "optim.warmup_steps=0", "checkpoint.interval=0", *data_args]
    runs = {}
    for mult in (1, 8):
        run = tmp_path / f"mult{mult}"
        train_here([*args, f"run.dir={run}", f"optim.eviction_lr_mult={mult}"])
        runs[mult] = load_megatron_tensors(run / "checkpoints" / "iter_0000001")
    a, b = runs[1], runs[8]
    heads = sorted(k for k in a if ".eviction_head." in k)
    gates = [k for k in heads if k.endswith(".A")]
    assert gates and a.keys() == b.keys(), (heads, list(a)[:5])
    other = [k for k in a if k not in heads and not torch.equal(a[k], b[k])]
    assert not other, f"non-eviction tensors differ: {other[:3]}"
    for k in gates:
        moved1, moved8 = a[k].double().abs(), b[k].double().abs()
        assert float(moved1.min()) > 0, k
        assert torch.allclose(moved8 / moved1, torch.full_like(moved1, 8.0), rtol=1e-3), (k, moved8 / moved1)
