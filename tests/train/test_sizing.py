"""dry_run sizing: the per-GPU estimate (train/memory_model.py) is within 3% of the peaks measured on an H200
and ranks NOSA and dense as measured; parameters are counted from the shapes exactly as megatron-core builds
them; any model size answers at once, and a size no GPU holds is refused in one line; the context-parallel
hook; the verdict names what would fit, the world size is a flag, and a set WORLD_SIZE never makes it wait."""

import json
import subprocess
import sys

import pytest

from tests.subproc import child_env, run_logged
from tests.train.conftest import ROOT
from train.compose import load_config
from train.dry_run import dry_run
from train.memory_model import (GIB, context_parallel_kv_bytes, estimate_memory, layer_bytes, logits_bytes,
                                loss_bytes, parameter_counts, sparse_index_bytes)


def _estimate_gib(overrides: list[str], world_size: int = 1) -> float:
    cfg = load_config([*overrides, "train.global_batch_size=8"])
    return max(s.total for s in estimate_memory(cfg, parameter_counts(cfg), world_size)) / GIB


# Peak allocated GiB (torch.cuda.max_memory_allocated) of one training run, micro-batch 1, as recorded in
# docs/BENCHMARKS.md ("Memory planner" lists each figure's result file): the layers as trained today
# (train.fusions, no recompute, one H200) with megatron-core's fused whole-logit loss, for NOSA and for dense
# attention with document masking (at 32K: EOD packing) ...
AT_32K = ["model.num_layers=14", "train.seq_length=32768", "model.max_position_embeddings=32768"]
NR, WHOLE_FUSED = "train.recompute=none", "train.loss_impl=fused"
FUSED = [(["recipe=nosa_1b_cpt", NR, WHOLE_FUSED], 77.30, 78.60),
         (["recipe=nosa_1b_cpt", NR, WHOLE_FUSED, *AT_32K], 75.19, 75.78),
         (["recipe=nosa_8b_cpt", NR, WHOLE_FUSED, "model.num_layers=4", "parallel=single"], 46.8, 47.1)]
# ... and earlier runs without the fusions (megatron-core's standard whole-logit loss), with selective recompute
# and at TP=2 with sequence parallelism
UNFUSED, SEL = "train.fusions=false", "train.recompute=selective"
ONE_B = ["recipe=nosa_1b_cpt", UNFUSED, "train.loss_impl=standard"]
EIGHT_B = ["recipe=nosa_8b_cpt", "model.num_layers=4", "parallel=single", UNFUSED, "train.loss_impl=standard"]
DENSE = "attention=dense"
EARLIER = [([*ONE_B, NR], 1, 94.58), ([*ONE_B, DENSE, NR], 1, 95.65), ([*ONE_B, SEL], 1, 96.73),
           ([*ONE_B, DENSE, SEL], 1, 95.56), ([*ONE_B, NR, *AT_32K], 1, 88.03),
           ([*ONE_B, DENSE, NR, *AT_32K], 1, 88.60),
           ([*EIGHT_B, NR], 1, 48.83), ([*EIGHT_B, DENSE, NR], 1, 49.07), ([*ONE_B, "parallel=tp2", SEL], 2, 48.7)]


@pytest.mark.parametrize("overrides, nosa, dense", FUSED)
def test_estimate_is_within_3_percent_of_the_measured_peaks_and_ranks_nosa_below_dense(overrides, nosa, dense):
    got_nosa, got_dense = _estimate_gib(overrides), _estimate_gib([*overrides, "attention=dense"])
    assert abs(got_nosa - nosa) / nosa < 0.03 and abs(got_dense - dense) / dense < 0.03, (got_nosa, got_dense)
    assert got_nosa < got_dense  # as measured


@pytest.mark.parametrize("overrides, world, peak", EARLIER)
def test_estimate_is_within_3_percent_of_the_earlier_peaks(overrides, world, peak):
    got = _estimate_gib(overrides, world)
    assert abs(got - peak) / peak < 0.03, (overrides, got, peak)


