"""Fixtures of the Triton kernel tests.

Without CUDA the kernels run under the Triton interpreter. The interpreter must be chosen before
``triton`` is first imported, so this conftest imports triton and ``nosa_layers.ops`` with
``TRITON_INTERPRET=1`` set for that import only, and the ``interp`` fixture sets the variable
again while each interpreter test runs; other test folders see the environment unchanged.
If something imported triton earlier in this process, the interpreter tests are skipped here and
``test_interp_in_subprocess`` runs them in a fresh process instead. With CUDA the kernels are
compiled, the interpreter tests are skipped and the ``gpu``-marked tests run.
"""

import importlib
import importlib.util
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERP_IN_PROCESS = False

if HAS_TRITON and not HAS_CUDA:
    if "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton  # noqa: F401
            for name in [m for m in sys.modules if m == "nosa_layers.ops" or m.startswith("nosa_layers.ops.")]:
                del sys.modules[name]
            importlib.import_module("nosa_layers.ops")
            INTERP_IN_PROCESS = True
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU CI)")


@pytest.fixture
def interp(monkeypatch):
    """CPU interpreter test: skipped where CUDA (compiled kernels) or Triton is missing."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if HAS_CUDA:
        pytest.skip("interpreter tests run on CPU machines only (kernels are compiled here)")
    if not INTERP_IN_PROCESS:
        pytest.skip("triton was imported before the interpreter could be chosen: see test_interp_in_subprocess")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def cuda():
    if not (HAS_CUDA and HAS_TRITON):
        pytest.skip("needs a CUDA GPU and triton")
    return torch.device("cuda")
