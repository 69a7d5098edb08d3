"""Hydra's command line on train/main.py: --help, --cfg job, -m sweeps (each job its own run dir),
typed schema errors with the nearest key; and what a multirun logs (interval means, ETA, peak memory)."""

import math

import pytest
import yaml

from tests.train.conftest import losses, metrics, run_main, train_here
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
    p = train_here(["-m", *TINY, *data_args, "train.max_steps=4", "train.log_interval=1,2", f"run.dir={sweep}",
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


def _summary(text: str) -> dict[str, list[str]]:
    """The rows of the multirun summary table: job name -> cells."""
    lines = text[text.rindex("[multirun] summary of"):].splitlines()[3:]
    return {cells[0]: cells for cells in (ln.split() for ln in lines if ln.strip() and not ln.startswith("["))}


def _wandb_runs(run_dir) -> list[str]:
    return sorted(p.name.rsplit("-", 2)[-2] + "-" + p.name.rsplit("-", 1)[-1]
                  for p in (run_dir / "wandb").glob("offline-run-*"))


def test_multirun_headers_summary_and_a_rerun_skips_finished_jobs(tmp_path, data_args):
    """Each job gets a header (overrides, run dir) and the sweep ends with a table of every job's final loss,
    validation loss and tokens/s; re-running the sweep skips the finished jobs (nothing trained or validated,
    no W&B session); raising train.max_steps resumes each job in its own W&B run. The sweeps that train run in
    their own processes (W&B's service and console capture), the rerun in this one."""
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, *data_args, "train.max_steps=2", "run.seed=1,2", f"run.dir={sweep}", "logging.wandb=offline",
            "train.eval_iters=1"]
    jobs = [sweep / "run.seed=1", sweep / "run.seed=2"]
    first = run_main(args).stdout
    headers = [ln for ln in first.splitlines() if ln.startswith("[multirun] job")]
    for i, (line, d) in enumerate(zip(headers, jobs)):
        given, _, where = line.split(": ", 1)[1].rpartition(" -> ")
        assert line.startswith(f"[multirun] job {i + 1}/2: ") and where == f"run.dir={d}"
        assert sorted(given.lower().split()) == sorted(a.replace("run.seed=1,2", f"run.seed={i + 1}").lower()
                                                       for a in args[1:])
    table = _summary(first)
    assert list(table) == ["run.seed=1", "run.seed=2"]
    for name, d in zip(table, jobs):
        rows = metrics(d)
        last_loss = [r["loss"] for r in rows if r.get("loss") is not None][-1]
        val = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
        assert table[name][1:4] == ["trained", "2", f"{last_loss:.4f}"] and table[name][4] == f"{val:.4f}"
        assert float(table[name][5].replace(",", "")) > 0 and table[name][6] == str(d)
    ids = [(d / "wandb_id").read_text().strip() for d in jobs]
    logged = [(d / "metrics.jsonl").read_text() for d in jobs]

    again = train_here(args).stdout  # in this process: a rerun that trains nothing starts no W&B session
    assert again.count("already finished: its checkpoint is at step 2 = train.max_steps") == 2
    assert "training tiny_pretrain" not in again and "val_loss" not in again
    assert [(d / "metrics.jsonl").read_text() for d in jobs] == logged  # no validation pass appended
    assert [_wandb_runs(d) for d in jobs] == [[i] for i in ids]  # no new W&B session
    assert [row[1:4] for row in _summary(again).values()] == [["finished", "earlier:", "skipped"]] * 2

    longer = run_main([a.replace("train.max_steps=2", "train.max_steps=3") for a in args]).stdout
    assert longer.count("resumed from") == 2
    assert [_wandb_runs(d) for d in jobs] == [[i, i] for i in ids]  # the same W&B run, continued
    assert [row[1:3] for row in _summary(longer).values()] == [["trained", "3"]] * 2


def test_print_config_shows_the_config_not_the_switch_and_numbers_in_flow_style(capsys):
    """print_config=true prints the resolved config without print_config itself; the LongRoPE factors
    (64 numbers each) take a few lines in flow style; the YAML reads back to the same values."""
    import dataclasses

    from train.compose import load_config

    assert main(["recipe=nosa_1b_cpt", "print_config=true"]) == 0
    out = capsys.readouterr().out
    assert "print_config" not in out and "dry_run" not in out
    factors = [ln for ln in out.splitlines() if ln.strip().startswith(("short_factor:", "long_factor:"))]
    assert len(factors) == 2 and all(ln.split(":", 1)[1].strip().startswith("[") for ln in factors)
    assert len(out.splitlines()) < 200
    want = dataclasses.asdict(load_config(["recipe=nosa_1b_cpt"]))
    assert yaml.safe_load(out) == {k: v for k, v in want.items() if k not in ("print_config", "dry_run")}


def test_multirun_dry_run_says_which_job_each_block_is(tmp_path):
    """A dry-run sweep prints a header (overrides, run dir) before each job's verdict."""
    import subprocess
    import sys

    from tests.subproc import REPO, child_env

    p = subprocess.run([sys.executable, str(REPO / "train" / "main.py"), "-m", "recipe=tiny_cpt",
                        "attention=nosa_tiny,dense", "dry_run=true", f"run.dir={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True, env=child_env(), timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("[multirun] job")]
    blocks = [i for i, ln in enumerate(lines) if ln.startswith("dry run of tiny_cpt")]
    assert len(heads) == len(blocks) == 2 and heads[0] < blocks[0] < heads[1] < blocks[1]
    for head, value in zip(heads, ("nosa_tiny", "dense")):
        assert f"attention={value} " in lines[head] and lines[head].endswith(f"run.dir={tmp_path}/attention={value}")
    assert not list(tmp_path.iterdir())


def test_recipes_outside_the_checkout_with_config_dir(tmp_path):
    """--config-dir DIR: recipe groups laid out as recipes/ are found besides recipes/ (one run and a sweep)."""
    from train.cli import CliError, parse_cli
    from train.compose import expand_sweep, load_config

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "my_run.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\n  - override /attention: nosa_tiny\n"
        "train:\n  max_steps: 3\n")
    cli = parse_cli(["--config-dir", str(tmp_path), "recipe=my_run", "train.log_interval=2"])
    cfg = load_config(cli.compose_overrides)
    assert (cfg.recipe, cfg.train.max_steps, cfg.train.log_interval, cfg.attention.variant) == ("my_run", 3, 2, "nosa")
    jobs, swept = expand_sweep(parse_cli(["-cd", str(tmp_path), "recipe=my_run,tiny_pretrain"]).compose_overrides)
    assert swept == ["recipe"] and [load_config(j).train.max_steps for j in jobs][0] == 3
    with pytest.raises(CliError, match="--config-dir .*missing: not a directory"):
        parse_cli(["--config-dir", str(tmp_path / "missing"), "recipe=my_run"])
