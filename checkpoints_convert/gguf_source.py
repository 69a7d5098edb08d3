"""A GGUF file (llama.cpp's format, quantized or not) as a Hugging Face source: config dict, fp32
state dict and tokenizer, through transformers' GGUF loader (which dequantizes with the ``gguf``
package: ``pip install 'nosa-train[gguf]'``).

Only Llama-architecture files are imported (``general.architecture = llama``: SmolLM2, Llama 2/3,
Mistral-style GQA models); transformers undoes llama.cpp's permutation of the q / k rows, so the
weights are the Hugging Face checkpoint's, up to the quantization.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints_convert.mapping import ConversionError


@dataclass
class GGUFSource:
    config: dict  # the Hugging Face config.json fields transformers derives from the GGUF metadata
    state_dict: dict  # name -> fp32 tensor, Hugging Face Llama names
    tokenizer: object  # transformers tokenizer (converted from the GGUF vocabulary), saved with the import
    name: str  # the file's stem (the model group's name comes from it)


def gguf_architecture(path: Path) -> tuple[str, str]:
    """``(general.architecture, general.name)`` of a GGUF file, read from its header only."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str) -> str:
        f = reader.fields.get(key)
        return "" if f is None else bytes(f.parts[f.data[0]]).decode("utf-8", "replace")

    return field("general.architecture"), field("general.name") or path.stem


def load_gguf(path: str | Path, log=print) -> GGUFSource:
    """Read ``path``: one line naming the problem for a missing file, a missing ``gguf`` package, a file
    that is not GGUF or an architecture other than Llama."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"--gguf {path}: no such file")
    if importlib.util.find_spec("gguf") is None:
        raise ConversionError("--gguf needs the gguf package: pip install 'nosa-train[gguf]' (or pip install gguf)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConversionError(f"--gguf {path}: not a GGUF file (no GGUF magic at its start)")
    try:
        arch, name = gguf_architecture(path)
    except (ValueError, IndexError, OSError) as e:
        raise ConversionError(f"--gguf {path}: unreadable GGUF header ({e})") from None
    if arch != "llama":
        raise ConversionError(f"--gguf {path}: architecture {arch!r}; only Llama-architecture files are imported")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log(f"reading {path.name} ({path.stat().st_size / 2**20:.0f} MiB, {name}): tokenizer and dequantized weights")
    verbosity, quiet = hf_logging.get_verbosity(), os.environ.get("TQDM_DISABLE")
    hf_logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"  # the loader's own per-tensor progress bar
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if quiet is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return GGUFSource(config=config, state_dict=sd, tokenizer=tokenizer, name=path.stem)
