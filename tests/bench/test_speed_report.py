"""``bench.speed_report``: the speed targets judged from the benchmarks' stored H200 results (copies of the
result files ``docs/BENCHMARKS.md`` cites, in ``tests/assets/speed_report``), thresholds that can fail, and bad
inputs refused in one line."""

from __future__ import annotations

import json

import pytest

from bench import speed_report as m
from tests.subproc import REPO

RESULTS = REPO / "tests" / "assets" / "speed_report"
ATT_32K = RESULTS / "attention_nosa-32k32_h200_2026-12.json"
ATT_16K = RESULTS / "attention_nosa-16k16_h200_2026-12.json"
SELECTION = RESULTS / "selection-index_nosa-32k32-16k16_h200_2026-12.json"
TRAIN_16K = RESULTS / "train-16k_nosa-1b_h200_2026-12.json"
TRAIN_32K = RESULTS / "train-32k-8seq_nosa-1b-14l_h200_2026-12.json"


def _row(checks, target_start, where_start):
    (row,) = [c for c in checks if c["target"].startswith(target_start) and c["where"].startswith(where_start)]
    return row


def test_stored_h200_results_give_the_known_verdicts(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--attention", str(ATT_32K), str(ATT_16K), "--selection", str(SELECTION),
            "--train-16k", str(TRAIN_16K), "--train-32k", str(TRAIN_32K)]
    assert m.main(args) == 0
    doc = json.loads((tmp_path / "speed_report.json").read_text())
    checks = doc["checks"]
    assert _row(checks, "forward <=", "32K/32")["value"] == "1.312x" and _row(checks, "forward <=", "32K/32")["met"]
    assert _row(checks, "backward with", "16K/16")["value"] == "1.662x"
    assert _row(checks, "forward faster than Flex", "32K/32")["value"] == "4.447 vs 5.437 ms"
    assert _row(checks, "smooth selections per useful FLOP <= 1.3x P1 (backward)", "32K/32")["value"] == "1.099x"
    share = _row(checks, "selection <=", "32K/32")
    assert (share["value"], share["met"]) == ("45.4%", False)  # the one target not met
    assert _row(checks, "selection <=", "16K/16")["met"] is None  # the target is set at 32K/32 only
    assert _row(checks, "index build", "32K/32")["value"] == "0.1519 ms, sync-free"
    e2e = _row(checks, "NOSA >= 1.1x", "16K")
    assert e2e["value"].startswith("1.155x") and e2e["met"] is True
    assert _row(checks, "NOSA >= 1.4x", "32K")["value"].startswith("1.487x")
    assert _row(checks, "stretch", "32K")["met"] is False and _row(checks, "stretch", "32K")["stretch"] is True
    assert _row(checks, "NOSA peak memory", "16K")["value"] == "77.3 vs 78.6 GiB"
    assert (doc["met"], doc["not_met"], doc["stretch_met"], doc["stretch"]) == (20, 1, 0, 2)  # 1 shown only
    assert "| selection <= 20% of the sparse forward | 32K/32 | 45.4% | **no** |" in capsys.readouterr().out
    assert m.main([*args, "--strict"]) == 1


def test_without_a_selection_file_the_share_comes_from_the_same_run():
    rows = m.load_rows(ATT_32K)
    (share,) = [c for c in m.selection_checks(rows) if c["target"].startswith("selection")]
    p1 = next(r for r in rows if r["kind"] == "ours_p1_db")
    sel = next(r for r in rows if r["kind"] == "selection_breakdown")
    assert share["value"] == f"{sel['total_ms'] / p1['fwd_ms']:.1%}" == "51.1%"


