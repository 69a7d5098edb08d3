"""``train.step_reads=at_log``: the update is clipped and, for a non-finite step, skipped on the device
(``train.device_step``), and the host reads the steps' values only at log, evaluation, checkpoint and stop
points. CPU runs (gloo; torch's fused AdamW has a CPU kernel with the same ``found_inf`` skip). A save signal
while reading at the logs: ``tests/train/test_preemption.py``."""

import math

import pytest

from tests.train.conftest import metrics, run_main, train_here

PRETRAIN = ["recipe=tiny_pretrain", "train.seq_length=128", "train.global_batch_size=2",
            "train.micro_batch_size=1", "train.eval_interval=0", "train.eval_iters=1", "optim.warmup_steps=1",
            "logging.plot=false", "checkpoint.save=false"]


def _rows(run) -> dict:
    return {r["step"]: r for r in metrics(run) if "loss" in r}


@pytest.fixture(scope="module")
def each_step_and_at_log(tmp_path_factory, data_args):
    """The same 6 steps read each step (logged every step) and at the logs (every 3rd step)."""
    root = tmp_path_factory.mktemp("reads")
    common = [*PRETRAIN, *data_args, "train.max_steps=6", "optim.clip_grad=0.5"]
    train_here([*common, f"run.dir={root / 'each'}"])
    p = train_here([*common, f"run.dir={root / 'log'}", "train.step_reads=at_log", "train.log_interval=3"])
    return _rows(root / "each"), _rows(root / "log"), p


def test_updates_read_at_the_logs_train_as_those_read_each_step(each_step_and_at_log):
    each, at_log, _ = each_step_and_at_log
    assert sorted(at_log) == [3, 6] and sorted(each) == [1, 2, 3, 4, 5, 6]
    for step in (3, 6):
        mean = math.fsum(each[s]["loss"] for s in (step - 2, step - 1, step)) / 3  # the interval's mean
        assert math.isclose(at_log[step]["loss"], mean, rel_tol=1e-5), (step, at_log[step]["loss"], mean)
        # the same gradient norm (clipped steps: the coefficient is an fp32 tensor instead of a host float)
        assert math.isclose(at_log[step]["grad_norm"], each[step]["grad_norm"], rel_tol=1e-4)
        assert at_log[step]["lr"] == each[step]["lr"] and at_log[step]["skipped"] is False
        assert at_log[step]["step_time_s"] > 0 and at_log[step]["tokens_per_s"] > 0
    assert any(each[s]["grad_norm"] > 0.5 for s in each)  # clipping took part


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, data_args):
    """The 6 steps read at the logs on 2 ranks at TP=2 and at TP=1 (DP=2): the two jobs of one multirun
    launch (the process group kept between them). ``{tp: run dir}``."""
    root = tmp_path_factory.mktemp("reads2")
    common = [*PRETRAIN, *data_args, "train.max_steps=6", "optim.clip_grad=0.5"]
    run_main(["-m", *common, "parallel.tensor_model_parallel_size=2,1", f"run.dir={root}", "train.step_reads=at_log",
              "train.log_interval=3"], nproc=2)
    return {tp: root / f"parallel.tensor_model_parallel_size={tp}" for tp in (1, 2)}


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_reads_at_the_logs_with_two_ranks(each_step_and_at_log, two_rank_runs, tp):
    """TP=2 (the norm summed over the model-parallel group) and DP=2 (the distributed optimizer's shards,
    summed over the world) reading at the logs: the interval means of the losses and the norm of the
    one-process run read each step (the module's reference), within the rounding of the reduction order."""
    each, _, _ = each_step_and_at_log
    at_log = _rows(two_rank_runs[tp])
    assert sorted(at_log) == [3, 6]
    for step in (3, 6):
        mean = math.fsum(each[s]["loss"] for s in (step - 2, step - 1, step)) / 3
        assert math.isclose(at_log[step]["loss"], mean, rel_tol=1e-5), (step, at_log[step]["loss"], mean)
        assert math.isclose(at_log[step]["grad_norm"], each[step]["grad_norm"], rel_tol=1e-4)


