"""Shared pieces of the converters: trainer-checkpoint discovery, typed configs, tensor I/O.

Layering: docs/ARCHITECTURE.md. The checkpoint layout conventions (``latest`` pointer, ``nosa_config.json``
next to the tensors) come from ``runtime.checkpoint_files``, shared with the trainer.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from checkpoints_convert.mapping import NON_MODEL_PREFIXES, ConversionError, Geometry
from nosa_layers.config import eviction_head_name

from runtime.checkpoint_files import LATEST, MODEL_CONFIG, configs_to_dict  # noqa: F401
from runtime.checkpoint_files import CheckpointError, read_configs, select_checkpoint
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- trainer checkpoints ------------------------------------------------------------------------

def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run dir, its ``checkpoints/`` dir (``latest`` pointer) or an ``iter_*`` dir -> the checkpoint dir,
    verified against its manifest (a damaged one is refused in one line naming the newest verified one)."""
    try:
        ckpt = select_checkpoint(path, fallback=False, log=lambda m: print(m, file=sys.stderr),
                                 foreign_hint=f"the converters read the checkpoints of this trainer ({MODEL_CONFIG})")
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if ckpt is None:
        raise ConversionError(f"--ckpt {path}: no distributed checkpoint there (expected a run dir, its "
                              f"checkpoints/ dir with a 'latest' pointer, or an iter_* dir with metadata.json)")
    return ckpt


def read_model_config(ckpt: Path):
    """``nosa_config.json`` -> (ModelConfig, AttentionConfig, extra dict)."""
    try:
        got = read_configs(ckpt)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if got is None:
        raise ConversionError(f"{Path(ckpt) / MODEL_CONFIG} is missing: the converter needs the model + attention "
                              f"config the trainer writes next to the tensors")
    return got


def source_run(ckpt: Path) -> Path:
    """The run a checkpoint belongs to: the run dir of ``<run>/checkpoints/iter_*``, the folder of a
    ``latest`` pointer (a ``from_hf`` output), else the checkpoint dir itself."""
    root = Path(ckpt).resolve().parent
    if root.name == "checkpoints":
        return root.parent
    return root if (root / LATEST).exists() else Path(ckpt).resolve()


def check_out_apart(out: str | os.PathLike, source: str | os.PathLike, flag: str) -> None:
    """Refuse (one line, whatever ``--overwrite`` says) an output that is, contains or lies inside ``source``."""
    out, src = Path(out).resolve(), Path(source).resolve()
    how = "is" if out == src else "lies inside" if src in out.parents else "contains" if out in src.parents else None
    if how:
        raise ConversionError(f"--out {out} {how} the source {src} ({flag}): writing there would replace or mix "
                              f"with what it reads; choose an --out outside it")


def geometry(model, attn, fold_mup: bool = True) -> Geometry:
    variants = attn.layer_variants(model.num_layers)
    head = eviction_head_name(variants, attn.nosa.eviction_head)
    mup = None
    if model.use_mup and fold_mup:
        mup = {"emb": float(model.scale_emb), "residual": float(model.residual_scale),
               "logits": float(model.logit_scale)}
    return Geometry(num_layers=model.num_layers, hidden_size=model.hidden_size,
                    num_heads=model.num_attention_heads, num_kv_heads=model.num_kv_heads,
                    head_dim=model.kv_channels, ffn_hidden_size=model.ffn_hidden_size,
                    vocab_size=model.vocab_size, padded_vocab_size=model.padded_vocab_size,
                    tie_embeddings=model.tie_embeddings, layer_variants=variants, eviction_head=head, mup=mup)


