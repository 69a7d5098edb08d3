"""``bench.train_throughput`` records which corpus a run read (``corpus_identity``): two builds
of the demo corpus on different machines differ, and their throughput ratios are not comparable."""

import json
from pathlib import Path

import pytest

from bench import train_throughput


def _corpus(tmp_path: Path, name: str, sizes: bytes, documents: int, tokens: int) -> str:
    prefix = tmp_path / name
    prefix.with_suffix(".idx").write_bytes(sizes)
    Path(str(prefix) + ".summary.json").write_text(json.dumps({"documents": documents, "tokens": tokens}))
    return str(prefix)


def test_the_corpus_identity_tells_two_builds_apart(tmp_path):
    identity = train_throughput.corpus_identity
    a = identity(_corpus(tmp_path, "a", b"\x01\x02\x03", 3, 300))
    assert a == {"prefix": "a", "idx_sha256": a["idx_sha256"], "documents": 3, "tokens": 300,
                 "mean_document_tokens": 100}
    assert len(a["idx_sha256"]) == 16
    b = identity(_corpus(tmp_path, "b", b"\x01\x02\x04", 3, 300))
    assert b["idx_sha256"] != a["idx_sha256"]  # same counts, other document sizes
    assert identity(_corpus(tmp_path, "c", b"\x01\x02\x03", 3, 300))["idx_sha256"] == a["idx_sha256"]


def test_a_missing_corpus_is_named_without_failing(tmp_path):
    assert train_throughput.corpus_identity(str(tmp_path / "nothing")) == {"prefix": "nothing"}


def test_step_times_are_fitted_against_the_attention_work_of_each_step():
    fit = train_throughput._fit
    work = [0.2, 0.5, 0.3, 0.9]
    assert fit(work, [0.8 + 0.5 * w for w in work]) == {"base_s": 0.8, "slope_s": 0.5, "r": 1.0}
    noisy = fit(work, [1.0, 0.9, 1.1, 1.0])  # times that do not follow the documents
    assert abs(noisy["r"]) < 0.5
    assert fit([1.0] * 4, [1.0, 1.2, 0.9, 1.1]) is None  # EOD packing: the work never varies
    assert fit([0.2, None, 0.3, 0.4], [1.0] * 4) is None and fit([0.2, 0.3], [1.0, 1.1]) is None


def test_steadiness_at_the_mean_work_takes_out_only_what_the_documents_explain():
    bench = train_throughput
    work = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    steps = [{"attention_work": w, "step_time_s": 0.8 + 0.4 * w} for w in work]
    fit = bench._fit(work, [r["step_time_s"] for r in steps])
    assert bench._p90_at_mean_work(steps, fit) == pytest.approx(1.0)  # all of the spread is the documents'
    steps[3]["step_time_s"] += 0.5  # one slow step the documents do not explain stays slow
    fit = bench._fit(work, [r["step_time_s"] for r in steps])
    assert bench._p90_at_mean_work(steps, fit) > 1.3
    assert bench._p90_at_mean_work(steps, None) is None


def test_every_run_takes_the_global_batch_asked_for():
    import argparse

    run_config = train_throughput.run_config
    a = argparse.Namespace(recipe="nosa_1b_cpt", data="d", tokenizer="t", steps=5, seq=1024, layers=2, out="o",
                           profile_step=0, extra=[], global_batch=8)
    for name in ("nosa_1gpu_nr", "dense_doc_1gpu", "nosa_tp2"):
        args, _ = run_config(name, a)
        assert [x for x in args if x.startswith("train.global_batch_size=")] == ["train.global_batch_size=8"]
        assert "train.micro_batch_size=1" in args


