"""Converter safety: damaged or crafted checkpoints are refused in one line, ``to_hf --out`` never
replaces what it did not write, non-finite weights are refused, and ``verify`` runs an export's
modeling code only when it is the code this project ships (or ``--trust-remote-code``)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import stat

import pytest
import torch

from checkpoints_convert import to_hf
from checkpoints_convert.mapping import ConversionError
from checkpoints_convert.to_hf import export
from checkpoints_convert.verify import main as verify_main
from checkpoints_convert.verify import trust_remote_code
from runtime.checkpoint_manifest import hash_files, list_files, write_manifest
from runtime.outputs import DiskFullError

CASE = "llama3-nosa-pp2-long"
QUIET = dict(log=lambda *_: None)


def _copy_run(megatron_ckpts, tmp_path, name="run"):
    return shutil.copytree(megatron_ckpts.ckpt(CASE), tmp_path / name)


class _Marker:
    """A pickle that, if ever unpickled by plain pickle, creates a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _flip_middle(path, n=4096):
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + n] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + n])
    path.write_bytes(bytes(data))


def test_damaged_or_crafted_checkpoints_are_refused_in_one_line(megatron_ckpts, tmp_path, capsys):
    run = _copy_run(megatron_ckpts, tmp_path)
    ckpt = run / "iter_0000000"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    original = shard.read_bytes()
    _flip_middle(shard)  # 4 KB flipped in a shard
    with pytest.raises(ConversionError, match=f"{shard.name} does not match its checksum"):
        export(str(run), str(tmp_path / "hf1"), **QUIET)
    shard.write_bytes(original)
    (ckpt / ".metadata").rename(tmp_path / "metadata.bak")  # a deleted .metadata
    with pytest.raises(ConversionError, match=r"\.metadata is missing"):
        export(str(run), str(tmp_path / "hf2"), **QUIET)
    (tmp_path / "metadata.bak").rename(ckpt / ".metadata")
    (run / "latest").write_text("iter_99\n")  # a damaged pointer
    with pytest.raises(ConversionError, match="names 'iter_99', which is not a complete checkpoint"):
        export(str(run), str(tmp_path / "hf3"), **QUIET)
    (run / "latest").write_text("iter_0000000\n")
    _flip_middle(shard)  # flipped bytes whose manifest is lost too: damaged for every tool, never "foreign"
    (ckpt / "manifest.json").rename(tmp_path / "manifest.bak")
    lost = f"checkpoint {ckpt} is damaged: manifest.json is missing (this project writes it with every checkpoint"
    with pytest.raises(ConversionError, match=re.escape(lost)):
        export(str(run), str(tmp_path / "hf5"), **QUIET)
    assert verify_main(["--hf", str(tmp_path), "--ckpt", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"verify: error: {lost}") and "\n" not in err
    from eval.load import resolve_source

    with pytest.raises(ValueError, match=re.escape(lost)):
        resolve_source(str(run))
    (tmp_path / "manifest.bak").rename(ckpt / "manifest.json")
    kept = (ckpt / "manifest.json").read_text()  # flipped bytes whose manifest entry was deleted: still damaged
    entries = json.loads(kept)
    del entries["files"][shard.name]
    (ckpt / "manifest.json").write_text(json.dumps(entries))
    with pytest.raises(ConversionError, match=f"{shard.name} is not listed in its manifest.json"):
        export(str(run), str(tmp_path / "hf6"), **QUIET)
    (ckpt / "manifest.json").write_text(kept)
    shard.write_bytes(original)

    # a crafted .metadata whose manifest was rewritten to match: the restricted unpickler refuses it
    marker = tmp_path / "PWNED"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    write_manifest(ckpt, hash_files(ckpt, list_files(ckpt)))
    with pytest.raises(ConversionError, match=r"posix\.system, which checkpoint metadata never contains") as e:
        export(str(run), str(tmp_path / "hf4"), **QUIET)
    assert "\n" not in str(e.value) and not marker.exists()
    assert not any(p.name.startswith("hf") for p in tmp_path.iterdir())  # nothing was written


def test_to_hf_out_keeps_foreign_dirs_and_non_finite_weights_out(megatron_ckpts, tmp_path, monkeypatch, capsys):
    src = megatron_ckpts.ckpt(CASE)
    foreign = tmp_path / "a_run"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(ConversionError, match="not an earlier conversion output.*--overwrite"):
        export(str(src), str(foreign), **QUIET)
    assert (foreign / "metrics.jsonl").read_text() == "precious\n" and len(list(foreign.iterdir())) == 1

    old = os.umask(0o022)
    try:
        out = export(str(src), str(tmp_path / "hf"), **QUIET)
        again = export(str(src), str(out), **QUIET)  # an earlier export is replaced
    finally:
        os.umask(old)
    assert again == out and stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    export(str(src), str(foreign), overwrite=True, **QUIET)
    assert (foreign / "config.json").is_file() and not (foreign / "metrics.jsonl").exists()

    load = to_hf.load_megatron_tensors

    def with_nan(ck):
        sd = load(ck)
        name = next(k for k in sd if sd[k].is_floating_point())
        sd[name] = sd[name].clone().index_fill_(0, torch.tensor([0]), float("nan"))
        return sd

    # an --out that is, lies inside or contains the source run: refused even with --overwrite, nothing touched
    run = _copy_run(megatron_ckpts, tmp_path, "source")
    it = run / "iter_0000000"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for ckpt, to, how, source in ((run, run, "is", f"{run} (--ckpt)"),
                                  (run, run / "hf", "lies inside", f"{run} (--ckpt)"),
                                  (run, tmp_path, "contains", f"{run} (--ckpt)"), (it, it, "is", f"{it} (--ckpt)"),
                                  (it, run, "contains", f"{it} (--ckpt)"),
                                  (it, run / "hf", "lies inside", f"{run} (the run of --ckpt)")):
        with pytest.raises(ConversionError, match=re.escape(f"--out {to} {how} the source {source}: ")):
            export(str(ckpt), str(to), overwrite=True, **QUIET)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    # the disk fills up while the weights are written: one line, no partial dir, the earlier export kept
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    save = to_hf.save_safetensors_sharded

    def disk_fills(sd, where, max_shard_bytes):
        (where / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where / "model.safetensors"))

    monkeypatch.setattr(to_hf, "save_safetensors_sharded", disk_fills)
    with pytest.raises(DiskFullError, match=f"disk full writing {re.escape(str(out))} .*: the partial output was "
                                              f"removed and {re.escape(str(out))} is as it was; free about .* there"):
        export(str(src), str(out), **QUIET)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]

    def ctrl_c(sd, where, max_shard_bytes):  # Ctrl-C while the weights are written
        (where / "model.safetensors").write_bytes(b"\0" * 4096)
        raise KeyboardInterrupt

    monkeypatch.setattr(to_hf, "save_safetensors_sharded", ctrl_c)
    capsys.readouterr()
    assert to_hf.main(["--ckpt", str(src), "--out", str(out)]) == 130
    assert capsys.readouterr().err == (f"to_hf: interrupted (Ctrl-C): no partial export was left; --out {out} is "
                                       f"intact (an export is written beside it and renamed into place only when "
                                       f"complete)\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    monkeypatch.setattr(to_hf, "save_safetensors_sharded", save)

    monkeypatch.setattr(to_hf, "load_megatron_tensors", with_nan)
    with pytest.raises(ConversionError, match="hold NaN/inf .*--allow-non-finite"):
        export(str(src), str(tmp_path / "hf_nan"), **QUIET)
    assert not (tmp_path / "hf_nan").exists()
    nan_out = export(str(src), str(tmp_path / "hf_nan"), allow_non_finite=True, **QUIET)
    assert nan_out.is_dir()


def test_half_written_weights_and_invalid_config_json_are_one_line_naming_the_file(exports, tmp_path, capsys):
    """from_hf, verify and eval.ppl on an export whose model.safetensors was cut in half, or whose config.json
    is not JSON: one line naming that file, exit status 2, nothing written."""
    from checkpoints_convert.from_hf import main as from_hf_main
    from eval.ppl import main as ppl_main

    hf = shutil.copytree(exports["llama3-dense-tp2"], tmp_path / "hf")
    weights, config = hf / "model.safetensors", hf / "config.json"
    good_weights, good_config = weights.read_bytes(), config.read_bytes()
    out = tmp_path / "out"
    commands = (("from_hf", lambda: from_hf_main(["--hf", str(hf), "--out", str(out)])),
                ("verify", lambda: verify_main(["--hf", str(hf), "--decode-steps", "0"])),
                ("eval.ppl", lambda: ppl_main(["--ckpt", str(hf), "--data", str(tmp_path / "docs.jsonl"),
                                               "--length", "64", "--out", str(out)])))
    for damage, restore, what in ((lambda: weights.write_bytes(good_weights[:len(good_weights) // 2]),
                                   lambda: weights.write_bytes(good_weights),
                                   f"{weights} is damaged or incomplete (safetensors: Error while deserializing "
                                   f"header: "),
                                  (lambda: config.write_text('{"model_type": "lla'),
                                   lambda: config.write_bytes(good_config),
                                   f"{config} is not valid JSON (Unterminated string starting at: line 1 column 16")):
        damage()
        for prog, run in commands:
            capsys.readouterr()
            assert run() == 2, prog
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("note:")]
            assert len(err) == 1 and err[0].startswith(f"{prog}: error: {what}"), (prog, err)
        restore()
    assert not out.exists()


def test_verify_runs_only_the_shipped_modeling_code(exports, tmp_path, capsys):
    assert trust_remote_code(exports["llama3-dense-tp2"]) is False  # stock Llama: no remote code at all
    assert trust_remote_code(exports[CASE]) is True  # byte-identical to what this project ships
    edited = shutil.copytree(exports[CASE], tmp_path / "edited")
    with open(edited / "modeling_nosa.py", "a") as f:
        f.write("\nimport os; os.system('echo pwned')\n")
    with pytest.raises(ConversionError,
                       match=r"differs from this project's \(modeling_nosa\.py\).*--trust-remote-code"):
        trust_remote_code(edited)
    assert trust_remote_code(edited, allowed=True) is True
    assert verify_main(["--hf", str(edited), "--decode-steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trust-remote-code" in err


def test_checkpoint_objects_are_loaded_without_running_code(tmp_path):
    """Non-tensor checkpoint items (megatron's common state, RNG states) are torch.save bytes that
    torch loads with weights_only=False; after install_safe_checkpoint_loading they load only plain data."""
    import warnings

    import numpy as np
    import torch.distributed.checkpoint as dcp

    from runtime.safe_unpickling import install_safe_checkpoint_loading, load_error_line

    install_safe_checkpoint_loading()
    marker = tmp_path / "PWNED"
    good = np.random.RandomState(0).get_state()  # a tuple with a NumPy array: what megatron stores for RNG
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"good": good, "evil": _Marker(marker)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        loaded = {"good": None}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
        assert loaded["good"][0] == "MT19937" and np.array_equal(loaded["good"][1], good[1])
        with pytest.raises(BaseException) as e:  # torch's CheckpointException is a BaseException
            dcp.load({"evil": None}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert load_error_line(e.value) == ("UnpicklingError: a checkpoint object refers to posix.system, which "
                                        "checkpoints never contain: refusing to load it (crafted or foreign file)")
    assert not marker.exists()


def test_verify_ends_with_a_one_line_verdict_naming_the_first_failing_check(monkeypatch, capsys):
    from checkpoints_convert import verify

    good = {"hf": "x", "tensor_roundtrip": "ok", "logits_vs_megatron": {"rel": 2e-6},
            "decode_vs_forward": {"rel": 1e-7}}
    reports = (({**good, "ok": True}, 0, "verify: ok (tensor_roundtrip bitwise, logits_vs_megatron 2e-06 <= 0.0001, "
                                         "decode_vs_forward 1e-07 <= 0.0001)"),
               ({**good, "logits_vs_megatron": {"rel": 3e-3}, "decode_vs_forward": {"rel": 5e-3}, "ok": False}, 1,
                "verify: FAILED: logits_vs_megatron: relative error 0.003 > --tol 0.0001"),
               ({**good, "tensor_roundtrip": ["HF->Megatron->HF: a differs", "HF->Megatron->HF: b lost"], "ok": False},
                1, "verify: FAILED: tensor_roundtrip: HF->Megatron->HF: a differs (+1 more)"))
    for report, rc, line in reports:
        monkeypatch.setattr(verify, "run_checks", lambda args, r=report: r)
        assert verify.main(["--hf", "x"]) == rc
        out, err = capsys.readouterr()
        assert json.loads(out) == report and err.splitlines()[-1] == line, err