def test_thresholds_fail_when_the_figures_do():
    rows = [
        {"kind": "ours_p1_db", "T": 32768, "HQ": 32, "fwd_ms": 6.0, "bwd_ms": 20.0, "fwd_x_ideal": 1.36,
         "bwd_x_ideal": 1.81},
        {"kind": "flex_p1_bias_grad", "T": 32768, "HQ": 32, "fwd_ms": 5.9, "bwd_ms": 21.0},
        {"kind": "ours_nosa_smooth_db", "T": 32768, "HQ": 32, "fwd_x_ideal": 1.36 * 1.31, "bwd_x_ideal": 1.81},
        {"kind": "selection_breakdown", "T": 32768, "HQ": 32, "total_ms": 1.0, "index_gpu_ms": 0.31,
         "prepare_sync_free": True, "selection_over_p1_forward": 0.19},
        {"kind": "selection_breakdown", "T": 16384, "HQ": 16, "total_ms": 1.0, "index_gpu_ms": 0.1,
         "prepare_sync_free": False},
    ]
    checks = m.kernel_checks(rows) + m.selection_checks(rows)
    met = lambda target, where="32K/32": _row(checks, target, where)["met"]  # noqa: E731
    assert met("forward <=") is False and met("backward with") is False
    assert met("forward faster than Flex") is False and met("backward faster than Flex") is True  # 6.0 vs 5.9 ms
    assert met("smooth selections per useful FLOP <= 1.3x P1 (forward)") is False  # 1.31x
    assert met("smooth selections per useful FLOP <= 1.3x P1 (backward)") is True
    assert met("selection <=") is True
    assert met("index build") is False  # 0.31 ms
    assert met("index build", "16K/16") is False  # a host sync
    doc = {"results": [{"run": "nosa_1gpu_nr", "tokens_per_s": 109.0, "p90_over_median": 1.2, "peak_mem_gib": 80.0},
                       {"run": "dense_1gpu_nr", "tokens_per_s": 100.0, "p90_over_median": 1.0, "peak_mem_gib": 79.0}]}
    assert [c["met"] for c in m.train_checks(doc, "16K")] == [False, False, False, False]


@pytest.mark.parametrize("args, message", [
    ([], "give --run, or result files"),
    (["--run", "--train-16k", str(TRAIN_16K)], "not both"),
    (["--attention", "no_such.json"], "no such file: no_such.json"),
])
def test_bad_command_lines_are_refused(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        m.main(["--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_result_without_a_nosa_dense_pair_is_one_line(tmp_path, capsys):
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"results": [{"run": "nosa_1gpu_nr", "tokens_per_s": 1.0}]}))
    assert m.main(["--out", str(tmp_path / "out"), "--train-16k", str(one)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 16K: needs one measured NOSA run and one dense run") and "\n" not in err
    assert m.main(["--out", str(tmp_path / "out"), "--attention", str(TRAIN_16K)]) == 2  # not an attention file
    assert "no 'rows' list" in capsys.readouterr().err


def _fake_step(tmp_path, name: str, source, result: str, rc: int = 0) -> tuple:
    """A stand-in benchmark for ``--run``: copies a stored result into its ``--out`` folder and exits ``rc``."""
    script = tmp_path / f"fake_{name}.py"
    script.write_text(
        "import shutil, sys\nfrom pathlib import Path\nout = Path(sys.argv[sys.argv.index('--out') + 1])\n"
        f"out.mkdir(parents=True)\nshutil.copy({str(source)!r}, out / {result!r})\nsys.exit({rc})\n")
    return name, [str(script)], result


def test_run_measures_each_benchmark_into_its_folder_then_reports(tmp_path, monkeypatch, capsys):
    steps = [_fake_step(tmp_path, "attention", ATT_32K, "attention_bench.json"),
             _fake_step(tmp_path, "selection", SELECTION, "attention_selection.json"),
             _fake_step(tmp_path, "train_16k", TRAIN_16K, "train_throughput.json"),
             _fake_step(tmp_path, "train_32k", TRAIN_32K, "train_throughput.json")]
    monkeypatch.setattr(m, "RUN_STEPS", steps)
    monkeypatch.setattr(m, "DEMO_CORPUS", tmp_path / "missing" / "corpus")
    with pytest.raises(SystemExit):
        m.main(["--out", str(tmp_path / "out"), "--run"])
    assert "run python -m data.demo_corpus" in capsys.readouterr().err
    (tmp_path / "corpus.idx").write_bytes(b"")
    monkeypatch.setattr(m, "DEMO_CORPUS", tmp_path / "corpus")
    out = tmp_path / "out"
    assert m.main(["--out", str(out), "--run"]) == 0
    doc = json.loads((out / "speed_report.json").read_text())
    assert doc["inputs"]["train"] == {"16K": str(out / "train_16k" / "train_throughput.json"),
                                      "32K": str(out / "train_32k" / "train_throughput.json")}
    assert _row(doc["checks"], "NOSA >= 1.4x", "32K")["value"].startswith("1.487x")
    with pytest.raises(SystemExit):  # the folders are taken now
        m.main(["--out", str(out), "--run"])
    assert "already holds attention, selection, train_16k, train_32k" in capsys.readouterr().err

    monkeypatch.setattr(m, "RUN_STEPS", [steps[0], _fake_step(tmp_path, "selection", SELECTION, "x.json", rc=3)])
    assert m.main(["--out", str(tmp_path / "out2"), "--run"]) == 1
    assert "selection failed (rc 3)" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "speed_report.json").exists()
