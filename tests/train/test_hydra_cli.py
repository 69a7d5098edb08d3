"""Hydra's command line on train/main.py: --help, --cfg job, -m sweeps (each job its own run dir),
typed schema errors with the nearest key; and what a multirun logs (interval means, ETA, peak memory)."""

import math

import pytest
import yaml

from tests.train.conftest import losses, metrics, run_main
from train.cli import CliError, job_run_dir, parse_cli
from train.main import main

TINY = ["recipe=tiny_pretrain", "train.seq_length=128", "train.global_batch_size=2", "train.micro_batch_size=1",
        "optim.warmup_steps=0", "checkpoint.interval=0", "logging.plot=false", "train.eval_interval=0"]


def test_help_lists_flags_and_every_group(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--cfg job" in out and "-m, --multirun" in out
    assert "attention: dense, infllm_v2, nosa" in out and "tiny_sft" in out


def test_cfg_job_prints_the_resolved_config_and_exits(capsys, tmp_path):
    assert main(["recipe=tiny_sft", "train.max_steps=7", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["max_steps"] == 7 and cfg["sft"]["seq_length"] == 512 and cfg["recipe"] == "tiny_sft"
    assert main(["-m", "recipe=tiny_cpt", "attention=nosa_tiny,dense", f"run.dir={tmp_path}", "--cfg", "job"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out.replace("\n# ", "\n---\n# ")) if d]
    assert [(d["attention"]["variant"], d["run"]["dir"]) for d in docs] == [
        ("nosa", f"{tmp_path}/attention=nosa_tiny"), ("dense", f"{tmp_path}/attention=dense")]
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("argv,msg", [
    (["recipe=tiny_cpt", "train.max_stepz=3"], "unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"),
    (["recipe=tiny_cpt", "train.max_steps=many"],
     "bad value 'train.max_steps=many': Value 'many' of type 'str' could not be converted to Integer"),
    (["recipe=tiny_cpt", "attention=nosaa"], "unknown attention 'nosaa'; available: ['dense', 'infllm_v2'"),
    (["-m", "recipe=tiny_cpt", "run.dir=a,b"], "run.dir cannot be swept"),
    (["recipe=tiny_cpt", "train.max_steps=1,2"], "add -m to sweep over the values"),
    (["recipe=tiny_cpt", "--cfg", "hydra"], "--cfg hydra is not supported: use --cfg job"),
    (["recipe=tiny_cpt", "--info"], "unknown argument '--info'"),
])
def test_bad_command_lines_are_one_line(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err


def test_multirun_dirs_follow_the_swept_keys():
    assert job_run_dir(None, "tiny_cpt", ["recipe=tiny_cpt", "attention=dense", "train.seed=3"], ["attention"]) == \
        "runs/tiny_cpt/attention=dense"
    assert job_run_dir(None, "tiny_cpt", ["recipe=tiny_cpt", "x=1"], ["recipe"]) == "runs/tiny_cpt"
    assert job_run_dir("out", "a", ["recipe=a", "data.paths=[/d/x]"], ["recipe", "data.paths"]) == \
        "out/data.paths=[_d_x],recipe=a"
    assert parse_cli(["-m", "--cfg=job", "a=1"]).multirun and parse_cli(["-c", "job"]).cfg == "job"
    with pytest.raises(CliError):
        parse_cli(["--cfg"])


def test_multirun_trains_each_job_in_its_own_dir_with_interval_means(tmp_path, data_args):
    """-m over train.log_interval: the log_interval=2 job logs the mean of the two steps the
    log_interval=1 job logs one by one (same seed, same data); a torch.profiler trace of step 3."""
    sweep = tmp_path / "sweep"
    p = run_main(["-m", *TINY, *data_args, "train.max_steps=4", "train.log_interval=1,2", f"run.dir={sweep}",
                  "profile.start_step=3", "profile.num_steps=1", "checkpoint.save=false"])  # no test reads one
    assert p.stdout.count("[multirun] job") == 2 and "ETA" in p.stdout
    one, two = sweep / "train.log_interval=1", sweep / "train.log_interval=2"
    assert yaml.safe_load((two / "config.yaml").read_text())["train"]["log_interval"] == 2
    per_step, means = losses(one), losses(two)
    assert sorted(per_step) == [1, 2, 3, 4] and sorted(means) == [2, 4]
    for s in (2, 4):
        assert means[s] == pytest.approx((per_step[s - 1] + per_step[s]) / 2, rel=1e-12, abs=0)
    rows = [r for r in metrics(two) if "loss" in r]
    assert all(r["peak_mem_gib"] > 0 and r["eta_s"] >= 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["eta_s"] == 0 and math.isclose(rows[0]["eta_s"], 2 * rows[0]["step_time_s"])
    assert (one / "profile" / "trace.json").stat().st_size > 0 and (two / "profile" / "summary.json").is_file()
