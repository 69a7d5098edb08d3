"""The finite checks of ``train.finite``: one verdict per check from flat buffers of any float dtype,
NaN and +-inf both caught, an empty model is finite, and the verdict stays on the device until the
single host read."""

from types import SimpleNamespace

import pytest
import torch

from train import finite


def _chunk(*grads):
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=g, param_data=g, params=[]) for g in grads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_grads_nonfinite_finds_nan_and_inf_in_any_buffer(dtype, bad):
    bufs = [torch.randn(n).to(dtype) for n in (7, 1000, 33)]
    if bad is not None:
        bufs[1][int(torch.randint(0, 1000, (1,)))] = bad
    got = finite.grads_nonfinite_flag([_chunk(bufs[0]), _chunk(bufs[1], bufs[2])], torch.device("cpu"))
    assert got.shape == (1,) and (got.item() > 0) is (bad is not None)
    assert finite.weights_nonfinite([_chunk(*bufs)], torch.device("cpu")) is (bad is not None)


def test_no_buffers_is_finite():
    assert finite.grads_nonfinite_flag([_chunk(None, torch.empty(0))], torch.device("cpu")).item() == 0


def test_the_local_verdict_is_a_device_tensor():
    """No host read before the ranks combine their verdicts: the local flag is a tensor."""
    flag = finite._local_nonfinite([torch.tensor([1.0, float("nan")])], torch.device("cpu"))
    assert isinstance(flag, torch.Tensor) and flag.shape == (1,) and flag.item() == 1.0
    assert finite._local_nonfinite([torch.ones(3)], torch.device("cpu")).item() == 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_the_trainer_reads_loss_and_gradient_verdict_in_one_host_read(monkeypatch, precision, bad):
    """A training step waits for the GPU once for the loss and the gradient check together: the
    loss is mean = sum / count of the last stage's total; NaN gradients are flagged (not under fp16,
    where megatron's loss scaler checks them)."""
    from megatron.core import parallel_state as ps

    from train.trainer import Trainer

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 1)
    grads = torch.randn(50)
    if bad is not None:
        grads[7] = bad
    trainer = Trainer.__new__(Trainer)
    trainer.precision, trainer.model = precision, [_chunk(grads)]
    trainer.env = SimpleNamespace(device=torch.device("cpu"))
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name: reads.append(_n) or _r(t, *a))
    loss, grads_bad = trainer._loss_and_grads_nonfinite(torch.tensor([30.0, 8.0]))
    assert loss == pytest.approx(3.75)
    assert grads_bad is (bad is not None and precision != "fp16")
    assert len(reads) == 1, reads
