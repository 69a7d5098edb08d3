"""On a CPU, a command's first ``import megatron.core`` skips the GPU-only compile machinery behind
megatron-core's fused ops and loads wandb only when used (``runtime.megatron_cpu.lean_megatron_import``)."""

import subprocess
import sys

import pytest
import torch

from tests.subproc import REPO, child_env

SCRIPT = """
import sys
from runtime.megatron_cpu import lean_megatron_import
print("lean", lean_megatron_import())
import megatron.core.models.gpt  # noqa: F401
import torch
print("dynamo", any(m.startswith("torch._dynamo") for m in sys.modules))
print("compile restored", torch.compile.__name__ == "compile")
import wandb
print("wandb usable", callable(wandb.init))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the lean import applies only without CUDA")
def test_megatron_imports_without_the_compile_machinery_on_cpu():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["lean True", "dynamo False", "compile restored True", "wandb usable True"], out.stdout
