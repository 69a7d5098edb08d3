"""``runtime.outputs``: files and directories appear whole or not at all; ``runtime.cli``: a bad input is one
line and exit code 2."""

import json
import os
import stat

import pytest

from runtime.cli import run_cli
from runtime.outputs import atomic_dir, atomic_path, write_atomic, write_json


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
        if x == "bug":
            raise KeyError("a bug keeps its traceback")

    assert run_cli("to_hf", work, "fine") == 0
    assert run_cli("to_hf", work, "bad") == 2
    assert capsys.readouterr().err == "to_hf: error: --ckpt bad: no checkpoint there\n"
    assert run_cli("eval.ppl", work, "gone") == 2
    assert capsys.readouterr().err == "eval.ppl: error: no such file: gone\n"
    with pytest.raises(KeyError):
        run_cli("to_hf", work, "bug")
