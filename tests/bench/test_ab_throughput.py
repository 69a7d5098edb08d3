"""``bench.probes.ab_throughput``: the run order, the summary of two sides, the export of a git revision and
the refusals of its command line (no training here; ``tests/train/test_ab_throughput_run.py`` runs it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.probes import ab_throughput as ab
from tests.subproc import REPO


def _result(run: str, tps: float, losses: list, idle: float | None = None) -> dict:
    r = {"run": run, "tokens_per_s": tps, "losses": losses}
    if idle is not None:
        r["gpu_idle"] = {"gpu_idle_ms_per_step": idle}
    return r


def test_pairs_alternate_who_goes_first():
    order = ab.run_order
    assert order(1) == [("baseline", 0), ("candidate", 0)]
    assert order(3) == [("baseline", 0), ("candidate", 0), ("candidate", 1), ("baseline", 1),
                        ("baseline", 2), ("candidate", 2)]


def test_summary_compares_the_means_with_the_spread_and_the_losses():
    summarize = ab.summarize
    loss = [9.0, 8.5]
    results = {"baseline": [[_result("a", 100.0, loss, 30.0), _result("b", 50.0, loss)],
                            [_result("a", 102.0, loss, 34.0), _result("b", 50.0, loss)]],
               "candidate": [[_result("a", 110.0, loss, 10.0), _result("b", 50.5, loss)],
                             [_result("a", 108.0, loss, 12.0), _result("b", 49.5, [9.0, 8.6])]]}
    a, b = summarize(results)
    assert a["run"] == "a" and a["tokens_per_s"] == {"baseline": [100.0, 102.0], "candidate": [110.0, 108.0]}
    assert a["change"] == pytest.approx(109.0 / 101.0 - 1)
    assert a["spread"] == pytest.approx({"baseline": 0.02, "candidate": 110.0 / 108.0 - 1})
    assert a["beyond_spread"] is True and a["losses_identical"] is True
    assert a["gpu_idle_ms_per_step"] == {"baseline": 32.0, "candidate": 11.0}
    assert b["change"] == pytest.approx(0.0) and b["beyond_spread"] is False
    assert b["losses_identical"] is False and "gpu_idle_ms_per_step" not in b
    one = summarize({"baseline": [[_result("a", 100.0, loss)]], "candidate": [[_result("a", 90.0, loss)]]})[0]
    assert one["change"] == pytest.approx(-0.1) and one["beyond_spread"] is None  # nothing to compare with
    skipped = summarize({"baseline": [[{"run": "a", "skipped": "needs 2 GPUs"}]],
                         "candidate": [[_result("a", 90.0, loss)]]})
    assert skipped == [{"run": "a", "not_measured": ["baseline 1"]}]
    assert "not measured: baseline 1" in ab.table(skipped)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",  # no user config:
                               "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}).stdout.strip()


def test_a_revision_is_exported_whole_and_an_unknown_one_is_refused(tmp_path):
    repo = tmp_path / "repo"
    (repo / "train").mkdir(parents=True)
    _git(tmp_path, "init", "-q", str(repo))
    (repo / "train" / "main.py").write_text("old\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "train" / "main.py").write_text("new\n")
    _git(repo, "commit", "-qam", "two")
    dest = tmp_path / "out" / "baseline_src"
    dest.parent.mkdir()
    assert ab.resolve_commit(repo, "HEAD~1") == first
    ab.export_revision(repo, first, dest)
    assert (dest / "train" / "main.py").read_text() == "old\n"
    assert [p.name for p in dest.parent.iterdir()] == ["baseline_src"]  # no temporary left behind
    assert ab.describe(dest) == {"path": str(dest), "commit": None, "dirty": None}  # an export, not a checkout
    assert ab.describe(repo)["commit"] == _git(repo, "rev-parse", "HEAD") and ab.describe(repo)["dirty"] is False
    (repo / "train" / "main.py").write_text("edited\n")
    assert ab.describe(repo)["dirty"] is True
    with pytest.raises(ValueError, match="not a commit"):
        ab.resolve_commit(repo, "no-such-revision")
    with pytest.raises(subprocess.CalledProcessError):  # git archive fails: no partial export is left
        ab.export_revision(repo, "0" * 40, tmp_path / "out" / "other")
    assert [p.name for p in dest.parent.iterdir()] == ["baseline_src"]


@pytest.mark.parametrize("args, message", [
    (["--baseline", "no-such-revision"], "not a commit"),
    (["--baseline-src", "{tmp}"], "has no train/main.py"),
    (["--baseline", "HEAD", "--repeats", "0"], "--repeats must be at least 1"),
    (["--baseline", "HEAD", "--", "--runs", "x"], "set by this script"),
    ([], "give --baseline REV or --baseline-src DIR"),
    (["--baseline-overrides", "a=1", "--candidate-overrides", "a=1"], "overrides that differ"),
    (["--candidate-overrides", "train.step_reads"], "overrides are Hydra key=value"),
])
def test_bad_command_lines_are_refused_before_any_run(tmp_path, args, message):
    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run([sys.executable, "-m", "bench.probes.ab_throughput", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert not out.exists()  # refused before anything was written


def test_an_output_folder_that_holds_files_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("not ours")
    p = subprocess.run([sys.executable, "-m", "bench.probes.ab_throughput", "--out", str(tmp_path),
                        "--baseline", "HEAD"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and "not empty" in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["keep.txt"]
