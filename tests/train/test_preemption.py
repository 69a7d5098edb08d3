"""Preemption and lost ranks: a signal saves a checkpoint at the next step boundary on every rank, and the
resumed run continues bit for bit; a rank killed mid-step is named in one line by a survivor and torchrun's
restart resumes bit for bit; bad cluster settings are one line. The 2-rank runs read the steps' values at the
logs only (``train.step_reads=at_log``, every step unless said otherwise) and share one uninterrupted reference."""

import os
import re
import signal
import socket
import time

import math

import pytest
import torch.multiprocessing as mp

from tests.train.conftest import losses, run_main, run_main_and_act, sigusr1_through_the_launcher, train_here
from tests.train.test_train_runs import PRETRAIN

RUN = [*PRETRAIN, "train.eval_interval=0", "logging.plot=false", "checkpoint.interval=0", "train.max_steps=12"]
AT_LOG = [*RUN, "train.step_reads=at_log"]


@pytest.fixture(scope="module")
def uninterrupted_2ranks(tmp_path_factory, data_args) -> dict:
    """The per-step losses of AT_LOG (read every step) on 2 ranks without a stop (no checkpoints)."""
    reference = tmp_path_factory.mktemp("uninterrupted2") / "run"
    run_main([*AT_LOG, *data_args, f"run.dir={reference}", "train.log_interval=1", "checkpoint.save=false"], nproc=2)
    assert len(losses(reference)) == 12
    return losses(reference)


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_args) -> dict:
    """The per-step losses of RUN without a stop (one process, no checkpoints)."""
    reference = tmp_path_factory.mktemp("uninterrupted") / "run"
    train_here([*RUN, *data_args, f"run.dir={reference}", "checkpoint.save=false"])
    assert len(losses(reference)) == 12
    return losses(reference)


def test_sigusr1_through_the_launcher_saves_at_the_next_step_and_resumes_bit_for_bit(tmp_path, data_args,
                                                                                      uninterrupted):
    run, text, step = sigusr1_through_the_launcher(tmp_path, [*RUN, *data_args], "job7")
    assert 1 <= step < 12
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"
    assert (f"SIGUSR1 received: stopping at step {step} (newest verified checkpoint: {run / 'checkpoints'}/"
            f"iter_{step:07d}); the next launch with the same run.dir resumes from it") in text
    assert sorted(losses(run)) == list(range(1, step + 1))  # no step after the boundary it stopped at
    after = text.split("SIGUSR1 received")[1]  # the trainer exited 0; torchrun re-raises the signal it forwarded
    assert "ChildFailedError" not in after and "SignalException: Process" in after and "main.py" not in after

    p = train_here([*RUN, *data_args, f"run.dir={run}"])
    assert f"resumed from {run / 'checkpoints' / f'iter_{step:07d}'} at step {step}" in p.stdout
    assert losses(run) == uninterrupted  # bitwise: same floats


def test_ranks_on_other_hosts_are_named_lost_when_they_miss_the_roll_call(monkeypatch):
    """Rank 0's view after a failed collective: rank 1 (another host) answers the roll call in the store,
    rank 2 (another host) does not, rank 3 (this host) has exited."""
    import subprocess
    import sys

    import torch.distributed as dist

    from train.lost_rank import Peers

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    store = dist.HashStore()
    store.set("nosa_roll_call/1", "here")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    peers = Peers.__new__(Peers)
    peers.rank, peers.host = 0, socket.gethostname()
    peers.table = [(peers.host, os.getpid()), ("node-b", 11), ("node-c", 12), (peers.host, exited.pid)]
    lost = peers.lost(wait_s=1.0)
    assert lost == {2: "on node-c, no answer within 1s", 3: f"pid {exited.pid} on {peers.host} exited"}
    assert store.check(["nosa_roll_call/0"]) and peers.reporter(lost)  # rank 0 answered too, and reports
    peers.rank = 1
    assert not peers.reporter(lost)


