"""GPU-time breakdown of a profiled step (``train/profiling.py``) from profiler events."""

from dataclasses import dataclass

import pytest
import torch

from train.profiling import breakdown

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@dataclass
class Ev:
    key: str
    device_type: object
    self_device_time_total: float  # us
    device_time_total: float = 0.0


def test_kernels_are_sorted_into_parts_per_step():
    events = [
        Ev("_fwd_kernel", CUDA, 4000), Ev("_bwd_dq_kernel", CUDA, 3000), Ev("_bwd_dkdv_kernel", CUDA, 5000),
        Ev("_sel_block_kernel", CUDA, 1000), Ev("_select_kernel", CUDA, 200), Ev("_pack_lists_kernel", CUDA, 100),
        Ev("_inv_fill_kernel", CUDA, 100), Ev("sm90_xmma_gemm_bf16", CUDA, 20000),
        Ev("pytorch_flash::flash_fwd_kernel", CUDA, 600),
        Ev("aten::mm", CPU, 20000),  # a CPU op's own kernels are already counted as kernel events
        Ev("nosa.eviction_head", CPU, 0, 800),
    ]
    got = breakdown(events, steps=2)
    assert got["attention_forward"] == pytest.approx(2.3) and got["attention_backward"] == pytest.approx(4.0)
    assert got["nosa_selection"] == pytest.approx(0.6) and got["nosa_index"] == pytest.approx(0.1)
    assert got["eviction_head_forward"] == pytest.approx(0.4)
    assert got["total_gpu"] == pytest.approx(17.0)
    assert got["everything_else"] == pytest.approx(17.0 - 2.3 - 4.0 - 0.6 - 0.1 - 0.4)
