"""Preemption: a signal saves a checkpoint at the next step boundary on every rank, and the
resumed run continues bit for bit; bad cluster settings are one line."""

import os
import signal

import pytest
import torch.multiprocessing as mp

from tests.train.conftest import losses, run_main, sigusr1_through_the_launcher
from tests.train.test_train_runs import PRETRAIN

RUN = [*PRETRAIN, "train.eval_interval=0", "logging.plot=false", "checkpoint.interval=0", "train.max_steps=12"]


def _agree_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from train.preemption import StopSignal

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with StopSignal(["SIGTERM", "SIGUSR1"], torch.device("cpu")) as stop:
        before = stop.agreed()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 gets the signal
        dist.barrier()
        after = stop.agreed()
    still_handled = signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{before}|{after}|{still_handled}")
    dist.destroy_process_group()


def test_a_signal_on_one_rank_is_seen_by_every_rank_at_the_same_step(tmp_path):
    mp.start_processes(_agree_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    assert (tmp_path / "rank0").read_text() == "None|a signal on another rank|False"
    assert (tmp_path / "rank1").read_text() == "None|SIGUSR1|False"


def test_sigusr1_through_the_launcher_saves_at_the_next_step_and_resumes_bit_for_bit(tmp_path, data_args):
    reference = tmp_path / "reference"
    run_main([*RUN, *data_args, f"run.dir={reference}", "checkpoint.save=false"])  # its losses only

    run, text, step = sigusr1_through_the_launcher(tmp_path, [*RUN, *data_args], "job7")
    assert 1 <= step < 12
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"
    assert sorted(losses(run)) == list(range(1, step + 1))  # no step after the boundary it stopped at
    after = text.split("SIGUSR1 received")[1]  # the trainer exited 0; torchrun re-raises the signal it forwarded
    assert "ChildFailedError" not in after and "SignalException: Process" in after and "main.py" not in after

    p = run_main([*RUN, *data_args, f"run.dir={run}"])
    assert f"resumed from {run / 'checkpoints' / f'iter_{step:07d}'} at step {step}" in p.stdout
    assert losses(run) == losses(reference) and len(losses(reference)) == 12  # bitwise: same floats


@pytest.mark.parametrize("override, env, msg", [
    ("cluster.save_signals=[SIGFOO]", {}, "cluster.save_signals has ['SIGFOO']: give catchable signal names"),
    ("cluster.save_signals=[SIGKILL]", {}, "cluster.save_signals has ['SIGKILL']"),
    ("cluster.dist_timeout_minutes=0", {}, "cluster.dist_timeout_minutes=0.0 must be > 0"),
    ("parallel.world_size=4", {}, "parallel.world_size=4 but 1 processes were started"),
    ("train.max_steps=3", {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not: start the 2 processes with"),
])
def test_bad_cluster_settings_are_one_line(override, env, msg, monkeypatch, capsys):
    from train.main import main

    monkeypatch.delenv("RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["recipe=tiny_cpt", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: ") and msg in err and "\n" not in err
