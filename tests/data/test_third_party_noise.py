"""Known third-party startup warnings (optional accelerators missing, megatron-core / torch deprecation
notices) become one line on rank 0; every other warning is shown as before."""

from __future__ import annotations

import subprocess
import sys

import torch

from data.third_party_noise import missing_optional, note_line
from tests.subproc import REPO, child_env

SCRIPT = """
import logging, warnings
from data.third_party_noise import quiet_third_party
quiet_third_party()
quiet_third_party()  # idempotent
warnings.warn("Transformer Engine and Apex are not installed. Falling back to local implementations of x")
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only ...")
logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").warning("MCore's async save is deprecated.")
warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning)
warnings.warn("MimoModelConfig is experimental and still under active development.", UserWarning)
warnings.warn("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad ...")
warnings.warn("Could not determine rank from torch.distributed, RANK, or SLURM_PROCID. Defaulting to rank 0.")
import torch  # loaded, as megatron-core loads it: the CUDA-only advice is dropped where CUDA is absent
warnings.warn("When using sequence parallelism it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
warnings.warn("a warning of our own that must stay", UserWarning)
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("another megatron warning")
"""


def _output(script: str, **env) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of ``python -c script``."""
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(**env), capture_output=True,
                       text=True, timeout=120, check=True)
    return [ln for ln in p.stdout.splitlines() if ln.strip()], [ln for ln in p.stderr.splitlines() if ln.strip()]


def test_known_warnings_become_one_line_and_others_stay():
    out, err = _output(SCRIPT)
    assert out == [note_line()] and "Transformer Engine" in out[0] and "Apex" in out[0]  # a progress line
    rest = "\n".join(err)
    assert "a warning of our own that must stay" in rest and "another megatron warning" in rest
    assert not any(k in rest for k in ("not installed", "deprecated", "DEPRECATED", "experimental", "non-leaf",
                                       "not a leaf", "Could not determine rank"))
    assert ("CUDA_DEVICE_MAX_CONNECTIONS" in rest) == torch.cuda.is_available()
    assert _output(SCRIPT, RANK="1")[0] == []  # other ranks: no note
    out, err = _output(SCRIPT, NOSA_THIRD_PARTY_WARNINGS="1")
    every = "\n".join(err)
    assert out == [] and "GPTModel IS DEPRECATED" in every and "Falling back to Torch Norm" in every
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in every and "Could not determine rank" in every


MEGATRON = """
import warnings
warnings.simplefilter("default")
from data.third_party_noise import quiet_third_party
quiet_third_party()
import megatron.core.optimizer, megatron.core.models.backends, megatron.core.models.gpt.gpt_layer_specs
from megatron.core.transformer.transformer_config import TransformerConfig
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
print("imported")
"""


def test_megatron_core_imports_print_one_line():
    """The real megatron-core warnings of an install without Transformer Engine / Apex (one per module)."""
    out, err = _output(MEGATRON)
    assert out == ([note_line()] if missing_optional() else []) + ["imported"]
    assert not any(k in ln for ln in err for k in ("not installed", "Falling back", "deprecated")), err
    out, err = _output(MEGATRON, NOSA_THIRD_PARTY_WARNINGS="1")  # what they were
    assert not missing_optional() or sum("not installed" in ln for ln in err) >= 4
