"""Nothing is lost or poisoned: damaged checkpoints (a lost manifest, or one that omits a file, among them) are
detected and fallen back from, rotation keeps verified checkpoints, a full disk or Ctrl-C costs no data, one training
per run dir and nothing written outside it (no link is followed), a resume on another number of ranks, no start
that waits forever, and surprising inputs give one line."""

import re
import shutil

import pytest

from runtime.checkpoint_files import CheckpointError, select_checkpoint
from runtime.checkpoint_manifest import hash_files, list_files, verify, write_manifest
from tests.train.conftest import run_main_and_act, train_here
from tests.train.test_train_runs import PRETRAIN

RUN = [*PRETRAIN, "train.eval_interval=0", "logging.plot=false", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_args):
    """A 4-step run with intact checkpoints at steps 2 and 4 (kept: keep_last=0)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=4", "checkpoint.keep_last=0"])
    return run


def _copy(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def _flip(path, offset=None, n=4096):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def _main(args, capsys):
    """train/main.py's ``main`` in this process and its stderr; the environment (a start that got as far as the
    process group sets RANK, WORLD_SIZE, MASTER_*) and the CPU shim are restored afterwards, as ``train_here``
    does, so the worker's later tests (and their subprocesses) start clean."""
    import os

    from runtime.megatron_cpu import remove_cpu_shim
    from train.main import main

    saved = dict(os.environ)
    try:
        rc = main(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        remove_cpu_shim()
    err = capsys.readouterr().err.strip()
    return rc, err


def _files(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}


def test_resume_falls_back_from_a_damaged_checkpoint_rotation_keeps_verified_ones_and_a_full_disk_costs_nothing(
        trained, tmp_path, data_args, monkeypatch):
    from tests.train._disk_fills import disk_fills_at

    run = _copy(trained, tmp_path)
    ckpts = run / "checkpoints"
    _flip(next((ckpts / "iter_0000004").glob("*.distcp")))  # 4 KB flipped in the newest shard ...
    (ckpts / "iter_0000004" / "manifest.json").unlink()  # ... and its manifest lost: damaged, not "foreign"
    disk_fills_at(monkeypatch, 8)
    p = train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=8", "checkpoint.keep_last=2"], check=False)
    assert (f"warning: checkpoint {ckpts / 'iter_0000004'} is damaged: manifest.json is missing (this project "
            f"writes it with every checkpoint: it was lost or deleted): falling back to {ckpts / 'iter_0000002'}"
            ) in p.stdout
    assert f"resumed from {ckpts / 'iter_0000002'} at step 2" in p.stdout
    assert "rotation: deleted iter_0000002 (checkpoint.keep_last=2; the kept iter_0000004 verified by hash" in p.stdout
    assert ("layer spec=local (megatron-core local layers), fusions=off, loss=chunked (4096 tokens), initial weights "
            "from (seed, layer)") in p.stdout
    changed = next(ln for ln in p.stdout.splitlines() if ln.startswith("resuming with changed settings: "))
    assert "checkpoint.keep_last 0 -> 2; run.dir " in changed and changed.endswith("; train.max_steps 4 -> 8")
    # the disk fills up during the step-8 save: one line, the partial save removed, steps 4 and 6 kept
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-3000:]
    assert errors[0].startswith(
        f"error: disk full while saving the step-8 checkpoint into {ckpts} (0 B free): removed the partial "
        f"iter_0000008.tmp, the earlier checkpoints are as they were (newest verified checkpoint: "
        f"{ckpts / 'iter_0000006'}); a checkpoint takes about "), errors[0]
    assert "MiB: free at least that much there" in errors[0]
    assert sorted(d.name for d in ckpts.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]
    assert all(verify(d) is None for d in ckpts.glob("iter_*"))  # the damaged step 4 was rewritten
    assert (ckpts / "latest").read_text().strip() == "iter_0000006"


