"""A new eviction head is one registered class: the converters and the HF export pick it up with
no other edit (names and shapes from the module, value-only from ``reads_qk``, the class shipped
in the export's ``nosa_eviction.py``).

The head below is registered by this test only (and removed afterwards). One subprocess runs the
public CLIs on it as a user would after training: a trainer-format checkpoint with random weights
-> ``to_hf`` -> ``from_hf`` -> ``to_hf`` (bitwise equal), and ``verify`` (Megatron forward vs the
exported HF model: logits, KV-cache decode, tensor round trips).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import Tensor, nn

from checkpoints_convert.common import load_safetensors_dir
from nosa_layers.eviction import EVICTION_HEADS, EvictionHead, EvictionOutput, register_eviction_head
from tests.convert.conftest import run, tail

NAME = "test_key_gate"


class KeyGateHead(EvictionHead):
    """Test head: ``s = gain * tanh(proj(k))`` per KV head (pre-RoPE keys), added as the bias."""

    reads_qk = True

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 detach_value: bool = False) -> None:
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         detach_value=detach_value)
        self.gain = nn.Parameter(torch.ones(num_kv_heads))
        self.proj = nn.Linear(head_dim, 1, bias=bias)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        s = self.gain.float() * torch.tanh(self.proj(k.float()).squeeze(-1))
        return EvictionOutput(score=s, bias=s)


def _squash(x: Tensor) -> Tensor:
    return torch.tanh(x)


class HelperHead(KeyGateHead):
    """Uses a helper of this test module, which an export cannot ship."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> EvictionOutput:
        s = self.gain.float() * _squash(self.proj(k.float()).squeeze(-1))
        return EvictionOutput(score=s, bias=s)


def register() -> None:
    register_eviction_head(NAME)(KeyGateHead)


@pytest.fixture
def key_gate_head():
    register()
    yield NAME
    EVICTION_HEADS.pop(NAME)


def test_a_head_the_export_cannot_ship_is_named(key_gate_head):
    from checkpoints_convert.hf_modeling import reference_sources

    assert "class KeyGateHead(EvictionHead):" in reference_sources()["nosa_eviction.py"]
    register_eviction_head("test_helper")(HelperHead)
    try:
        with pytest.raises(ValueError, match=r"'test_helper' .*HelperHead\) uses _squash, which an export cannot"):
            reference_sources()
    finally:
        EVICTION_HEADS.pop("test_helper")


# Runs in a fresh process (megatron-core never runs in the pytest process): registers the head,
# writes a random trainer-format checkpoint, then only the converters' public entry points.
SCRIPT = r"""
import sys
from pathlib import Path
import torch
from tests.convert.test_new_eviction_head import NAME, register
register()
from checkpoints_convert.common import geometry
from checkpoints_convert.mapping import hf_shapes, hf_to_megatron
from checkpoints_convert.megatron_io import save_dist_checkpoint
from nosa_layers.config import tiny_geometry
from nosa_layers.megatron.config import AttentionConfig
from tests.convert._cases import tiny_model
from checkpoints_convert import from_hf, to_hf, verify

root = Path(sys.argv[1])
model = tiny_model("llama3")
attn = AttentionConfig(variant="nosa", nosa=tiny_geometry(eviction_head=NAME), backend="reference")
gen = torch.Generator().manual_seed(0)
hf = {n: (1.0 if len(s) == 1 else 0.0) + 0.2 * torch.randn(*s, generator=gen)
      for n, s in hf_shapes(geometry(model, attn), optional=False).items()}
save_dist_checkpoint(hf_to_megatron(hf, geometry(model, attn)), root / "trained", model, attn)
assert to_hf.main(["--ckpt", str(root / "trained"), "--out", str(root / "export")]) == 0
assert from_hf.main(["--hf", str(root / "export"), "--out", str(root / "imported")]) == 0
assert to_hf.main(["--ckpt", str(root / "imported"), "--out", str(root / "export_again")]) == 0
sys.exit(verify.main(["--hf", str(root / "export"), "--ckpt", str(root / "trained"), "--seq-len", "160",
                      "--random", "1", "--json", str(root / "verify.json")]))
"""


def test_new_head_converts_and_exports_with_no_other_edit(key_gate_head, tmp_path):
    log = tmp_path / "run.log"
    assert run([sys.executable, "-c", SCRIPT, str(tmp_path)], log, 240) == 0, tail(log)
    report = json.loads((tmp_path / "verify.json").read_text())
    assert report["tensor_roundtrip"] == "ok"
    assert report["logits_vs_megatron"]["rel"] <= 1e-4, report
    assert report["decode_vs_forward"]["rel"] <= 1e-4, report

    export, again = load_safetensors_dir(tmp_path / "export"), load_safetensors_dir(tmp_path / "export_again")
    assert set(export) == set(again) and all(torch.equal(export[k], again[k]) for k in export)
    head_params = {k.split("self_attn.", 1)[1]: tuple(v.shape) for k, v in export.items()
                   if k.startswith("model.layers.0.self_attn.") and not k.endswith("_proj.weight")}
    assert head_params == {"gain": (2,), "proj.weight": (1, 8)}  # named by the module, KV heads 2, D 8

    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["nosa_config"]["eviction_head"] == NAME
    shipped = (tmp_path / "export" / "nosa_eviction.py").read_text()
    assert "class KeyGateHead(EvictionHead):" in shipped and f"register_eviction_head({NAME!r})(KeyGateHead)" in shipped


def test_shipped_modules_keep_their_own_names_and_imports(monkeypatch):
    """Shipped modules are copied flat as ``nosa_<module>.py``: two modules that would share a file are
    refused instead of one silently replacing the other, and a module-level import of a module that exports
    do not ship (it would fail where the framework is not installed) is named."""
    from checkpoints_convert import hf_modeling

    names = [hf_modeling.shipped_name(m) for m in hf_modeling.SHIPPED]
    assert len(set(names)) == len(names) and not set(hf_modeling.OWN_FILES) & set(names)
    monkeypatch.setattr(hf_modeling, "SHIPPED", (*hf_modeling.SHIPPED, "inference.decode"))
    with pytest.raises(RuntimeError, match="name clash: inference.decode would ship as nosa_decode.py"):
        hf_modeling.reference_sources()
    src = "import torch\nfrom nosa_layers.selection import select_rows\nfrom nosa_layers.ops.topk import stages_torch\n"
    with pytest.raises(RuntimeError, match="x.py imports nosa_layers.ops.topk at module level"):
        hf_modeling.rewrite_source(src, "x.py")
    inner = src.replace("from nosa_layers.ops", "def f():\n    from nosa_layers.ops")
    assert hf_modeling.rewrite_source(inner, "x.py").splitlines()[1:] == [
        "from .nosa_selection import select_rows", "def f():",
        '    _mod = __import__("importlib").import_module("nosa_layers.ops.topk"); stages_torch = _mod.stages_torch']
    with pytest.raises(RuntimeError, match="could not make 1 import"):
        hf_modeling.rewrite_source("import inference.block_cache\n", "y.py")
