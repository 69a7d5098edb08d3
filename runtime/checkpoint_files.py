"""Files of a NOSA distributed checkpoint that every tool agrees on (trainer, converters).

    <run dir>/checkpoints/latest          text: name of the last COMPLETE iter_* dir
    <run dir>/checkpoints/iter_XXXXXXX/   megatron-core dist_checkpointing (torch_dist), model under "model"
        nosa_config.json                  {"model": ModelConfig, "attention": AttentionConfig, ...} as dicts
        manifest.json                     size + checksum of every file (runtime.checkpoint_manifest)

A checkpoint holding ``nosa_config.json`` was written by this project, which always writes the
manifest too: without a (readable) manifest it is damaged. One without either was written by
another tool; it is loaded (unverified) only when the caller allows it.

Kept here (below both ``train/`` and ``checkpoints_convert/``) so neither restates the layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from pathlib import Path

from runtime.checkpoint_manifest import MANIFEST
from runtime.checkpoint_manifest import verify as manifest_verify
from runtime.dataclass_io import from_dict
from nosa_layers.megatron.config import AttentionConfig, ModelConfig

LATEST = "latest"
REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIG = "nosa_config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, incomplete, unsafe); the message is one line."""


def _is_complete(d: Path) -> bool:
    """A finished checkpoint dir (not a ``.tmp`` save in progress) with a manifest, megatron's metadata
    or our model config: intact or not, it is reported rather than skipped."""
    return d.is_dir() and not d.name.endswith(".tmp") and \
        any((d / name).exists() for name in (MANIFEST, "metadata.json", MODEL_CONFIG))


def _step_of(d: Path) -> int:
    try:
        return int(d.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def _root_of(p: Path) -> Path | None:
    """The folder holding ``latest`` / ``iter_*`` for a run dir or its ``checkpoints/`` dir."""
    for candidate in (p, p / "checkpoints"):
        if (candidate / LATEST).exists() or any(_is_complete(d) for d in candidate.glob("iter_*")):
            return candidate
    return None


def read_pointer(root: Path) -> tuple[Path | None, str | None]:
    """``(checkpoint named by root/latest, problem)``; problem is a one-line reason the pointer is unusable."""
    pointer = root / LATEST
    if not pointer.exists():
        return None, None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer} is unreadable ({type(e).__name__})"
    if not name.startswith("iter_") or "/" in name or not _is_complete(root / name):
        return None, f"{pointer} names {name[:60]!r}, which is not a complete checkpoint"
    return root / name, None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete ``iter_*`` dirs under ``root``, newest step first."""
    return sorted((d for d in root.glob("iter_*") if _is_complete(d)), key=_step_of, reverse=True)


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint a run dir, its ``checkpoints/`` dir (``latest`` pointer) or an ``iter_*`` dir names.

    Unverified; None where there is none. A damaged ``latest`` raises :class:`CheckpointError`.
    """
    p = Path(path)
    if _is_explicit(p):
        return p
    root = _root_of(p)
    if root is None:
        return None
    ckpt, problem = read_pointer(root)
    if problem:
        raise CheckpointError(problem)
    return ckpt


def select_checkpoint(path: str | os.PathLike, verify=None, fallback: bool = True, log=None,
                      allow_foreign: bool = False, foreign_hint: str = "") -> Path | None:
    """The newest verified checkpoint at ``path`` (run dir, ``checkpoints/`` dir or one ``iter_*`` dir).

    ``verify(ckpt) -> problem | None`` (default: full manifest check). A checkpoint of this project
    (``nosa_config.json``) without a readable manifest is damaged. One without manifest and model config
    (written by another tool) is refused with :class:`CheckpointError` (``foreign_hint`` names the
    flag that allows it), or used unverified with a warning when ``allow_foreign``. At a run dir, a damaged
    ``latest`` or checkpoint is reported in one line each and, with ``fallback``, the next newest verified
    one is used; without ``fallback`` (or for an explicit ``iter_*`` dir) a :class:`CheckpointError`
    names the problem and the newest verified checkpoint. None where there is no checkpoint at all.
    """
    verify = verify or (lambda c: manifest_verify(c, deep=True))
    log = log or (lambda m: None)
    usable = partial(_usable, verify=verify, allow_foreign=allow_foreign, hint=foreign_hint)
    p = Path(path)
    if _is_explicit(p):
        problem = usable(p, log=log)
        if problem:
            raise CheckpointError(f"checkpoint {p} is damaged: {problem}")
        return p
    root = _root_of(p)
    if root is None:
        return None
    pointed, problem = read_pointer(root)
    problems = [problem] if problem else []
    order = ([pointed] if pointed else []) + [d for d in complete_checkpoints(root) if d != pointed]
    for ckpt in order:
        bad = None if problems and not fallback else usable(ckpt, log=log)
        if bad is None and not problems:
            return ckpt
        if bad is None and fallback:
            log(f"warning: {'; '.join(problems)}: falling back to {ckpt}")
            return ckpt
        if bad is not None:
            problems.append(f"checkpoint {ckpt} is damaged: {bad}")
        if not fallback:
            rest = [d for d in order if not (bad and d == ckpt)]
            good = next((d for d in rest if usable(d, log=lambda m: None) is None), None)
            hint = f"; the newest verified checkpoint is {good}" if good else ""
            raise CheckpointError(f"{problems[0]}{hint}")
    raise CheckpointError(f"no verified checkpoint in {root}: {'; '.join(problems[:3])}")