def test_damaged_latest_shard_metadata_or_manifest_select_the_newest_verified_checkpoint(trained, tmp_path):
    ckpts = _copy(trained, tmp_path) / "checkpoints"
    newest, older = ckpts / "iter_0000004", ckpts / "iter_0000002"
    logs = []
    for damage in (b"garbage\n", b"iter_0000009\n", b"\xff\xfe\x00"):  # damaged `latest`
        (ckpts / "latest").write_bytes(damage)
        assert select_checkpoint(ckpts, log=logs.append) == newest
        assert logs[-1].startswith(f"warning: {ckpts / 'latest'} ") and logs[-1].endswith(f"falling back to {newest}")
        with pytest.raises(CheckpointError, match=f"the newest verified checkpoint is {newest}") as e:
            select_checkpoint(ckpts, fallback=False)
        assert "\n" not in str(e.value)
    (ckpts / "latest").write_text("iter_0000004\n")
    for victim in ("__0_0.distcp", ".metadata", "metadata.json"):  # a deleted shard / metadata file
        (newest / victim).rename(tmp_path / victim)
        assert select_checkpoint(ckpts, log=logs.append) == older
        assert f"{victim} is missing" in logs[-1]
        with pytest.raises(CheckpointError, match=f"{victim} is missing; the newest verified checkpoint is {older}"):
            select_checkpoint(ckpts, fallback=False)
        with pytest.raises(CheckpointError, match=f"checkpoint {newest} is damaged"):
            select_checkpoint(newest)  # an explicit iter dir never falls back
        (tmp_path / victim).rename(newest / victim)
    manifest = (newest / "manifest.json").read_bytes()
    (newest / "manifest.json").unlink()  # a lost manifest: damaged (it holds nosa_config.json, so we wrote it)
    assert select_checkpoint(ckpts, log=logs.append) == older
    assert logs[-1] == (f"warning: checkpoint {newest} is damaged: manifest.json is missing (this project writes it "
                        f"with every checkpoint: it was lost or deleted): falling back to {older}")
    with pytest.raises(CheckpointError, match=f"{newest} is damaged: manifest.json is missing"):
        select_checkpoint(newest)
    (newest / "manifest.json").write_bytes(manifest)
    _flip(older / "nosa_config.json", offset=0, n=4)
    (newest / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="no verified checkpoint in .*manifest.json is unreadable"):
        select_checkpoint(ckpts)


def test_a_manifest_that_omits_a_file_fails_the_check(trained, tmp_path):
    """Flipped bytes in a shard whose manifest entry was deleted (or a manifest of no files): the checkpoint is
    damaged for resume (hashing split over the ranks), rotation and init_from, never trusted."""
    import json

    from train.checkpointing import load_weights, verify_shared

    ckpts = _copy(trained, tmp_path) / "checkpoints"
    newest, older = ckpts / "iter_0000004", ckpts / "iter_0000002"
    _flip(newest / "__0_0.distcp")
    raw = json.loads((newest / "manifest.json").read_text())
    for files in ({k: v for k, v in raw["files"].items() if k != "__0_0.distcp"}, {}):
        (newest / "manifest.json").write_text(json.dumps({**raw, "files": files}))
        first = "__0_0.distcp" if files else sorted(raw["files"])[0]
        problem = f"{first} is not listed in its manifest.json (a checkpoint verifies only when every file is)"
        assert verify(newest).startswith(problem) and verify_shared(newest).startswith(problem)
        logs = []
        assert select_checkpoint(ckpts, verify=verify_shared, log=logs.append) == older
        assert logs == [f"warning: checkpoint {newest} is damaged: {verify(newest)}: falling back to {older}"]
        with pytest.raises(CheckpointError, match=re.escape(f"{newest} is damaged: {problem}")):
            load_weights(str(ckpts.parent), [])


def test_init_from_refuses_a_checkpoint_whose_manifest_is_lost(trained, tmp_path):
    from train.checkpointing import load_weights

    newest = _copy(trained, tmp_path) / "checkpoints" / "iter_0000004"
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is damaged: manifest.json is missing") as e:
        load_weights(str(newest.parent.parent), [])
    assert "\n" not in str(e.value)


def test_a_foreign_checkpoint_without_manifest_needs_the_flag(tmp_path):
    ckpt = tmp_path / "other_tool" / "iter_0000010"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (ckpt / "__0_0.distcp").write_bytes(b"tensors")
    hint = "set checkpoint.allow_unverified=true to load it anyway"
    for where in (ckpt, ckpt.parent):
        with pytest.raises(CheckpointError, match=f"{ckpt} has no manifest.json and no nosa_config.json: another "
                                                  f"tool wrote it, so its files cannot be verified; {hint}"):
            select_checkpoint(where, foreign_hint=hint)
    logs = []
    assert select_checkpoint(ckpt.parent, allow_foreign=True, log=logs.append) == ckpt
    assert logs == [f"warning: loading {ckpt} unverified: it has no manifest.json (another tool wrote it), as allowed"]


def test_rotation_deletes_only_behind_checkpoints_verified_by_hash(tmp_path):
    from train.checkpointing import _prune

    for step in (2, 4, 6, 8):
        d = tmp_path / f"iter_{step:07d}"
        d.mkdir()
        (d / "shard").write_bytes(b"x" * 64)
        write_manifest(d, hash_files(d, list_files(d)))
    (tmp_path / "iter_0000006" / "shard").write_bytes(b"y" + b"x" * 63)  # a flipped byte: the same size
    (tmp_path / "iter_0000010.tmp").mkdir()  # an interrupted save
    logs = []
    _prune(tmp_path, keep_last=2, keep=tmp_path / "iter_0000008", log=logs.append, verify=verify)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006", "iter_0000008"]
    assert logs[0] == (f"warning: checkpoint {tmp_path / 'iter_0000006'} is damaged (shard does not match its "
                       f"checksum): rotation does not count it")
    assert logs[1].startswith("rotation: deleted iter_0000002 (checkpoint.keep_last=2; the kept iter_0000004 "
                              "verified by hash in ")


