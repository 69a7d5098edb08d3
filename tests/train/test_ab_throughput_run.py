"""``bench.probes.ab_throughput`` end to end on the CPU: each side trains from its own checkout under the same
harness, and the summary tells the sides apart (a baseline whose recipe differs logs other losses). Each run
is one layer at 128 tokens: what is compared is the harness's bookkeeping, not the model."""

import json
import subprocess
import sys

from bench.probes import ab_throughput as ab
from tests.subproc import REPO
from tests.subproc import child_env


def test_each_side_runs_its_own_checkout(tmp_path, demo_data):
    baseline = tmp_path / "baseline"
    ab.export_revision(REPO, ab.resolve_commit(REPO, "HEAD"), baseline)
    recipe = baseline / "recipes" / "recipe" / "tiny_cpt.yaml"
    text = recipe.read_text()
    assert "attention_factor: 1.060660" in text
    recipe.write_text(text.replace("attention_factor: 1.060660", "attention_factor: 1.5"))  # other logits
    out = tmp_path / "ab"
    p = subprocess.run(
        [sys.executable, "-m", "bench.probes.ab_throughput", "--baseline-src", str(baseline), "--out", str(out),
         "--repeats", "1", "--runs", "nosa_1gpu", "--", "--recipe", "tiny_cpt", "--layers", "1", "--seq", "128",
         "--steps", "3", "--warmup", "1", "--data", demo_data["indexed_prefix"], "--tokenizer", demo_data["tokenizer"]],
        capture_output=True, text=True, timeout=600, env=child_env(), cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "ab_throughput.json").read_text())
    assert doc["complete"] is True and doc["order"] == ["baseline 1", "candidate 1"]
    assert [e["source"] for e in doc["env"]["baseline"]] == [str(baseline)]
    assert [e["source"] for e in doc["env"]["candidate"]] == [str(REPO)]
    assert doc["sides"]["baseline"]["commit"] is None and doc["sides"]["candidate"]["path"] == str(REPO)
    (row,) = doc["summary"]
    assert row["run"] == "nosa_1gpu" and row["beyond_spread"] is None  # one repeat: no spread to compare with
    assert all(len(v) == 1 and v[0] > 0 for v in row["tokens_per_s"].values())
    base, cand = doc["results"]["baseline"][0][0]["losses"], doc["results"]["candidate"][0][0]["losses"]
    assert len(base) == len(cand) == 3 and base != cand and row["losses_identical"] is False
    assert "| nosa_1gpu |" in p.stdout and "one repeat: unknown" in p.stdout


def test_a_failed_run_stops_the_comparison_and_keeps_the_runs_before_it(tmp_path, demo_data):
    broken = tmp_path / "broken"
    (broken / "train").mkdir(parents=True)
    (broken / "train" / "main.py").write_text("import sys\nsys.exit(3)\n")
    out = tmp_path / "ab"
    p = subprocess.run(
        [sys.executable, "-m", "bench.probes.ab_throughput", "--baseline-src", str(REPO), "--candidate-src",
         str(broken), "--out", str(out), "--repeats", "1", "--runs", "nosa_1gpu", "--", "--recipe", "tiny_cpt",
         "--layers", "1", "--seq", "128", "--steps", "3", "--warmup", "1", "--data", demo_data["indexed_prefix"],
         "--tokenizer", demo_data["tokenizer"]], capture_output=True, text=True, timeout=600, env=child_env(), cwd=REPO)
    assert p.returncode == 1 and "candidate repeat 1 failed" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((out / "ab_throughput.json").read_text())
    assert doc["complete"] is False and doc["summary"] == [] and doc["results"]["candidate"] == []
    (run,) = doc["results"]["baseline"][0]
    assert run["run"] == "nosa_1gpu" and run["tokens_per_s"] > 0 and len(run["losses"]) == 3


def test_two_settings_of_one_checkout_differ_only_by_their_overrides(tmp_path, demo_data):
    out = tmp_path / "ab"
    p = subprocess.run(
        [sys.executable, "-m", "bench.probes.ab_throughput", "--out", str(out), "--repeats", "1",
         "--runs", "nosa_1gpu", "--baseline-overrides", "optim.lr=1e-4", "--candidate-overrides", "optim.lr=3e-3",
         "--", "--recipe", "tiny_cpt", "--layers", "1", "--seq", "128", "--steps", "3", "--warmup", "1",
         "--data", demo_data["indexed_prefix"], "--tokenizer", demo_data["tokenizer"], "--extra", "optim.min_lr=0"],
        capture_output=True, text=True, timeout=600, env=child_env(), cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "ab_throughput.json").read_text())
    assert [e["source"] for side in ("baseline", "candidate") for e in doc["env"][side]] == [str(REPO)] * 2
    assert doc["sides"]["baseline"]["overrides"] == ["optim.lr=1e-4"]
    assert doc["sides"]["candidate"]["overrides"] == ["optim.lr=3e-3"]
    base, cand = doc["results"]["baseline"][0][0]["losses"], doc["results"]["candidate"][0][0]["losses"]
    assert base[0] == cand[0] and base[1:] != cand[1:]  # the same first step; the learning rates part them
    assert doc["summary"][0]["losses_identical"] is False
    import yaml

    for side, lr in (("baseline", 1e-4), ("candidate", 3e-3)):  # each side's own override and the shared --extra
        optim = yaml.safe_load((out / f"{side}_1" / "nosa_1gpu" / "config.yaml").read_text())["optim"]
        assert (optim["lr"], optim["min_lr"]) == (lr, 0), (side, optim)
