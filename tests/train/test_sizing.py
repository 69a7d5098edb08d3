"""dry_run sizing: the per-GPU estimate agrees with the peaks measured on an H200 (never more than 5%
below, at most 10% above: it plans), the verdict
names what would fit, the world size is a flag, and a set WORLD_SIZE never makes it wait."""

import subprocess
import sys

import pytest

from tests.subproc import child_env
from tests.train.conftest import ROOT
from train.compose import load_config
from train.dry_run import GIB, estimate_memory


def _counts(cfg) -> dict:
    """Parameter counts of a Llama-shaped model (untied; the meta-device count is tested on the 8B)."""
    m = cfg.model
    h, d = m.hidden_size, m.kv_channels
    layer = (h * (m.num_attention_heads + 2 * m.num_kv_heads) * d + m.num_attention_heads * d * h
             + 3 * h * m.ffn_hidden_size + 2 * h)
    emb = m.padded_vocab_size * h
    return {"total": m.num_layers * layer + 2 * emb + h, "embedding": emb, "output": emb,
            "layers": m.num_layers * layer, "eviction": 0}


def _estimate_gib(overrides: list[str], world_size: int = 1) -> float:
    cfg = load_config(["recipe=nosa_1b_cpt", "train.global_batch_size=2", *overrides])
    return max(s.total for s in estimate_memory(cfg, _counts(cfg), world_size)) / GIB


# Peak allocated GiB of the 1B-shaped CPT at 16K (and 14 layers at 32K), micro-batch 1, global batch 2,
# one H200 (and TP=2 on two), measured in 2026-12: without ``train.fusions`` (``UNFUSED``) and with them.
UNFUSED, NR = "train.fusions=false", "train.recompute=none"
AT_32K = ["model.num_layers=14", "train.seq_length=32768", "model.max_position_embeddings=32768", NR]
MEASURED = [([UNFUSED], 1, 96.7), (["attention=dense", UNFUSED], 1, 95.6), ([NR, UNFUSED], 1, 94.6),
            (["attention=dense", NR, UNFUSED], 1, 95.6), (["parallel=tp2", UNFUSED], 2, 48.7),
            ([*AT_32K, UNFUSED], 1, 88.0), (["attention=dense", *AT_32K, UNFUSED], 1, 88.6),
            ([NR], 1, 77.9), (["attention=dense", NR], 1, 79.0),
            (AT_32K, 1, 75.6), (["attention=dense", *AT_32K], 1, 76.2)]


@pytest.mark.parametrize("overrides, world, peak", MEASURED)
def test_estimate_is_close_to_the_measured_peaks_and_rather_above(overrides, world, peak):
    got = _estimate_gib(overrides, world)
    assert -0.05 < (got - peak) / peak < 0.10, (overrides, got, peak)


def test_nosa_terms_scale_with_key_blocks_and_the_proof_model_is_small():
    cfg = load_config(["recipe=proof_cpt"])
    (only,) = estimate_memory(cfg, _counts(cfg), 1)
    assert only.total / GIB < 8  # 32M parameters at 16K: a few GiB (no s x s attention matrix)
    wide = load_config(["recipe=proof_cpt", "attention.nosa.block_size=32"])
    (w,) = estimate_memory(wide, _counts(wide), 1)
    assert w.parts["nosa"] == pytest.approx(2 * only.parts["nosa"], rel=0.01)  # twice the key blocks
    dense = load_config(["recipe=proof_cpt", "attention=dense"])
    assert estimate_memory(dense, _counts(dense), 1)[0].parts["nosa"] == 0


def test_logits_embedding_and_output_are_counted_at_pp1_and_split_at_pp2():
    (only,) = estimate_memory(cfg := load_config(["recipe=nosa_1b_cpt"]), c := _counts(cfg), 1)
    assert only.parts["weights"] == pytest.approx(2 * c["total"], rel=1e-4)  # embedding + output + layers
    assert only.parts["logits"] == pytest.approx(6 * 16384 * cfg.model.padded_vocab_size)
    first, last = estimate_memory(load_config(["recipe=nosa_1b_cpt", "parallel=pp2"]), c, 2)
    assert first.parts["logits"] == 0 and last.parts["logits"] == only.parts["logits"]
    assert first.parts["weights"] + last.parts["weights"] == pytest.approx(only.parts["weights"], rel=1e-4)
    assert first.parts["activations"] > last.parts["activations"]  # 2 micro-batches in flight on stage 1


def test_verdict_with_world_size_from_env_does_not_wait_for_peers():
    """TP=2 for the 8B on 8 GPUs does not fit 80 GiB; WORLD_SIZE=8 without torchrun gives the world size."""
    p = subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), "recipe=nosa_8b_cpt", "dry_run=true",
                        "parallel=tp2", "train.global_batch_size=8"], cwd=ROOT, capture_output=True, text=True,
                       env=child_env(WORLD_SIZE="8"), timeout=300, check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "layout valid for 8 GPUs (TP=2 PP=1 CP=1 DP=4)" in p.stdout
    assert "does not fit in 80 GiB" in p.stdout and "would fit: train.recompute=full" in p.stdout


@pytest.mark.parametrize("override, msg", [
    ("cluster.gpu_memory_gib=0", "cluster.gpu_memory_gib=0.0 must be > 0"),
    ("parallel.world_size=3", "world size 3 is not divisible by TP*PP*CP=8"),
    ("parallel.world_size=0", "parallel.world_size=0 must be >= 1 or null"),
])
def test_bad_sizing_input_is_one_line(override, msg, capsys):
    from train.main import main

    assert main(["recipe=nosa_8b_cpt", "dry_run=true", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: ") and msg in err and "\n" not in err