def test_ctrl_c_in_training_is_one_line_naming_the_newest_verified_checkpoint(trained, tmp_path, data_args):
    import re
    import signal

    run = _copy(trained, tmp_path)
    before, ckpts = _files(run), run / "checkpoints"
    rc, out, _ = run_main_and_act([*RUN, *data_args, f"run.dir={run}", "train.max_steps=500", "checkpoint.interval=0"],
                                  run, 6, lambda proc, log: proc.send_signal(signal.SIGINT))
    lines = [ln for ln in out.splitlines() if "interrupted" in ln]
    assert rc == 130 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert len(lines) == 1 and re.fullmatch(rf"interrupted at step \d+; newest verified checkpoint: "
                                            rf"{re.escape(str(ckpts / 'iter_0000004'))}", lines[0]), lines
    assert _files(run) == before  # Ctrl-C saves nothing and removes nothing


def test_a_lock_path_that_is_a_directory_is_one_line(tmp_path):
    from train.run_lock import RunDirLock, RunDirLocked

    (tmp_path / ".lock").mkdir()
    with pytest.raises(RunDirLocked, match=f"run.dir {tmp_path}: {tmp_path / '.lock'} is a directory, not this "
                                           f"trainer's lock file; remove it, or choose another run.dir"):
        RunDirLock(tmp_path).acquire()


