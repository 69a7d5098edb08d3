"""``runtime.outputs``: files and directories appear whole or not at all (a full disk is one line);
``runtime.cli``: a bad input or a file that cannot be written is one line and exit code 2."""

import errno
import json
import os
import shutil
import stat

import pytest

from runtime.cli import run_cli
from runtime.outputs import DiskFullError, atomic_dir, atomic_path, write_atomic, write_json


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "result.json"
    write_atomic(path, "old")
    assert path.read_text() == "old"
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            assert tmp.parent == path.parent and tmp.suffix == ".json" and tmp != path
            tmp.write_text("half")
            raise RuntimeError("crash while writing")
    assert path.read_text() == "old" and os.listdir(path.parent) == ["result.json"]
    write_json(path, {"loss": float("nan"), "rows": [1.5, float("inf")]})
    assert json.loads(path.read_text()) == {"loss": None, "rows": [1.5, None]}
    assert os.listdir(path.parent) == ["result.json"]


def test_a_directory_appears_whole_with_the_usual_permissions(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "mine.txt").write_text("earlier output")
    with pytest.raises(ValueError):
        with atomic_dir(out) as tmp:
            (tmp / "part.bin").write_bytes(b"x")
            raise ValueError("bad input found halfway")
    assert sorted(os.listdir(tmp_path)) == ["export"] and os.listdir(out) == ["mine.txt"]
    with atomic_dir(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
    assert os.listdir(out) == ["model.safetensors"] and sorted(os.listdir(tmp_path)) == ["export"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_run_cli_turns_bad_input_into_one_line(capsys):
    def work(x):
        if x == "bad":
            raise ValueError("--ckpt bad: no checkpoint there")
        if x == "gone":
            raise FileNotFoundError("no such file: gone")
        if x == "denied":
            raise PermissionError(errno.EACCES, "Permission denied", "/ro/out")
        if x == "bug":
            raise KeyError("a bug keeps its traceback")

    assert run_cli("to_hf", work, "fine") == 0
    assert run_cli("to_hf", work, "bad") == 2
    assert capsys.readouterr().err == "to_hf: error: --ckpt bad: no checkpoint there\n"
    assert run_cli("eval.ppl", work, "gone") == 2
    assert capsys.readouterr().err == "eval.ppl: error: no such file: gone\n"
    assert run_cli("eval.ppl", work, "denied") == 2
    assert capsys.readouterr().err == "eval.ppl: error: [Errno 13] Permission denied: '/ro/out'\n"
    with pytest.raises(KeyError):
        run_cli("to_hf", work, "bug")


def test_a_directory_that_fills_the_disk_is_one_line_and_leaves_the_earlier_output(tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    out.mkdir()
    (out / "mine.txt").write_text("earlier output")
    usage = shutil.disk_usage

    def full(path):  # after the failed write the file system reports no space left, as a full one does
        return usage(path)._replace(free=0)

    with pytest.raises(DiskFullError) as got:
        with atomic_dir(out, need_bytes=3 << 30) as tmp:
            (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(got.value).startswith(f"disk full writing {out} (") and "4.0 KiB written" in str(got.value)
    assert str(got.value).endswith(f"the partial output was removed and {out} is as it was; free about 3.0 GiB "
                                   f"there and run again")
    assert sorted(os.listdir(tmp_path)) == ["export"] and os.listdir(out) == ["mine.txt"]

    def export():
        raise got.value

    assert run_cli("to_hf", export) == 2 and capsys.readouterr().err == f"to_hf: error: {got.value}\n"
    # the caller's own refusal stays what it is, even on a disk that is nearly full
    monkeypatch.setattr(shutil, "disk_usage", full)
    with pytest.raises(ValueError, match="bad input found halfway"):
        with atomic_dir(out):
            raise ValueError("bad input found halfway")
    # a writer's error that lost its errno on the way (megatron-core, torch) counts by the free space left
    with pytest.raises(DiskFullError, match="0 B written.*; free more than 0 B there and run again"):
        with atomic_dir(out):
            raise RuntimeError("could not write the shard")
    assert sorted(os.listdir(tmp_path)) == ["export"] and os.listdir(out) == ["mine.txt"]
