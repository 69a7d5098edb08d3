"""Nothing is lost or poisoned: damaged checkpoints are detected and fallen back from, rotation
keeps intact checkpoints, one training per run dir, and surprising inputs give one line."""

import shutil

import pytest

from runtime.checkpoint_files import CheckpointError, select_checkpoint
from runtime.checkpoint_manifest import hash_files, list_files, verify, write_manifest
from tests.train.conftest import run_main
from tests.train.test_train_runs import PRETRAIN

RUN = [*PRETRAIN, "train.eval_interval=0", "logging.plot=false", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_args):
    """A 4-step run with intact checkpoints at steps 2 and 4 (kept: keep_last=0)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    run_main([*RUN, *data_args, f"run.dir={run}", "train.max_steps=4", "checkpoint.keep_last=0"])
    return run


def _copy(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def _flip(path, offset=None, n=4096):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def _main(args, capsys):
    from train.main import main

    rc = main(args)
    err = capsys.readouterr().err.strip()
    return rc, err


def test_resume_falls_back_from_a_damaged_checkpoint_and_rotation_keeps_intact_ones(trained, tmp_path, data_args):
    run = _copy(trained, tmp_path)
    ckpts = run / "checkpoints"
    _flip(next((ckpts / "iter_0000004").glob("*.distcp")))  # 4 KB flipped in the newest shard
    p = run_main([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6", "checkpoint.keep_last=2"])
    assert (f"warning: checkpoint {ckpts / 'iter_0000004'} is damaged: __0_0.distcp does not match its "
            f"checksum: falling back to {ckpts / 'iter_0000002'}") in p.stdout
    assert f"resumed from {ckpts / 'iter_0000002'} at step 2" in p.stdout
    assert "layer spec=local (megatron-core local layers), fusions=off, initial weights from (seed, layer)" in p.stdout
    changed = next(ln for ln in p.stdout.splitlines() if ln.startswith("resuming with changed settings: "))
    assert "checkpoint.keep_last 0 -> 2; run.dir " in changed and changed.endswith("; train.max_steps 4 -> 6")
    assert sorted(d.name for d in ckpts.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    assert all(verify(d) is None for d in ckpts.glob("iter_*"))  # the damaged step 4 was rewritten
    assert (ckpts / "latest").read_text().strip() == "iter_0000006"


def test_damaged_latest_shard_or_metadata_select_the_newest_intact_checkpoint(trained, tmp_path):
    ckpts = _copy(trained, tmp_path) / "checkpoints"
    newest, older = ckpts / "iter_0000004", ckpts / "iter_0000002"
    logs = []
    for damage in (b"garbage\n", b"iter_0000009\n", b"\xff\xfe\x00"):  # damaged `latest`
        (ckpts / "latest").write_bytes(damage)
        assert select_checkpoint(ckpts, log=logs.append) == newest
        assert logs[-1].startswith(f"warning: {ckpts / 'latest'} ") and logs[-1].endswith(f"falling back to {newest}")
        with pytest.raises(CheckpointError, match=f"the newest intact checkpoint is {newest}") as e:
            select_checkpoint(ckpts, fallback=False)
        assert "\n" not in str(e.value)
    (ckpts / "latest").write_text("iter_0000004\n")
    for victim in ("__0_0.distcp", ".metadata", "metadata.json"):  # a deleted shard / metadata file
        (newest / victim).rename(tmp_path / victim)
        assert select_checkpoint(ckpts, log=logs.append) == older
        assert f"{victim} is missing" in logs[-1]
        with pytest.raises(CheckpointError, match=f"{victim} is missing; the newest intact checkpoint is {older}"):
            select_checkpoint(ckpts, fallback=False)
        with pytest.raises(CheckpointError, match=f"checkpoint {newest} is damaged"):
            select_checkpoint(newest)  # an explicit iter dir never falls back
        (tmp_path / victim).rename(newest / victim)
    _flip(older / "nosa_config.json", offset=0, n=4)
    (newest / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="no intact checkpoint in .*manifest.json is unreadable"):
        select_checkpoint(ckpts)


def test_rotation_counts_only_intact_checkpoints(tmp_path):
    from train.checkpointing import _prune

    for step in (2, 4, 6, 8):
        d = tmp_path / f"iter_{step:07d}"
        d.mkdir()
        (d / "shard").write_bytes(b"x" * step)
        write_manifest(d, hash_files(d, list_files(d)))
    (tmp_path / "iter_0000006" / "shard").write_bytes(b"x")  # damaged (truncated)
    (tmp_path / "iter_0000010.tmp").mkdir()  # an interrupted save
    _prune(tmp_path, keep_last=2, keep=tmp_path / "iter_0000008")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006", "iter_0000008"]


def test_second_training_into_a_locked_run_dir_names_the_holder(trained, tmp_path, data_args):
    import os
    import socket

    from train.run_lock import RunDirLock, RunDirLocked

    run = _copy(trained, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    lock = RunDirLock(run).acquire()
    try:
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            RunDirLock(run).acquire()
        p = run_main([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"], check=False)
    finally:
        lock.release()
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-2000:]
    assert f"is in use by another training (pid {os.getpid()} on {socket.gethostname()}" in errors[0]
    assert (run / "metrics.jsonl").read_text() == before
    RunDirLock(run).acquire().release()  # free again once the holder let go


def test_surprising_resumes_and_inputs_are_one_line_errors(trained, tmp_path, data_args, capsys):
    from data.indexed import write_indexed

    empty = str(tmp_path / "empty")
    write_indexed(empty, [], vocab_size=1024)
    resume = [*RUN, *data_args, f"run.dir={trained}", "train.max_steps=4"]
    fresh = [*RUN, *data_args, f"run.dir={tmp_path / 'fresh'}", "train.max_steps=4"]
    cases = [
        (resume, ["train.max_steps=3"], "is at step 4, beyond train.max_steps=3"),
        (resume, ["train.global_batch_size=4"], "change the training trajectory: train.global_batch_size 2 -> 4; "
                                                "restore them, choose a new run.dir, "
                                                "or set checkpoint.allow_config_change=true"),
        (resume, ["recipe=tiny_cpt"],
         "holds checkpoints of another model (attention: checkpoint dense vs recipe nosa)"),
        (fresh, ["run.device=cuda"], "run.device=cuda but CUDA is not available"),
        (fresh, ["model.vocab_size=512"], "has 1024 tokens but the model's vocabulary is 512"),
        (fresh, [f"data.paths=[{empty}]"], "is empty (0 documents)"),
    ]
    from nosa_layers.megatron.spec import have_te

    if not have_te():
        cases.append((fresh, ["train.transformer_impl=te"], "Transformer Engine is not importable"))
    for base, extra, msg in cases:
        rc, err = _main([*base, *extra], capsys)
        assert rc == 2 and len(err.splitlines()) == 1 and msg in err, (extra, err)
    assert not (tmp_path / "fresh").exists()


def test_sft_file_without_a_usable_row_is_one_line(tmp_path, data_args):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n{"text": "no messages"}\n')
    p = run_main(["recipe=tiny_sft", *data_args, f"sft.path={bad}", f"run.dir={tmp_path / 'sft'}",
                  "train.max_steps=2", "optim.warmup_steps=1", "train.seq_length=256", "train.global_batch_size=2"],
                 check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-2000:]
    assert "no usable conversations" in errors[0] and "no assistant turn" in errors[0]


class _Marker:
    """A pickle that would create a file if plain pickle ever loaded it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_resume_from_a_crafted_metadata_file_runs_no_code(trained, tmp_path, data_args):
    import pickle

    run = _copy(trained, tmp_path)
    ckpt = run / "checkpoints" / "iter_0000004"
    marker = tmp_path / "PWNED"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    write_manifest(ckpt, hash_files(ckpt, list_files(ckpt)))  # the manifest matches: only the unpickler stops it
    p = run_main([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-2000:]
    assert errors[0] == (f"error: cannot load {ckpt}: UnpicklingError: checkpoint metadata refers to posix.system, "
                         f"which checkpoint metadata never contains: refusing to load it (crafted or foreign file)")
    assert not marker.exists()
