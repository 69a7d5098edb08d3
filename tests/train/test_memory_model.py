"""``train/memory_model.py`` against what a tiny model really keeps: the bytes per token counted on the CPU
(``tests/train/kept_bytes.py``: the GPU code paths, NOSA's kernels under the Triton interpreter) equal the
formula's terms for each attention type and recompute mode (fused layers, bf16), in fp32 (NOSA) and for unfused
layers (each attention type without recompute)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.subproc import child_env, run_logged
from tests.train.conftest import ROOT
from train.compose import load_config
from train.memory_model import LOSS_BOOKKEEPING, layer_bytes, micro_batch_bytes

# Every recompute mode of both attention types (fused), fp32 once, and the unfused layers once per attention type
# (no recompute): the unfused terms (norms, RoPE tables, SwiGLU, the eviction head's fp32 copies) are the same
# under selective recompute, whose NOSA-specific terms (the QKV projection and the selection instead of the value
# copy) the fused selective case counts; each NOSA case costs ~12 CPU-s of Triton interpreter.
CASES = [f"{v}:{r}:bf16:fused" for v in ("nosa", "dense") for r in ("none", "selective", "full")] + [
    "nosa:none:fp32:fused", "nosa:none:bf16:unfused", "dense:none:bf16:unfused"]


def case_overrides(case: str) -> list[str]:
    """``variant:recompute:precision:fusions`` -> overrides of a 2-layer ``tiny_cpt`` at 128 tokens."""
    variant, recompute, precision, fusions = case.split(":")
    return ["recipe=tiny_cpt", "model.num_layers=2", "train.seq_length=128", f"train.recompute={recompute}",
            f"train.precision={precision}", f"train.fusions={fusions == 'fused'}",
            *(["attention=dense"] if variant == "dense" else [])]


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("kept")
    cases, out, log = tmp / "cases.json", tmp / "kept.json", tmp / "kept.log"
    cases.write_text(json.dumps({c: case_overrides(c) for c in CASES}))
    rc = run_logged([sys.executable, ROOT / "tests" / "train" / "kept_bytes.py", out, cases], log, timeout_s=1500,
                    env=child_env())
    assert rc == 0, log.read_text()[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_layer_keeps_what_the_formula_says(counted, case):
    """The second layer (no per-micro-batch tensors in it) against :func:`layer_bytes`, with the
    interpreter's two-block dK/dV key groups and no Hopper bias."""
    cfg = load_config(case_overrides(case))
    variant, recompute = case.split(":")[:2]
    terms = layer_bytes(cfg, variant, recompute, key_group_blocks=2, hopper=False)
    assert counted[case]["layer1"] == pytest.approx(sum(terms.values()), rel=2e-3), terms


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_micro_batch_and_the_loss_keep_what_the_formula_says(counted, case):
    """Embedding output, RoPE tables and final norm (what the first layer holds beyond the second one is
    the micro-batch's RoPE tables and positions); the cross entropy keeps the fp32 softmax."""
    cfg = load_config(case_overrides(case))
    got = counted[case]
    outside = got["embedding"] + got["layer0"] - got["layer1"] + got["final"]
    assert outside == pytest.approx(micro_batch_bytes(cfg, first=True, last=True), rel=2e-3)
    assert got["output"] == 4 * cfg.model.padded_vocab_size + LOSS_BOOKKEEPING


def test_recompute_modes_keep_different_sets():
    """none / selective / full differ for both attention types, in the direction the layers go: NOSA's
    selective keeps the whole QKV projection and the selection (more), dense's drops the log-sum-exp."""
    cfg = load_config(["recipe=nosa_1b_cpt"])
    per = {(v, r): sum(layer_bytes(cfg, v, r).values()) for v in ("nosa", "dense")
           for r in ("none", "selective", "full")}
    assert per["nosa", "selective"] > per["nosa", "none"] > per["nosa", "full"]
    assert per["dense", "none"] > per["dense", "selective"] > per["dense", "full"]
    assert per["nosa", "none"] < per["dense", "none"]  # the value copy instead of the whole QKV projection
