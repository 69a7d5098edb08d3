"""``bench/wgrad_gemm.py``: shapes parsed or refused in one line, the unfused reference path, no-GPU refusal."""

from __future__ import annotations

import pytest
import torch

from tests.bench.loader import load_bench


def test_shapes_parse_and_bad_ones_are_refused():
    m = load_bench("wgrad_gemm")
    assert m.parse_shapes(m.DEFAULT_SHAPES) == [(11264, 2048), (2048, 5632), (2560, 2048), (2048, 2048)]
    assert m.parse_shapes(" 8X4") == [(8, 4)]
    for bad in ("8x", "8x4x2", "ax4", "0x4"):
        with pytest.raises(ValueError, match="--shapes"):
            m.parse_shapes(bad)


def test_unfused_path_accumulates_the_product():
    m = load_bench("wgrad_gemm")
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(37, 5, generator=g), torch.randn(37, 3, generator=g)
    start = torch.randn(3, 5, generator=g)
    grad = start.clone()
    m.unfused(x, dy, grad)
    want = start.double() + dy.double().t() @ x.double()
    assert m.relative_error(grad, want) < 1e-6
    assert m.relative_error(start, want) > 0.1  # the error measure sees a missing product


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path, capsys):
    m = load_bench("wgrad_gemm")
    assert m.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert m.main(["--out", str(tmp_path), "--shapes", "3by4"]) == 2
