"""Fixtures of the Triton kernel tests: one device for every case.

``dev`` is the CUDA GPU where there is one (kernels compiled) and the CPU otherwise (kernels under
the Triton interpreter: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` for CPU-only sessions
before triton is imported). On a GPU machine every test in this folder is also marked ``gpu``, so
``pytest -m gpu tests/ops`` runs every case compiled; tests that need large shapes take ``cuda``.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        return
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def dev() -> torch.device:
    """The device the kernels run on in this session (CUDA, or the CPU under the interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if HAS_CUDA:
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not set (run through tests/conftest.py)")
    return torch.device("cpu")


@pytest.fixture
def cuda() -> torch.device:
    """Tests whose shapes only make sense compiled (long sequences, bf16)."""
    if not (HAS_CUDA and HAS_TRITON):
        pytest.skip("needs a CUDA GPU and triton")
    return torch.device("cuda")


def fp32_tol(dev: torch.device) -> float:
    """Relative tolerance of fp32 kernel results: exact fp32 arithmetic under the interpreter, tf32
    tensor-core products (10-bit mantissa) when compiled."""
    return 1e-5 if dev.type == "cpu" else 5e-3
