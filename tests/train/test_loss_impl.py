"""``train.loss_impl`` end to end on the CPU: a few SFT steps (loss masks: prompt tokens do not count) of a tiny
NOSA model with tied embeddings give the same losses and gradient norms with each loss, and with the chunked loss
at TP=2 with sequence parallelism (2 processes); what each run took is in its model line. On the CPU ``fused``
runs megatron-core's unfused cross entropy (its fused one writes bf16 logit gradients: bf16 GPU runs only)."""

from __future__ import annotations

import math

import pytest

from tests.train.conftest import metrics, run_main, train_here

STEPS = 3
SFT = ["recipe=tiny_sft", "train.seq_length=256", "train.global_batch_size=2", f"train.max_steps={STEPS}",
       "optim.warmup_steps=1", "checkpoint.save=false", "model.tie_embeddings=true", "train.eval_interval=0",
       "train.eval_iters=0"]
CHUNKED = ["train.loss_impl=chunked", "train.loss_chunk_tokens=50"]  # 256 tokens: 5 chunks of 50 and one of 6
RTOL = 1e-5  # fp32: the loss and the gradient norm of every step
# TP=2 against one process: the layout's own summation order moves the gradient norm by ~4e-5 with either loss
# (the standard and the chunked loss at TP=2 give the same norms); tests/megatron/test_lm_loss.py compares
# every gradient of the two losses at TP=2
TP2_NORM_RTOL = 2e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_args) -> dict:
    root = tmp_path_factory.mktemp("loss_impl")
    out = {}
    for name, extra in (("standard", ["train.loss_impl=standard"]), ("fused", ["train.loss_impl=fused"]),
                        ("chunked", CHUNKED)):
        out[name] = (root / name, train_here([*SFT, *data_args, f"run.dir={root / name}", *extra]).stdout)
    tp2 = root / "chunked_tp2"
    out["chunked_tp2"] = (tp2, run_main([*SFT, *data_args, f"run.dir={tp2}", *CHUNKED,
                                         "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
                                        nproc=2).stdout)
    return out


def _steps(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(run_dir) if r.get("loss") is not None}


@pytest.mark.parametrize("name", ["fused", "chunked", "chunked_tp2"])
def test_every_loss_trains_like_the_standard_one(runs, name):
    want, got = _steps(runs["standard"][0]), _steps(runs[name][0])
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    for step, (loss, norm) in want.items():
        assert math.isclose(got[step][0], loss, rel_tol=RTOL), (step, got[step], (loss, norm))
        norm_rtol = TP2_NORM_RTOL if name.endswith("tp2") else RTOL
        assert math.isclose(got[step][1], norm, rel_tol=norm_rtol), (step, got[step], (loss, norm))
    assert want[STEPS][0] < want[1][0]  # it trains


def test_the_model_line_says_which_loss_ran(runs):
    assert "loss=standard, " in runs["standard"][1]
    assert "loss=standard (fused needs a bf16 GPU run), " in runs["fused"][1]
    assert "loss=chunked (50 tokens), " in runs["chunked"][1]
    assert "loss=chunked (50 tokens), " in runs["chunked_tp2"][1] and "TP=2" in runs["chunked_tp2"][1]


def test_the_benchmark_compares_the_losses_in_one_command(tmp_path, demo_data):
    """``bench.train_throughput --quick`` on the CPU (one length here, to keep it to two runs): both losses
    train, the comparison table has a row per loss with the same losses step by step."""
    import json
    import subprocess
    import sys

    from tests.subproc import REPO, child_env

    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--quick", "--out", str(out), "--seq", "256",
                        "--data", demo_data["indexed_prefix"], "--tokenizer", demo_data["tokenizer"],
                        "--extra", "train.loss_chunk_tokens=100"],
                       capture_output=True, text=True, timeout=600, env=child_env(), cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "train_throughput.json").read_text())
    assert [r["run"] for r in doc["results"]] == ["nosa_1gpu_standard", "nosa_1gpu_chunked"]
    assert all(r["returncode"] == 0 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 for r in doc["results"])
    rows = doc["loss_impl_comparison"]
    assert [(r["run"], r["seq"], r["loss_impl"], r["status"]) for r in rows] == [
        ("nosa_1gpu", 256, "standard", "ok"), ("nosa_1gpu", 256, "chunked", "ok")]
    assert rows[1]["steps_compared"] == 3 and rows[1]["max_abs_loss_diff"] <= 1e-4
    assert rows[1]["tokens_per_s_ratio"] > 0
    import yaml

    train = yaml.safe_load((out / "nosa_1gpu_chunked" / "config.yaml").read_text())["train"]
    assert (train["loss_impl"], train["loss_chunk_tokens"], train["seq_length"]) == ("chunked", 100, 256)
    assert "| nosa_1gpu | 256 | chunked | ok |" in p.stdout