def test_rows_of_several_steps_count_every_step_they_cover():
    bench = train_throughput
    every = bench.with_steps_covered([{"step": s, "step_time_s": 1.0 + s / 10} for s in (1, 2, 3, 4)])
    assert [r["steps_covered"] for r in every] == [1, 1, 1, 1]
    assert bench.tokens_and_seconds(every[1:], 100) == (300, pytest.approx(1.2 + 1.3 + 1.4))
    logged = bench.with_steps_covered([{"step": 4, "step_time_s": 2.0}, {"step": 8, "step_time_s": 1.5},
                                       {"step": 12, "step_time_s": 1.0}])  # train.log_interval=4: interval means
    assert [r["steps_covered"] for r in logged] == [4, 4, 4]
    tokens, seconds = bench.tokens_and_seconds(logged[1:], 100)
    assert (tokens, seconds) == (800, pytest.approx(4 * 1.5 + 4 * 1.0))


def test_every_run_is_launched_at_each_length_with_each_loss():
    import argparse

    a = argparse.Namespace(runs="nosa_1gpu_nr,dense_1gpu", seq="16384,32768,300", loss_impl="fused,chunked")
    got = train_throughput.variants(a)
    assert [v[0] for v in got[:6]] == ["nosa_1gpu_nr_16k_fused", "nosa_1gpu_nr_16k_chunked", "nosa_1gpu_nr_32k_fused",
                                       "nosa_1gpu_nr_32k_chunked", "nosa_1gpu_nr_300_fused", "nosa_1gpu_nr_300_chunked"]
    assert got[7] == ("dense_1gpu_16k_chunked", "dense_1gpu", 16384, "chunked") and len(got) == 12
    # one length and no --loss-impl: the names as before (bench.probes.ab_throughput and speed_report read them)
    assert train_throughput.variants(argparse.Namespace(runs="nosa_1gpu", seq="16384", loss_impl=None)) == [
        ("nosa_1gpu", "nosa_1gpu", 16384, None)]
    args, _ = train_throughput.run_config("dense_1gpu_nr", argparse.Namespace(
        recipe="r", data="d", tokenizer="t", steps=4, global_batch=4, seq=32768, layers=14, out="o", profile_step=0,
        extra=[], loss_impl="chunked"), "dense_1gpu_nr_32k_chunked")
    assert {"train.loss_impl=chunked", "train.seq_length=32768", "run.dir=o/dense_1gpu_nr_32k_chunked",
            "train.recompute=none", "attention=dense"} <= set(args)


def test_losses_are_compared_with_the_first_loss_of_their_run_and_length():
    def ok(impl, seq, tps, peak, losses):
        return {"run": f"nosa_{seq}_{impl}", "base_run": "nosa", "seq": seq, "loss_impl": impl, "tokens_per_s": tps,
                "peak_mem_gib": peak, "losses": losses}

    results = [ok("fused", 16, 100.0, 70.0, [9.0, 8.5, 8.0]), ok("chunked", 16, 101.0, 60.0, [9.0, 8.5, 8.0001]),
               {"run": "nosa_32_fused", "base_run": "nosa", "seq": 32, "loss_impl": "fused", "returncode": 1,
                "out_of_memory": True},
               ok("chunked", 32, 50.0, 75.0, [9.0, 8.4]),
               {"run": "dense_32_chunked", "base_run": "dense", "seq": 32, "loss_impl": "chunked", "returncode": 3},
               {"run": "other", "skipped": "needs 2 GPUs"}]
    rows = train_throughput.compare_loss_impls(results)
    assert [(r["seq"], r["loss_impl"], r["status"]) for r in rows] == [
        (16, "fused", "ok"), (16, "chunked", "ok"), (32, "fused", "out of memory"), (32, "chunked", "ok")]
    assert rows[1]["tokens_per_s_ratio"] == pytest.approx(1.01) and rows[1]["peak_mem_saved_gib"] == 10.0
    assert rows[1]["max_abs_loss_diff"] == pytest.approx(1e-4) and rows[1]["steps_compared"] == 3
    assert rows[3]["tokens_per_s_ratio"] is None and rows[3]["peak_mem_gib"] == 75.0  # its base ran out of memory
    assert all(r["run"] != "dense" for r in rows)  # one loss only: nothing to compare
