"""Fixtures for trainer tests: the SMALL demo data and a runner for train/main.py subprocesses."""

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import pytest

from tests.subproc import child_env, kill_group, run_logged

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from data.demo_corpus import SMALL, build_demo

    return build_demo(str(tmp_path_factory.mktemp("demo")), SMALL, log=lambda m: None)


@pytest.fixture(scope="session")
def data_args(demo_data):
    """Overrides pointing every stage at the SMALL demo data."""
    return [f"data.paths=[{demo_data['indexed_prefix']}]", f"data.tokenizer={demo_data['tokenizer']}",
            f"sft.path={demo_data['sft']}", f"sft.tokenizer={demo_data['tokenizer']}"]


def run_main(args, nproc: int = 1, env: dict | None = None, timeout: int = 400, check: bool = True,
             script: Path = ROOT / "train" / "main.py"):
    """Run train/main.py (or ``script``: python for 1 process, torchrun for more) in its own process group.

    Output (stdout and stderr together) goes to a log file; the whole group is killed afterwards
    (``tests/subproc.py``), so helpers that outlive a crashed trainer cannot hang the test.
    """
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--standalone", str(script), *args]
    full_env = child_env(**(env or {}))
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "out.log"
        rc = run_logged(cmd, log, timeout, ROOT, full_env)
        text = log.read_text(errors="replace")
    p = subprocess.CompletedProcess(cmd, rc, text, text)  # stdout and stderr interleaved in one log
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def train_here(args, env: dict | None = None, check: bool = True):
    """train/main.py's ``main(args)`` in this process, for one-process runs whose point is not the process
    itself (a launcher, a signal, a crash): it saves the ~7 s of imports a new process pays. One intra-op
    thread as in a test subprocess; the environment, default dtype and RNG state are restored afterwards.
    Returns what :func:`run_main` does (the output of stdout and stderr together)."""
    import io

    import torch

    from runtime.megatron_cpu import remove_cpu_shim
    from train.main import main

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    dtype, rng = torch.get_default_dtype(), torch.random.get_rng_state()
    os.environ.update(env or {})
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(rng)
        remove_cpu_shim()  # the worker's later tests (any folder) run on a plain torch again
    text = out.getvalue()
    p = subprocess.CompletedProcess(["main", *args], rc, text, text)
    if check and rc != 0:
        raise AssertionError(f"main({args}) failed ({rc}):\n{text[-5000:]}")
    return p


def run_main_and_act(args, run_dir, at_step: int, act, nproc: int = 1, launcher: tuple = (), timeout: int = 400):
    """Like :func:`run_main`, but once ``run_dir`` has logged the loss of step ``at_step``, call ``act(proc, log)``
    (proc: the python or torchrun process, log: its output file) and wait for the end. Returns
    ``(rc, output, act's result)``."""
    cmd = [sys.executable, str(ROOT / "train" / "main.py"), *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *launcher,
        str(ROOT / "train" / "main.py"), *args]
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "out.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                deadline = time.monotonic() + timeout
                while max(losses_so_far(run_dir), default=0) < at_step and proc.poll() is None:
                    assert time.monotonic() < deadline, "the run never reached the step"
                    time.sleep(0.02)
                got = act(proc, log)
                rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
            finally:
                kill_group(proc)
        return rc, log.read_text(errors="replace"), got


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if r.get("loss") is not None}


def losses_so_far(run) -> dict:
    try:
        return losses(run)
    except (FileNotFoundError, ValueError):
        return {}


def sigusr1_through_the_launcher(tmp_path, args: list, run_id: str, nproc: int = 1) -> tuple:
    """Train ``args`` (a ``recipe=`` among them) through ``launch/run_train.sh`` under ``tmp_path``, send SIGUSR1 to
    the launcher (as SLURM's ``--signal=USR1@<s>`` does) once the run has logged a loss, and wait for it to end.
    Returns the run dir, the launcher's output and the step the trainer said it stopped at."""
    env = child_env(RUN_ROOT=str(tmp_path), RUN_ID=run_id, NPROC_PER_NODE=str(nproc), PYTHON=sys.executable,
                    MASTER_PORT="0", NOSA_SHUTDOWN_TIMEOUT="120")
    recipe = next(a.split("=", 1)[1] for a in args if a.startswith("recipe="))
    run = tmp_path / f"{recipe}-{run_id}"
    log = tmp_path / f"launch-{run_id}.log"
    with open(log, "w") as fh:  # the launcher execs torchrun: proc.pid is torchrun's
        proc = subprocess.Popen(["bash", str(ROOT / "launch" / "run_train.sh"), *args], cwd=ROOT,
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not losses_so_far(run) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGUSR1)
            proc.wait(timeout=240)
        finally:
            kill_group(proc)
    text = log.read_text(errors="replace")
    stopped = [ln for ln in text.splitlines() if "SIGUSR1 received: stopping at step" in ln]
    assert stopped, text[-3000:]
    return run, text, int(stopped[0].split("stopping at step ")[1].split()[0])
