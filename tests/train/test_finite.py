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
    got = finite.grads_nonfinite([_chunk(bufs[0]), _chunk(bufs[1], bufs[2])], torch.device("cpu"))
    assert got is (bad is not None)
    assert finite.weights_nonfinite([_chunk(*bufs)], torch.device("cpu")) is (bad is not None)


def test_no_buffers_is_finite():
    assert finite.grads_nonfinite([_chunk(None, torch.empty(0))], torch.device("cpu")) is False


def test_the_local_verdict_is_a_device_tensor():
    """No host read before the ranks combine their verdicts: the local flag is a tensor."""
    flag = finite._local_nonfinite([torch.tensor([1.0, float("nan")])], torch.device("cpu"))
    assert isinstance(flag, torch.Tensor) and flag.shape == (1,) and flag.item() == 1.0
    assert finite._local_nonfinite([torch.ones(3)], torch.device("cpu")).item() == 0.0