def test_run_files_that_are_links_or_not_files_are_one_line_and_nothing_outside_is_touched(
        trained, tmp_path, data_args, capsys):
    """A ``.lock`` or ``metrics.jsonl`` that is a symbolic link (its target is never truncated), a directory or
    another file under that name: one line before anything is built, nothing written."""
    import os

    run = _copy(trained, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    before = _files(run)
    args = [*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"]
    lock, metrics = run / ".lock", run / "metrics.jsonl"
    rows = metrics.read_bytes()
    metrics.unlink()
    lock.unlink(missing_ok=True)
    for path, make, what in (
            (lock, lambda p: p.symlink_to(victim), f"{lock} is a symbolic link to {victim}, not this trainer's lock "
                                                   f"file; remove it, or choose another run.dir"),
            (lock, os.mkfifo, f"{lock} is a FIFO, not this trainer's lock file"),
            (metrics, lambda p: p.symlink_to(victim), f"{metrics} is a symbolic link to {victim}, not the metrics "
                                                      f"file this trainer writes"),
            (metrics, lambda p: p.mkdir(), f"{metrics} is a directory, not the metrics file this trainer writes"),
            (metrics, lambda p: p.write_bytes(bytes(range(256)) * 4),
             f"{metrics} holds no JSON rows (1024 bytes): not a metrics file written by train/main.py: move it "
             f"away, or choose another run.dir")):
        make(path)
        rc, err = _main(args, capsys)
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and what in err, err
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    assert victim.read_text() == "precious\n" and _files(run) == before
    metrics.write_bytes(rows)


def test_a_resume_replaces_links_at_latest_and_loss_png_and_never_writes_through_them(trained, tmp_path, data_args):
    run = _copy(trained, tmp_path)
    ckpts = run / "checkpoints"
    pointer, plot = tmp_path / "pointer.txt", tmp_path / "plot.png"
    pointer.write_text("iter_0000004\n")
    plot.write_bytes(b"not yours")
    (ckpts / "latest").unlink()
    (ckpts / "latest").symlink_to(pointer)
    (run / "loss.png").symlink_to(plot)
    p = train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6", "logging.plot=true"])
    assert f"resumed from {ckpts / 'iter_0000004'} at step 4" in p.stdout
    assert pointer.read_text() == "iter_0000004\n" and plot.read_bytes() == b"not yours"
    assert not (ckpts / "latest").is_symlink() and (ckpts / "latest").read_text() == "iter_0000006\n"
    assert not (run / "loss.png").is_symlink() and (run / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_resume_on_another_number_of_ranks_reseeds_or_drops_the_rng_states_in_one_line(trained, tmp_path, data_args):
    """1 rank -> 2 (DP=2) -> 1: the RNG states are per rank; the ranks without one are re-seeded, the surplus
    dropped, each in one line, and the losses follow the one-process run (within the rounding of the reduction)."""
    import math

    from tests.train.conftest import losses, run_main

    reference, run = _copy(trained, tmp_path), shutil.copytree(trained, tmp_path / "ranks")
    train_here([*RUN, *data_args, f"run.dir={reference}", "train.max_steps=8"])
    ckpts = run / "checkpoints"
    p = run_main([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"], nproc=2)
    assert (f"resuming {ckpts / 'iter_0000004'}, saved by 1 rank(s), on 2: rank 1 re-seeded from "
            f"run.seed=1234, the others continue their RNG states; the run continues, though not bit for bit as it "
            f"would on 1") in p.stdout, p.stdout[-3000:]
    p = train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=8"])
    assert (f"resuming {ckpts / 'iter_0000006'}, saved by 2 rank(s), on 1: the RNG state of rank 1 dropped; "
            f"the run continues, though not bit for bit as it would on 2") in p.stdout
    got, want = losses(run), losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-5) for s in want), (got, want)


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
        p = train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"], check=False)
    finally:
        lock.release()
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-2000:]
    assert f"is in use by another training (pid {os.getpid()} on {socket.gethostname()}" in errors[0]
    assert (run / "metrics.jsonl").read_text() == before
    RunDirLock(run).acquire().release()  # free again once the holder let go


def test_surprising_resumes_and_inputs_are_one_line_errors(trained, tmp_path, data_args, capsys):
    import numpy as np

    from data.indexed import write_indexed

    empty, tiny, short_valid, foreign = (str(tmp_path / n) for n in ("empty", "tiny", "short_valid", "foreign"))
    write_indexed(foreign, [np.arange(300) % 1000] * 39 + [np.array([7, 9000, 9] * 100)], vocab_size=65536)
    write_indexed(empty, [], vocab_size=1024)
    write_indexed(tiny, [np.arange(1, 11)], vocab_size=1024)  # 10 tokens: less than one sample of 129
    write_indexed(short_valid, [np.arange(300) % 1000, np.arange(20)], vocab_size=1024)
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
        (fresh, [f"data.paths=[{tiny}]"], f"data.paths entry '{tiny}': its train part (data.split='95,5,0') holds 10 "
                                         f"tokens in 1 document(s), fewer than one sample of data.seq_length + 1 = "
                                         f"129 tokens: add data or lower data.seq_length"),
        (fresh, [f"data.paths=[{foreign}]"], f"data.paths entry '{foreign}' holds token id 9000 but the model's "
                                            f"vocabulary is 8192: it was tokenized with another tokenizer or "
                                            f"{foreign}.bin is damaged"),
        (fresh, [f"data.paths=[{short_valid}]", "data.split='50,50,0'"],
         "its valid part (data.split='50,50,0') holds 20 tokens in 1 document(s), fewer than one sample of "
         "data.seq_length + 1 = 129 tokens: add data or lower data.seq_length, or give the valid part no weight in "
         "data.split (e.g. '100,0,0')"),
    ]
    from nosa_layers.megatron.spec import have_te

    if not have_te():
        cases.append((fresh, ["train.transformer_impl=te"], "Transformer Engine is not importable"))
    for base, extra, msg in cases:
        rc, err = _main([*base, *extra], capsys)
        assert rc == 2 and len(err.splitlines()) == 1 and msg in err, (extra, err)
    assert not (tmp_path / "fresh").exists()


def test_sigterm_while_starting_ends_the_start_at_once(tmp_path, data_args, monkeypatch):
    """A save signal before the steps begin (here while the data is built, as megatron-core's epoch loop over a
    part that never fills a sample would spin) has nothing to save: the start ends at once, in one line."""
    import os
    import signal
    import time

    import train.trainer

    def spin(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("SIGTERM did not end the start")

    monkeypatch.setattr(train.trainer, "build_loaders", spin)
    before = signal.getsignal(signal.SIGTERM)
    from tests.train.conftest import train_here

    # in this process, its environment and the CPU shim restored afterwards (the start got past init_distributed)
    p = train_here([*RUN, *data_args, f"run.dir={tmp_path / 'run'}", "train.max_steps=4"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if "while starting" in ln]
    assert p.returncode == 128 + signal.SIGTERM and errors == [
        "SIGTERM received while starting: nothing was trained, no checkpoint was changed"], p.stdout[-2000:]
    assert signal.getsignal(signal.SIGTERM) is before  # the trainer's handler is gone again
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sft_file_without_a_usable_row_is_one_line(tmp_path, data_args):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n{"text": "no messages"}\n')
    p = train_here(["recipe=tiny_sft", *data_args, f"sft.path={bad}", f"run.dir={tmp_path / 'sft'}",
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
    p = train_here([*RUN, *data_args, f"run.dir={run}", "train.max_steps=6"], check=False)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-2000:]
    assert errors[0] == (f"error: cannot load {ckpt}: UnpicklingError: checkpoint metadata refers to posix.system, "
                         f"which checkpoint metadata never contains: refusing to load it (crafted or foreign file)")
    assert not marker.exists()
