"""eval.compare on training runs and eval outputs written here in the formats the tools write: the
numbers of each column come from its own dirs, the best value of a row is marked, what a column lacks
is ``-``, and bad arguments are one line."""

from __future__ import annotations

import json

import pytest

from eval.compare import compare, main


def _run(d, losses, val, speeds):
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "tokens_per_s": s, "peak_mem_gib": 1.5 + i} for i, (loss, s) in
            enumerate(zip(losses, speeds))]
    rows.append({"step": len(losses), "val_loss": val})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')  # cut line
    return d


def _evals(d, average, by_task, ppl):
    d.mkdir(parents=True)
    (d / "ruler.json").write_text(json.dumps({"average": average, "by_task": by_task, "by_length": {"512": average}}))
    (d / "ppl.json").write_text(json.dumps({"overall": {"ppl": ppl}, "buckets": [
        {"range": "0-128", "ppl": ppl + 1}, {"range": "128-256", "ppl": ppl - 1}]}))
    return d


@pytest.fixture
def two_models(tmp_path):
    nosa_run = _run(tmp_path / "nosa_run", [3.0, 2.5, 2.0], 2.2, [100.0, 300.0, 500.0])
    dense_run = _run(tmp_path / "dense_run", [3.0, 2.6, 2.1], 2.1, [100.0, 200.0, 200.0])
    nosa_eval = _evals(tmp_path / "nosa_eval", 60.0, {"niah_single": 80.0, "vt": 40.0}, 5.0)
    dense_eval = _evals(tmp_path / "dense_eval", 70.0, {"niah_single": 90.0, "vt": 50.0, "cwe": 10.0}, 4.0)
    (nosa_eval / "locality.json").write_text(json.dumps({"dense": False, "summary": {
        "gamma_mean": 0.9, "bytes_per_token": 1e5, "throughput_ratio_vs_dense": 7.5}}))
    return [f"NOSA={nosa_run},{nosa_eval}", f"dense={dense_run},{dense_eval}"]


def test_columns_rows_and_best_values(two_models, tmp_path, capsys):
    got = compare(two_models, str(tmp_path / "out"))
    table = {(r["section"], r["metric"]): r["values"] for r in got["rows"]}
    assert [c["name"] for c in got["columns"]] == ["NOSA", "dense"]
    assert table[("training", "steps")] == [3, 3]
    assert table[("training", "final loss")] == [2.0, 2.1]
    assert table[("training", "validation loss")] == [2.2, 2.1]
    assert table[("training", "tokens/s")] == [400.0, 200.0]  # the first (warm-up) interval left out
    assert table[("training", "peak memory GiB")] == [3.5, 3.5]
    assert table[("RULER", "average")] == [60.0, 70.0]
    assert table[("RULER", "cwe")] == [None, 10.0]
    assert table[("RULER", "at 512 tokens")] == [60.0, 70.0]
    assert table[("perplexity", "positions 128-256")] == [4.0, 3.0]
    assert table[("locality", "decode throughput x dense")] == [7.5, None]
    md = capsys.readouterr().out
    assert md == (tmp_path / "out" / "compare.md").read_text().rstrip() + "\nwrote " + \
        f"{tmp_path / 'out'}/compare.md, compare.json, compare.png\n"
    assert "| final loss ↓ | **2.000** | 2.100 |" in md
    assert "| validation loss ↓ | 2.200 | **2.100** |" in md
    assert "| cwe ↑ | - | 10.000 |" in md  # one value only: nothing to compare
    assert "| peak memory GiB ↓ | 3.500 | 3.500 |" in md  # a tie: no best
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["rows"] == got["rows"]
    assert (tmp_path / "out" / "compare.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, msg", [
    (["{missing}"], "no such directory"),
    (["{empty}"], "none of metrics.jsonl, ruler.json, ppl.json, locality.json, result.json there"),
    (["a={run}", "a={run}"], "two columns are named 'a'; name them: NAME=DIR"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, msg):
    (tmp_path / "empty").mkdir()
    run = _run(tmp_path / "run", [1.0], 1.0, [1.0])
    argv = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty", run=run) for a in argv]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval.compare: error: ") and msg in err[0], err
    assert not (tmp_path / "out").exists()