@pytest.mark.parametrize("log_interval", [1, 4])
def test_a_non_finite_step_is_skipped_on_the_device_and_stops_the_run(tmp_path, data_args, log_interval):
    """lr=1e6 gives NaN gradients at step 3: the device skips the update; the host reads it at the next
    log / checkpoint point (step 3 or 4) and stops (exit 3) before any save of that point."""
    import torch

    from checkpoints_convert.common import load_megatron_tensors
    from runtime.checkpoint_manifest import verify

    run = tmp_path / f"nan{log_interval}"
    p = train_here([*PRETRAIN, *data_args, f"run.dir={run}", "train.max_steps=8", "checkpoint.interval=2",
                  "checkpoint.save=true", "optim.lr=1.0e+06", "optim.min_lr=0.0", "optim.warmup_steps=0",
                  "train.step_reads=at_log", f"train.log_interval={log_interval}"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 3 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-3000:]
    assert "step 3: loss is 9." in errors[0] and "but the gradients or their norm (nan) hold NaN/inf; the update " \
        "was not applied" in errors[0]  # the device step's verdict, read at the log / checkpoint point
    saved = sorted(c.name for c in (run / "checkpoints").glob("iter_*"))
    assert saved == ["iter_0000002"], saved  # not step 4's: the run stopped when it read step 3
    assert "newest verified checkpoint: " + str(run / "checkpoints" / "iter_0000002") in errors[0]
    assert verify(run / "checkpoints" / "iter_0000002") is None
    assert all(torch.isfinite(t).all() for t in load_megatron_tensors(run / "checkpoints" / "iter_0000002").values())


class _MegatronLikeOptimizer:
    """The part of a megatron-core optimizer that ``step_on_device`` uses, around a torch AdamW."""

    def __init__(self, params, clip: float, fused: bool = True):
        from types import SimpleNamespace

        import torch

        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused)
        self.config = SimpleNamespace(clip_grad=clip, use_precision_aware_optimizer=False)
        self.prepared = 0

    def prepare_grads(self):
        self.prepared += 1
        return False

    def get_grads_for_grad_norm(self):
        return [p.grad for p in self.params]

    def get_grad_stats_parallel_group(self):
        return None

    def get_parameters(self):
        return self.params

    def step_with_ready_grads(self):
        self.optimizer.step()
        return True


def _params(seed: int, grad_scale: float = 1.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 33)]
    for p in params:
        p.grad = grad_scale * torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("seed,scale", [(3, 4.0), (11, 4.0), (7, 0.01)])  # clipped twice, then not
def test_the_device_step_clips_and_steps_as_the_host_path_would(seed, scale):
    import torch

    from train.device_step import step_on_device

    params, ref = _params(seed, grad_scale=scale), _params(seed, grad_scale=scale)
    opt = _MegatronLikeOptimizer(params, clip=1.0)
    norm, skipped = step_on_device(opt, torch.zeros(2), torch.device("cpu"))
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref))
    assert opt.prepared == 1 and float(skipped) == 0.0
    assert math.isclose(float(norm), want, rel_tol=1e-6)
    coeff = min(1.0, 1.0 / (want + 1e-6))
    assert (coeff < 1.0) == (scale > 1)
    torch_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01, foreach=False)
    for p in ref:
        p.grad.mul_(coeff)
    torch_opt.step()
    for a, b in zip(params, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("why", ["nan_grad", "inf_grad", "bad_flag"])
def test_the_device_step_skips_a_non_finite_step_entirely(why):
    import torch

    from train.device_step import step_on_device

    params = _params(5)
    opt = _MegatronLikeOptimizer(params, clip=1.0)
    step_on_device(opt, torch.zeros(1), torch.device("cpu"))  # one good step: moments and a step count exist
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.optimizer.state[params[0]].items()}
    params[1].grad = torch.randn(params[1].shape)
    if why == "nan_grad":
        params[1].grad[3] = float("nan")
    elif why == "inf_grad":
        params[0].grad[0] = float("inf")
    norm, skipped = step_on_device(opt, torch.tensor([1.0 if why == "bad_flag" else 0.0]), torch.device("cpu"))
    assert float(skipped) == 1.0 and (math.isfinite(float(norm)) == (why == "bad_flag"))
    for a, b in zip(params, before):
        assert torch.equal(a.detach(), b)  # weights, ...
    for k, v in opt.optimizer.state[params[0]].items():
        assert torch.equal(v, state[k]), k  # ... moments and step count untouched
    assert not hasattr(opt.optimizer, "found_inf")  # the flag is not left on the optimizer


def test_the_device_step_refuses_what_it_cannot_skip():
    from train.device_step import supports_device_step

    assert supports_device_step(_MegatronLikeOptimizer(_params(1), clip=1.0)) is None
    assert "fused AdamW" in supports_device_step(_MegatronLikeOptimizer(_params(1), clip=1.0, fused=False))


def test_skip_policy_counts_steps_skipped_on_the_device(tmp_path, data_args):
    run = tmp_path / "skip"
    p = train_here([*PRETRAIN, *data_args, f"run.dir={run}", "train.max_steps=10", "optim.lr=1.0e+30",
                  "optim.min_lr=0.0", "optim.warmup_steps=0", "train.step_reads=at_log", "train.log_interval=2",
                  "train.nan_policy=skip", "train.nan_skip_limit=3"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 3 and len(errors) == 1, p.stdout[-3000:]
    assert "3 consecutive steps skipped (train.nan_skip_limit=3)" in errors[0]
    assert "update skipped (1 in a row" in p.stdout and "update skipped (2 in a row" in p.stdout


def test_at_log_reads_need_the_fused_adamw(tmp_path, data_args):
    p = train_here([*PRETRAIN, *data_args, f"run.dir={tmp_path / 'x'}", "train.max_steps=2", "optim.fused=false",
                  "train.step_reads=at_log"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("config error:")]
    assert p.returncode == 2 and len(errors) == 1 and "optim.fused=true" in errors[0], p.stdout[-2000:]
    assert "Traceback" not in p.stdout
    p = train_here([*PRETRAIN, *data_args, f"run.dir={tmp_path / 'y'}", "train.max_steps=2",
                  "train.step_reads=sometimes"], check=False)
    assert p.returncode == 2 and "train.step_reads" in p.stdout and "Traceback" not in p.stdout