def test_recompute_modes_give_distinct_activation_estimates():
    acts = {r: estimate_memory(c := load_config(["recipe=nosa_1b_cpt", f"train.recompute={r}"]),
                               parameter_counts(c), 1)[0].parts["activations"] for r in ("none", "selective", "full")}
    assert len(set(acts.values())) == 3 and acts["full"] < acts["none"] < acts["selective"], acts


def test_sparse_index_grows_with_the_key_blocks_up_to_the_selection_budget():
    cfg = load_config(["recipe=proof_cpt"])  # 8 / 2 heads: 16-token tiles; 16 x 64-block budget > 256 blocks at 16K
    small = load_config(["recipe=proof_cpt", "attention.nosa.block_size=32"])
    assert sparse_index_bytes(small) == pytest.approx(2 * sparse_index_bytes(cfg), rel=0.02)  # twice the blocks
    capped = load_config(["recipe=proof_cpt", "attention.nosa.topk=8", "attention.nosa.select_blocks=4",
                          "attention.nosa.local_blocks=3"])  # lists of 16 x 8 = 128 entries, not the 256 blocks
    assert sparse_index_bytes(capped) == pytest.approx(sparse_index_bytes(cfg) / 2, rel=0.02)
    assert "sparse index" not in layer_bytes(load_config(["recipe=proof_cpt", "attention=dense"]), "dense")


def test_logits_embedding_and_output_are_counted_at_pp1_and_split_at_pp2():
    cfg = load_config(["recipe=nosa_1b_cpt", "train.global_batch_size=8", WHOLE_FUSED])
    c = parameter_counts(cfg)
    (only,) = estimate_memory(cfg, c, 1)
    assert only.parts["weights"] == pytest.approx(2 * c["total"], rel=1e-4)  # embedding + output + layers
    assert only.parts["loss"] == 16384 * logits_bytes(cfg) == 16384 * (10 * cfg.model.padded_vocab_size + 21)
    first, last = estimate_memory(load_config(["recipe=nosa_1b_cpt", "parallel=pp2", "train.global_batch_size=8",
                                               WHOLE_FUSED]), c, 2)
    assert "loss" not in first.parts and last.parts["loss"] == only.parts["loss"]
    assert first.parts["weights"] + last.parts["weights"] == pytest.approx(only.parts["weights"], rel=1e-4)
    assert first.parts["activations"] > last.parts["activations"]  # 2 micro-batches in flight on stage 1