def load_megatron_tensors(ckpt: Path) -> Dict[str, Tensor]:
    """The model tensors of a megatron-core ``torch_dist`` checkpoint, as global (unsharded) tensors.

    Reads with ``torch.distributed.checkpoint`` directly (no process group, no model build): TP/PP/DP
    shards are reassembled by the format itself, so every layout converts the same way.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_json = Path(ckpt) / "metadata.json"
    backend = json.loads(meta_json.read_text()).get("sharded_backend") if meta_json.is_file() else None
    if backend != "torch_dist":
        raise ConversionError(f"{ckpt}: sharded_backend={backend!r}; only megatron-core 'torch_dist' "
                              f"checkpoints are supported")
    from runtime.safe_unpickling import load_error_line, read_checkpoint_metadata

    reader = dcp.FileSystemReader(str(ckpt))
    try:
        meta = read_checkpoint_metadata(ckpt)
    except Exception as e:  # noqa: BLE001 - missing, truncated or crafted .metadata: one line
        raise ConversionError(f"{ckpt}: cannot read its .metadata ({load_error_line(e)})") from None
    sd = {}
    for key, m in meta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and not key.startswith(NON_MODEL_PREFIXES):
            sd[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not sd:
        raise ConversionError(f"{ckpt}: no model tensors in the checkpoint")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


# --- output directories -------------------------------------------------------------------------

def is_conversion_output(path: Path) -> bool:
    """An earlier ``to_hf`` export (``config.json`` with ``nosa_export``) or ``from_hf`` import."""
    try:
        if (path / "config.json").is_file():
            return "nosa_export" in json.loads((path / "config.json").read_text())
        imported = path / "iter_0000000" / MODEL_CONFIG
        return (path / LATEST).is_file() and imported.is_file() and "source" in json.loads(imported.read_text())
    except (OSError, ValueError):
        return False


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """``out`` resolved; refuses (one line) an existing ``out`` that is not empty, not an earlier
    conversion output and not to be overwritten, so a typo cannot replace a run directory."""
    out = Path(out).resolve()
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())) \
            and not is_conversion_output(out):
        raise ConversionError(f"--out {out} exists and is not an earlier conversion output; choose another "
                              f"--out, remove it first, or pass --overwrite (to_hf) to replace it")
    return out


# --- model-dir files ----------------------------------------------------------------------------

def read_json(path: str | os.PathLike) -> dict:
    """A JSON object file of a model dir (``config.json``, an index); one that is not valid JSON or not an
    object is a one-line :class:`ConversionError` naming it."""
    try:
        data = json.loads(Path(path).read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConversionError(f"{path} is not valid JSON ({e}); fix or replace that file") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object; fix or replace that file")
    return data


def _damaged(path: Path, e: Exception) -> ConversionError:
    """The one line for a weight file that cannot be read (truncated, half-written, not safetensors)."""
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return ConversionError(f"{path} is damaged or incomplete (safetensors: {why}); copy or export it again")


# --- safetensors --------------------------------------------------------------------------------

def save_safetensors_sharded(sd: Dict[str, Tensor], out: Path, max_shard_bytes: int = 4 << 30) -> List[str]:
    """HF-style shards ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    (a single ``model.safetensors`` when everything fits one shard)."""
    from safetensors.torch import save_file

    names = list(sd)
    shards: List[List[str]] = [[]]
    size = 0
    for n in names:
        b = sd[n].numel() * sd[n].element_size()
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    total = sum(sd[n].numel() * sd[n].element_size() for n in names)
    files = []
    if len(shards) == 1:
        save_file({n: sd[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: sd[n].contiguous() for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        files.append(fname)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def safetensors_files(path: Path) -> List[str]:
    """The weight files of an HF directory (index, single file, or every ``*.safetensors``)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index} has no weight_map object; fix or replace that file")
        files = sorted(set(map(str, weight_map.values())))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def safetensors_names(path: Path) -> List[str]:
    """Tensor names of an HF directory, read from the file headers (no tensor data is loaded)."""
    from safetensors import SafetensorError, safe_open

    names: List[str] = []
    for f in safetensors_files(path):
        try:
            with safe_open(str(Path(path) / f), framework="pt") as fh:
                names.extend(fh.keys())
        except SafetensorError as e:
            raise _damaged(Path(path) / f, e) from None
    return names


def load_safetensors_dir(path: Path) -> Dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    files = safetensors_files(path)
    sd: Dict[str, Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(path / f)))
        except SafetensorError as e:
            raise _damaged(path / f, e) from None
    return sd


def cast(sd: Dict[str, Tensor], dtype: torch.dtype) -> Dict[str, Tensor]:
    """Cast floating tensors; the eviction scale ``A`` stays fp32 (tiny, and it sets exp(bias))."""
    return {k: (v if not v.is_floating_point() or k.endswith("self_attn.A") else v.to(dtype)) for k, v in sd.items()}


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)


def check_layer_count(names, expected: int) -> Optional[str]:
    from checkpoints_convert.mapping import num_hf_layers

    n = num_hf_layers(names)
    return None if n == expected else f"weights have {n} layers, config says {expected}"


def describe(model, attn) -> Tuple[str, str]:
    variants = attn.layer_variants(model.num_layers)
    kinds = sorted(set(variants))
    return model.family, "+".join(kinds)
