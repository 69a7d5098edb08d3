"""Logged rows: interval means, ETA, peak memory as the max over ranks, W&B run ids, TensorBoard."""

import importlib.util
import json
import math
import os

import pytest
import torch.multiprocessing as mp

from train.compose import load_config
from train.config import validate
from train.metrics import IntervalStats, format_eta, max_over_ranks, wandb_run_id


def test_interval_means_leave_out_non_finite_losses_and_give_an_eta():
    s = IntervalStats()
    for loss, dt in ((2.0, 1.0), (float("nan"), 3.0), (4.0, 2.0)):
        s.add(loss, dt)
    row = s.flush(tokens_per_step=600, steps_left=10)
    assert row["loss"] == 3.0 and row["step_time_s"] == 2.0 and row["tokens_per_s"] == 300.0 and row["eta_s"] == 20.0
    s.add(float("inf"), 1.0)
    assert math.isnan(s.flush(600, 0)["loss"])  # a fresh interval: nothing finite in it
    assert [format_eta(x) for x in (5, 184, 7380, 93784, float("nan"))] == ["5s", "3m04s", "2h03m", "1d02h03m", "-"]


def test_attention_work_follows_the_documents_of_the_step():
    """sum(len^2) / S^2 per row, averaged over the step's micro-batches; 1.0 without ``cu_seqlens``."""
    import numpy as np

    from data.packing import collate
    from train.metrics import causal_attention_work

    def row(cu):
        return {"tokens": np.zeros(128), "labels": np.zeros(128), "position_ids": np.zeros(128),
                "loss_mask": np.ones(128), "cu_seqlens": np.array(cu)}

    halves, one, thirds = row([0, 64, 128]), row([0, 128]), row([0, 32, 64, 128])
    assert causal_attention_work([collate([halves])]) == 0.5
    assert causal_attention_work([collate([halves, one])]) == 0.75  # rows of one micro-batch
    assert causal_attention_work([collate([thirds]), collate([one])]) == (0.375 + 1.0) / 2
    eod = {k: v for k, v in one.items() if k != "cu_seqlens"}
    assert causal_attention_work([collate([eod])]) == 1.0
    s = IntervalStats()
    s.add(1.0, 1.0, 0.5)
    s.add(1.0, 1.0, 0.25)
    assert s.flush(10, 0)["attention_work"] == 0.375
    s.add(1.0, 1.0)
    assert "attention_work" not in s.flush(10, 0)


def test_wandb_id_is_unique_per_run_and_kept_across_a_resume(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = wandb_run_id(a, "nosa_8b/cpt", resumed=False)
    assert first.startswith("nosa_8b_cpt-") and (tmp_path / "a" / "wandb_id").read_text().strip() == first
    assert wandb_run_id(a, "nosa_8b/cpt", resumed=True) == first  # resume of the same run
    assert wandb_run_id(b, "nosa_8b/cpt", resumed=False) != first  # same recipe, another run dir (sweep, resubmit)
    assert wandb_run_id(b, "x", resumed=True) != first
    restarted = wandb_run_id(a, "nosa_8b/cpt", resumed=False)  # started over in the same dir: a new W&B run
    assert restarted != first and wandb_run_id(a, "nosa_8b/cpt", resumed=True) == restarted
    assert sorted(os.listdir(tmp_path / "a")) == ["wandb_id"]  # written atomically, no temporary left


WANDB_SCRIPT = """
import sys
from train.metrics import MetricsLogger
m = MetricsLogger(sys.argv[1], enabled=True, wandb_mode="offline", run_name="tiny", config={"a": 1})
for step in (1, 2):
    m.log({"step": step, "loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 10.0})
m.close()
print("closed")
"""


def test_an_offline_wandb_session_is_one_line_naming_the_run_and_its_sync_command(tmp_path, monkeypatch):
    """W&B offline prints its banner, run history and summary (about 20 lines a job, 27 for a training run): one
    line instead, where the run lives and how to upload it; not when the user set how W&B prints."""
    import subprocess
    import sys

    from tests.subproc import REPO, child_env
    from train.metrics import wandb_offline_line, wandb_silent

    env = {k: v for k, v in child_env().items() if k not in ("WANDB_SILENT", "WANDB_QUIET", "WANDB_SHOW_INFO")}
    p = subprocess.run([sys.executable, "-c", WANDB_SCRIPT, str(tmp_path / "run")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (runs[0] / f"run-{(tmp_path / 'run' / 'wandb_id').read_text().strip()}.wandb").is_file()
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert lines == [wandb_offline_line(str(runs[0])), "closed"], lines
    for k in ("WANDB_SILENT", "WANDB_QUIET", "WANDB_SHOW_INFO"):
        monkeypatch.delenv(k, raising=False)
    assert wandb_silent("offline") and not wandb_silent("online") and not wandb_silent("disabled")
    monkeypatch.setenv("WANDB_QUIET", "false")  # the user chose how W&B prints: its own output
    assert not wandb_silent("offline")


def _max_rank(rank, init, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    got = max_over_ranks([0.5, 7.25, 3.0][rank], torch.device("cpu"))
    with open(os.path.join(out, f"r{rank}"), "w") as f:
        f.write(repr(got))
    dist.destroy_process_group()


def _one_rank(rank, init, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)

    def collective(*args, **kwargs):
        raise AssertionError("a collective with one rank")

    dist.all_reduce = collective
    with open(os.path.join(out, "r0"), "w") as f:
        f.write(repr(max_over_ranks(2.5, torch.device("cpu"))))
    dist.destroy_process_group()


def test_one_rank_is_its_own_max_without_a_collective(tmp_path):
    mp.start_processes(_one_rank, args=(f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=1, join=True,
                       start_method="fork")
    assert float((tmp_path / "r0").read_text()) == 2.5


def test_peak_memory_is_the_max_over_all_ranks(tmp_path):
    mp.start_processes(_max_rank, args=(f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=3, join=True,
                       start_method="fork")
    assert [float((tmp_path / f"r{r}").read_text()) for r in range(3)] == [7.25, 7.25, 7.25]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed here")
def test_tensorboard_without_the_package_is_one_line():
    cfg = load_config(["recipe=tiny_cpt", "logging.tensorboard=true"])
    with pytest.raises(ValueError) as e:
        validate(cfg, check_files=False)
    assert "pip install tensorboard" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard package")
def test_tensorboard_writer_records_logged_rows(tmp_path):
    """Every numeric field of a logged row is a scalar at its step (no step, flags or non-finite values);
    a resumed run's logger drops the events past its checkpoint, as metrics.jsonl does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.metrics import MetricsLogger

    def scalars(tag: str) -> list[tuple[int, float]]:
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    log = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    log.log({"step": 1, "loss": 2.5, "lr": 1e-3, "skipped": False, "grad_norm": float("nan")})
    log.log({"step": 2, "loss": 2.25, "lr": 2e-3, "skipped": False, "grad_norm": 0.5})
    log.log({"step": 3, "loss": 2.0, "lr": 3e-3, "skipped": False, "grad_norm": 0.25})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr", "grad_norm"}
    assert scalars("loss") == [(1, 2.5), (2, 2.25), (3, 2.0)]
    assert scalars("grad_norm") == [(2, 0.5), (3, 0.25)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 2.5

    again = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True, resume_step=1)  # resumed at step 1
    again.log({"step": 2, "loss": 1.75, "lr": 2e-3})
    again.close()
    assert scalars("loss") == [(1, 2.5), (2, 1.75)]
