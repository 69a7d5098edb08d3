"""The launchers' generated commands (dry mode): one rendezvous id and run dir on every node,
srun with --cpus-per-task, NCCL knobs passed through, and one-line errors for a bad launch."""

import os
import subprocess

import pytest

from tests.train.conftest import ROOT


def _bash(script, *args, env=None, tmp_path=None):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "NCCL_", "RUN_", "NNODES", "NODE_", "OMP_"))}
    if tmp_path is not None:  # a stand-in `scontrol show hostnames` for the job's node list
        fake = tmp_path / "bin"
        fake.mkdir(exist_ok=True)
        (fake / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
        (fake / "scontrol").chmod(0o755)
        base["PATH"] = f"{fake}{os.pathsep}{base['PATH']}"
    return subprocess.run(["bash", str(ROOT / script), *args], env={**base, "PYTHON": "python3", **(env or {})},
                          capture_output=True, text=True, timeout=60, check=False)


def test_sbatch_dry_mode_prints_each_nodes_command(tmp_path):
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[a-c]", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_CPUS_PER_TASK": "64", "NOSA_LAUNCH_DRY": "1", "NCCL_SOCKET_IFNAME": "ib0",
             "NCCL_IB_GID_INDEX": "3"}
    p = _bash("launch/slurm/h100.sbatch", "recipe=nosa_8b_cpt", "train.max_steps=9", env=slurm, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "srun: srun --nodes=3 --ntasks-per-node=1 --cpus-per-task=64 --kill-on-bad-exit=1"
    nodes = lines[1:]
    assert [ln.split(":")[0] for ln in nodes] == ["node 0/3", "node 1/3", "node 2/3"]
    for i, ln in enumerate(nodes):
        assert f"--node_rank={i} " in ln and "--nnodes=3 " in ln and "--nproc_per_node=8 " in ln
        assert "--rdzv_endpoint=gpu-a:29500 --rdzv_id=4242 " in ln
        assert ln.endswith("recipe=nosa_8b_cpt train.max_steps=9 run.dir=runs/nosa_8b_cpt-4242")
        assert "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 NCCL_IB_GID_INDEX=3 " in ln
        assert "OMP_NUM_THREADS=8 " in ln  # 64 cores of the task / 8 processes
        assert "SIGUSR1" in ln and "--shutdown-timeout=600" in ln


def test_nodes_started_by_hand_share_the_given_run_id():
    cmds = [_bash("launch/run_train.sh", "--dry", "recipe=tiny_cpt",
                  env={"NNODES": "2", "NODE_RANK": str(i), "RUN_ID": "exp7", "MASTER_ADDR": "h0"}) for i in (0, 1)]
    assert all(c.returncode == 0 for c in cmds)
    tails = [c.stdout.split("--node_rank=")[1].split(" ", 1)[1] for c in cmds]
    assert tails[0] == tails[1] and "--rdzv_id=exp7 " in tails[0] and "run.dir=runs/tiny_cpt-exp7" in tails[0]


@pytest.mark.parametrize("env, args, msg", [
    ({"NNODES": "2", "NODE_RANK": "1"}, [], "error: NNODES=2 needs RUN_ID (the same on every node"),
    ({"NNODES": "2", "NODE_RANK": "2", "RUN_ID": "x"}, [], "error: NODE_RANK='2' must be in 0..1"),
    ({"RUN_ID": "a/b"}, [], "error: RUN_ID='a/b' may hold only letters"),
    ({}, ["--nproc_per_node=2"], "error: run_train.sh takes Hydra overrides (key=value), got '--nproc_per_node=2'"),
])
def test_bad_launch_is_one_line(env, args, msg):
    p = _bash("launch/run_train.sh", "--dry", "recipe=tiny_cpt", *args, env=env)
    assert p.returncode == 2 and p.stderr.strip().startswith(msg) and "\n" not in p.stderr.strip()


def test_sbatch_outside_slurm_is_one_line():
    p = _bash("launch/slurm/srun_nodes.sh", "recipe=tiny_cpt")
    assert p.returncode == 2 and p.stderr.strip().startswith("error: SLURM_JOB_ID is not set")