def test_the_chunked_loss_keeps_its_gradients_and_one_chunk_instead_of_the_logits():
    """The default loss at 32K (1B shape, bf16, fused helpers): the hidden-state gradient, the fp32 weight
    gradient and one 4096-token chunk's logits instead of 10 bytes per token and vocabulary entry; sequence
    parallelism adds the gathered hidden states and splits the vocabulary."""
    base = ["recipe=nosa_1b_cpt", NR, *AT_32K]
    chunked, fused = load_config(base), load_config([*base, WHOLE_FUSED])
    assert chunked.train.loss_impl == "chunked" and chunked.train.loss_chunk_tokens == 4096
    V, h, t = 73448, 2048, 32768
    assert loss_bytes(chunked) == t * (2 * h + 16) + 4 * h * V + 4096 * V * 10
    assert loss_bytes(fused) == t * (10 * V + 21)
    assert (loss_bytes(fused) - loss_bytes(chunked)) / GIB > 18  # the whole logits: ~22.4 GiB -> ~3.5 GiB
    c = parameter_counts(chunked)
    (a,), (b,) = estimate_memory(chunked, c, 1), estimate_memory(fused, c, 1)
    assert b.total - a.total == pytest.approx(loss_bytes(fused) - loss_bytes(chunked))
    sp = load_config([*base, "parallel=tp2", "parallel.sequence_parallel=true", "train.loss_chunk_tokens=100000"])
    assert loss_bytes(sp) == t * (2 * 2 * h + 16) + 4 * h * V / 2 + t * V / 2 * 10  # the chunk capped at t
    unfused = load_config([*base, "train.fusions=false"])
    assert loss_bytes(unfused) == t * (2 * h + 16) + 4 * h * V + 4096 * V * 6


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_divides_the_activations_and_adds_the_gathered_keys_and_values(cp):
    """The hook context parallelism relies on (the trainer does not run CP > 1 yet): per rank, the layers'
    activations and the logits follow seq_length / CP, plus the other ranks' K and V per layer."""
    base = ["recipe=nosa_1b_cpt", "attention=dense", NR, WHOLE_FUSED]
    one, many = load_config(base), load_config([*base, f"parallel.context_parallel_size={cp}"])
    assert context_parallel_kv_bytes(one) == 0 and "context-parallel k, v" not in layer_bytes(one, "dense")
    gathered = 2 * 2 * 2 * 128 * (cp - 1)  # K and V, bf16, 2 KV heads of 128 channels, from CP-1 ranks
    assert context_parallel_kv_bytes(many) == gathered == layer_bytes(many, "dense")["context-parallel k, v"]
    c = parameter_counts(one)
    (a,), (b,) = estimate_memory(one, c, 1), estimate_memory(many, c, cp)
    tokens = 16384 // cp
    assert b.parts["activations"] == pytest.approx(a.parts["activations"] / cp + 28 * tokens * gathered)
    assert b.parts["loss"] == pytest.approx(a.parts["loss"] / cp)


def test_parameters_are_counted_from_the_shapes_as_megatron_builds_them(tmp_path):
    cases = {"tiny nosa fp32": ["recipe=tiny_cpt"], "tiny dense tied": ["recipe=tiny_cpt", "attention=dense",
                                                                          "model.tie_embeddings=true"],
             "locret with a pattern": ["recipe=tiny_cpt", "attention=nosa_evict_locret", "model.num_layers=3",
                                       "attention.layer_pattern=[dense,nosa,infllm_v2]"],
             "dma with bias": ["recipe=tiny_cpt", "attention=nosa_evict_dma", "attention.eviction_bias=true"],
             "8B shape, muP": ["recipe=nosa_8b_cpt", "model.num_layers=2", "parallel=single"]}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    rc = run_logged([sys.executable, ROOT / "tests" / "train" / "meta_counts.py", tmp_path / "out.json",
                     tmp_path / "cases.json"], tmp_path / "log", timeout_s=600, env=child_env())
    assert rc == 0, (tmp_path / "log").read_text()[-3000:]
    built = json.loads((tmp_path / "out.json").read_text())
    for name, overrides in cases.items():
        assert parameter_counts(load_config(overrides)) == built[name], name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override, verdict", [
    ("model.num_layers=100000", "does not fit in 80 GiB: ~"),
    ("model.hidden_size=1000000", "does not fit in 80 GiB: ~"),
    ("model.num_layers=1000000000", "does not fit: no GPU holds this model on 1 GPU ("),
])
def test_any_model_size_answers_from_its_shapes(override, verdict, capsys, monkeypatch):
    """Nothing proportional to the model is built or allocated (a meta-device build of 10^5 layers took
    minutes and gigabytes): no model is built at all."""
    import nosa_layers.megatron

    def no_build(*args, **kwargs):
        raise AssertionError("dry_run built the model")

    monkeypatch.setattr(nosa_layers.megatron, "build_model", no_build)
    assert dry_run(load_config(["recipe=tiny_cpt", "dry_run=true", override])) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(verdict), out


def test_a_size_no_gpu_holds_is_refused_in_one_line(capsys):
    assert dry_run(load_config(["recipe=nosa_8b_cpt", "dry_run=true", "model.hidden_size=1000000"])) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("does not fit: no GPU holds this model on 8 GPUs (") and "\n" not in out
    assert "use more GPUs or a smaller model" in out


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