def _is_explicit(p: Path) -> bool:
    """An ``iter_*`` dir (or any megatron checkpoint dir) rather than a folder of them."""
    return (p / "metadata.json").is_file() or (_is_complete(p) and p.name.startswith("iter_"))


def _usable(ckpt: Path, verify, allow_foreign: bool, hint: str, log) -> str | None:
    """Why ``ckpt`` may not be loaded (one line), or None; a foreign checkpoint without ``allow_foreign``
    raises :class:`CheckpointError` (falling back from it would hide the choice the user has to make)."""
    if (ckpt / MANIFEST).exists() or (ckpt / MODEL_CONFIG).exists():
        return verify(ckpt) if (ckpt / MANIFEST).exists() else (
            f"{MANIFEST} is missing (this project writes it with every checkpoint: it was lost or deleted)")
    if not allow_foreign:
        raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST} and no {MODEL_CONFIG}: another tool wrote it, "
                              f"so its files cannot be verified{'; ' + hint if hint else ''}")
    log(f"warning: loading {ckpt} unverified: it has no {MANIFEST} (another tool wrote it), as allowed")
    return None


def configs_to_dict(model: ModelConfig, attn: AttentionConfig) -> dict:
    return {"model": dataclasses.asdict(model), "attention": dataclasses.asdict(attn)}


def configs_from_dict(raw: dict) -> tuple[ModelConfig, AttentionConfig]:
    """Inverse of :func:`configs_to_dict`; unknown keys or wrong types raise ``ValueError``."""
    return (from_dict(ModelConfig, raw["model"], "model"),
            from_dict(AttentionConfig, raw.get("attention") or {}, "attention"))


def read_configs(ckpt: str | os.PathLike) -> tuple[ModelConfig, AttentionConfig, dict] | None:
    """``(model, attention, extra)`` from ``<ckpt>/nosa_config.json``, or None if the file is absent."""
    path = Path(ckpt) / MODEL_CONFIG
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    model, attn = configs_from_dict(raw)
    return model, attn, {k: v for k, v in raw.items() if k not in ("model", "attention")}



def _tokenizer_dir(path, base: Path | None = None) -> Path | None:
    """``path`` (absolute, or relative to the working dir or ``base``) when it holds a ``tokenizer.json``."""
    if not path:
        return None
    for cand in (Path(path), *((base / path,) if base is not None else ())):
        if (cand / "tokenizer.json").is_file():
            return cand.resolve()
    return None


def run_tokenizer(ckpt: str | os.PathLike) -> Path | None:
    """The ``data.tokenizer`` (or ``sft.tokenizer``) named in the ``config.yaml`` of the run that wrote ``ckpt``."""
    import yaml

    ckpt = Path(ckpt)
    for run_dir in (ckpt.parent.parent, ckpt.parent, ckpt):
        cfg = run_dir / "config.yaml"
        if not cfg.is_file():
            continue
        try:
            raw = yaml.safe_load(cfg.read_text()) or {}
        except (yaml.YAMLError, OSError):
            return None
        for section in ("sft", "data") if (raw.get("stage") or {}).get("kind") == "sft" else ("data", "sft"):
            found = _tokenizer_dir((raw.get(section) or {}).get("tokenizer"), REPO_ROOT)
            if found:
                return found
    return None


def checkpoint_tokenizer(ckpt: str | os.PathLike, extra: dict) -> tuple[Path | None, str]:
    """``(tokenizer dir, where it came from)`` of a checkpoint: the one it records (``tokenizer``, carried from
    stage to stage), else its run's ``config.yaml``, else the Hugging Face dir a ``from_hf`` import came from;
    ``(None, "")`` when there is none."""
    found = _tokenizer_dir(extra.get("tokenizer"))
    if found:
        return found, "recorded with the checkpoint"
    found = run_tokenizer(ckpt)
    if found:
        return found, "the run's config.yaml"
    found = _tokenizer_dir(extra.get("source"))
    return (found, "the Hugging Face dir it was imported from") if found else (None, "")


def carried_record(tokenizer: str, init_from: str | None) -> dict:
    """What a new checkpoint records for the stages after it: its tokenizer dir (``tokenizer``, absolute: this
    run's, else the one ``init_from``'s checkpoint names) and the token ids of the Hugging Face model it
    descends from (``token_ids``, carried from a ``from_hf`` import through every stage)."""
    prev: dict = {}
    if init_from:
        try:
            ckpt = find_checkpoint(init_from)
            got = read_configs(ckpt) if ckpt is not None else None
        except (ValueError, OSError):
            got = None
        if got is not None:
            prev = {**got[2], "tokenizer": str(checkpoint_tokenizer(ckpt, got[2])[0] or "") or None}
    out = {}
    tok = _tokenizer_dir(tokenizer) or _tokenizer_dir(prev.get("tokenizer"))
    if tok:
        out["tokenizer"] = str(tok)
    if prev.get("token_ids"):
        out["token_ids"] = dict(prev["token_ids"])
    return out