def _kill_rank_1(proc, log):
    """SIGKILL the worker of rank 1 (mid-step) and wait for a survivor's line; ``(its pid, seconds waited)``."""
    import psutil

    victim = next(c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1")
    victim.kill()
    t0 = time.monotonic()
    while "error: lost rank" not in log.read_text(errors="replace"):
        assert time.monotonic() - t0 < 60, "no line within cluster.dist_timeout_minutes=1:\n" + "\n".join(
            ln for ln in log.read_text().splitlines() if "arn" not in ln and "return func" not in ln)[:12000]
        time.sleep(0.05)
    return victim.pid, time.monotonic() - t0


def test_a_lost_rank_is_one_line_and_torchrun_restarts_from_the_newest_verified_checkpoint_exactly(
        tmp_path, data_args, uninterrupted_2ranks):
    """2 ranks (gloo): kill -9 of rank 1 mid-step; rank 0 names it in one line (within
    cluster.dist_timeout_minutes) and exits; ``torchrun --max-restarts=1`` starts both again, they resume
    from the newest verified checkpoint and the losses equal an uninterrupted 2-rank run's bit for bit."""
    common = [*AT_LOG, *data_args, "train.log_interval=1"]  # 12 steps: the kill lands well before the end
    run = tmp_path / "run"
    rc, out, (pid, waited) = run_main_and_act(
        [*common, f"run.dir={run}", "checkpoint.interval=2", "cluster.dist_timeout_minutes=1"], run, 3,
        _kill_rank_1, nproc=2, launcher=("--max-restarts=1",))
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 0 and len(lines) == 1 and "Traceback" not in out, out[-4000:]
    got = re.match(rf"error: lost rank 1 \(pid {pid} on {re.escape(socket.gethostname())} exited\) after step (\d+); "
                   rf"newest verified checkpoint: (\S+); launch again with the same run.dir to resume", lines[0])
    assert got and int(got[1]) >= 3 and waited < 60, lines[0]
    assert got[2] in [str(run / "checkpoints" / f"iter_{s:07d}") for s in (2, 4, 6) if s <= int(got[1])], lines[0]
    assert f"resumed from {got[2]} at step " in out
    assert losses(run) == uninterrupted_2ranks  # bitwise: the same floats


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


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_save_signal_stops_at_a_checkpoint_and_the_run_resumes_exactly(tmp_path, data_args, nproc, request):
    """SIGUSR1 (through the launcher) while the host reads at the logs only (every 4th step): one rank checks
    the signal every step (no collective), two ranks at the next read, where they agree. The stop step's
    values are read, its checkpoint written, and the resumed run's per-step losses equal an uninterrupted
    run's bit for bit."""
    common = [*AT_LOG, *data_args, "checkpoint.save=false"]
    if nproc == 1:
        reference = tmp_path / "reference"
        train_here([*common, f"run.dir={reference}", "train.log_interval=1"])
        want = losses(reference)
    else:
        want = request.getfixturevalue("uninterrupted_2ranks")

    args = [*common, "train.log_interval=4", "checkpoint.save=true", "checkpoint.interval=0"]
    run, _, step = sigusr1_through_the_launcher(tmp_path, args, "job8", nproc=nproc)
    assert 4 <= step < 12 and (nproc == 1 or step % 4 == 0), step  # two ranks: only where they read
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"
    for s, loss in losses(run).items():  # the logged interval means (steps 4, 8, ... up to the stop)
        assert s <= step and math.isclose(loss, math.fsum(want[i] for i in range(s - 3, s + 1)) / 4, rel_tol=1e-6)

    (train_here if nproc == 1 else run_main)([*common, f"run.dir={run}", "train.log_interval=1",
                                              "checkpoint.save=false"], **({} if nproc == 1 else {"nproc": 2}))
    resumed = {s: v for s, v in losses(run).items() if s > step}
    assert resumed == {s: want[s] for s in range(step + 1, 13)}  # bitwise: the same floats
