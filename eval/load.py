"""Load a model to evaluate from any checkpoint form, with its tokenizer.

``--ckpt`` may be a training run dir (``runs/x``), its ``checkpoints/`` dir or one ``iter_*`` dir
(megatron-core ``torch_dist`` with ``nosa_config.json``), or a Hugging Face directory
(``config.json`` + safetensors): an export of ``checkpoints_convert.to_hf`` (NOSA or dense), a
stock Llama model, or a released-NOSA (reference-format) checkpoint. Every form is run as the
Megatron model (TP = PP = 1, local layer spec): NOSA layers use the Triton kernels on CUDA and
the PyTorch reference on CPU. A Hugging Face directory is first imported into a temporary Megatron
checkpoint by ``checkpoints_convert.from_hf`` (the same tensors, bitwise); a reference-format one
runs LongRoPE as the reference code does (``short_factor`` at every length).

The tokenizer is ``--tokenizer``, else the directory's own files, else the one the checkpoint records
(carried from stage to stage), else the ``data.tokenizer`` (or ``sft.tokenizer``) of the run's
``config.yaml``, else that of the Hugging Face dir a ``from_hf`` import came from
(``runtime.checkpoint_files.checkpoint_tokenizer``); only its tokenizer files are read (never the
model's config or code). lm-evaluation-harness needs a Hugging Face directory that runs with this
project's modeling code: :func:`lm_eval_dir` gives one for every form.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor

from eval.errors import EvalError

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class ModelSource:
    """Where a model comes from: ``kind`` is ``megatron`` (``path`` = the iter_* dir) or ``hf``;
    ``format`` of an ``hf`` dir: ``nosa`` (our export), ``reference`` (released NOSA) or ``llama``."""

    kind: str
    path: Path
    model: object  # nosa_layers.megatron.ModelConfig
    attn: object  # nosa_layers.megatron.AttentionConfig
    tokenizer: Optional[Path]
    step: Optional[int] = None
    format: Optional[str] = None
    longrope: Optional[str] = None  # the from_hf --longrope choice for an hf dir

    @property
    def variants(self) -> list[str]:
        """Attention variant of each layer (``dense`` | ``infllm_v2`` | ``nosa``)."""
        return self.attn.layer_variants(self.model.num_layers)

    @property
    def is_dense(self) -> bool:
        return all(v == "dense" for v in self.variants)

    @property
    def label(self) -> str:
        heads = {"nosa": self.attn.nosa.eviction_head, "infllm_v2": "none (InfLLM-V2)", "dense": "dense"}
        kinds = sorted({heads[v] for v in self.variants})
        return "+".join(kinds)


def resolve_source(ckpt: str, tokenizer: Optional[str] = None) -> ModelSource:
    """Identify ``ckpt`` and read its configs (no weights are loaded)."""
    p = Path(ckpt)
    if not p.exists():
        raise EvalError(f"--ckpt {ckpt}: no such file or directory (give a run dir, a checkpoint dir or a "
                        f"Hugging Face model dir)")
    if (p / "config.json").is_file():
        return _hf_source(p, tokenizer)
    from checkpoints_convert.common import read_model_config, resolve_checkpoint

    path = resolve_checkpoint(p)  # ConversionError (a one-line ValueError) when there is none
    model, attn, extra = read_model_config(path)
    from runtime.checkpoint_files import checkpoint_tokenizer

    tok = Path(tokenizer) if tokenizer else checkpoint_tokenizer(path, extra)[0]
    return ModelSource("megatron", path, model, attn, tok, extra.get("step"))


def _hf_source(p: Path, tokenizer: Optional[str]) -> ModelSource:
    """A Hugging Face dir: our export, a stock Llama or a reference-format (released NOSA) checkpoint."""
    from checkpoints_convert.common import read_json, safetensors_names
    from checkpoints_convert.from_hf import configs_from_hf
    from checkpoints_convert.reference_format import checkpoint_format

    if not any(p.glob("*.safetensors")):
        raise EvalError(f"--ckpt {p}: config.json but no *.safetensors weights (only safetensors checkpoints are "
                        f"read; save the model with save_pretrained(..., safe_serialization=True))")
    cfg = read_json(p / "config.json")
    fmt = checkpoint_format(cfg, safetensors_names(p))
    longrope = "short" if fmt == "reference" else None  # what the reference code runs at every length
    model, attn = configs_from_hf(cfg, longrope_choice=longrope)
    tok = Path(tokenizer) if tokenizer else (p if (p / "tokenizer.json").is_file() else None)
    step = (cfg.get("nosa_export") or {}).get("step")
    return ModelSource("hf", p, model, attn, tok, step, fmt, longrope)


def load_tokenizer(src: ModelSource):
    """The model's ``data.tokenizer.Tokenizer``; one-line errors when missing or too large."""
    from data.tokenizer import Tokenizer

    if src.tokenizer is None:
        raise EvalError(f"{src.path}: no tokenizer found (none in the export, the run's config.yaml or an "
                        f"imported checkpoint's source); pass --tokenizer DIR")
    if not (src.tokenizer / "tokenizer.json").is_file():
        raise EvalError(f"--tokenizer {src.tokenizer}: no tokenizer.json there")
    tok = Tokenizer(str(src.tokenizer))
    if tok.vocab_size > src.model.vocab_size:
        raise EvalError(f"tokenizer mismatch: {src.tokenizer} has {tok.vocab_size} tokens but the model's vocabulary "
                        f"is {src.model.vocab_size}; pass the tokenizer the model was trained with (--tokenizer)")
    return tok


def check_length(src: ModelSource, length: int, what: str = "--length") -> None:
    """A sequence of ``length`` tokens must fit the model's positions."""
    limit = src.model.max_position_embeddings
    if length > limit:
        raise EvalError(f"{what} {length} exceeds the model's max_position_embeddings={limit}; "
                        f"use {what} <= {limit}")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class EvalModel:
    """A loaded Megatron model in eval mode with the calls the evaluations need."""

    def __init__(self, module, src: ModelSource, device: torch.device) -> None:
        self.module, self.src, self.device = module, src, device

    @torch.no_grad()
    def logits(self, ids: Tensor) -> Tensor:
        """Logits ``[T, vocab_size]`` (fp32) of one sequence of token ids ``[T]``."""
        ids = ids.reshape(1, -1).to(self.device)
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        return self.module(ids, pos, None)[0, :, :self.src.model.vocab_size].float()

    @torch.no_grad()
    def token_logprobs(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(logprob of ids[t+1], greedy id)`` at every position t < T-1, both ``[T-1]`` on the CPU."""
        lp = torch.log_softmax(self.logits(ids)[:-1], dim=-1)
        target = ids.reshape(-1)[1:].to(lp.device)
        return lp.gather(-1, target[:, None])[:, 0].cpu(), lp.argmax(-1).cpu()


def load_model(src: ModelSource, device: Optional[torch.device] = None, dtype: str = "auto",
               backend: str = "auto") -> EvalModel:
    """Build the Megatron model of ``src`` with its weights. ``dtype``: ``auto`` (bf16 on CUDA,
    fp32 on CPU), ``fp32`` or ``bf16``; ``backend``: the NOSA backend (``auto``: Triton on CUDA)."""
    from checkpoints_convert.megatron_io import load_megatron_model

    device = device or default_device()
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise EvalError(f"--dtype {dtype!r}; use auto, fp32 or bf16")
    with _megatron_checkpoint(src) as ckpt:
        module = load_megatron_model(ckpt, src.model, src.attn, backend=backend, dtype=DTYPES[dtype], device=device)
    return EvalModel(module, src, device)


@contextmanager
def _megatron_checkpoint(src: ModelSource) -> Iterator[Path]:
    """``src.path`` for Megatron checkpoints; a temporary import of an HF export otherwise."""
    if src.kind == "megatron":
        yield src.path
        return
    from checkpoints_convert.from_hf import import_hf

    with tempfile.TemporaryDirectory(prefix="nosa_eval_") as tmp:
        out = import_hf(str(src.path), str(Path(tmp) / "ckpt"), log=lambda *_: None, longrope=src.longrope)
        yield out / "iter_0000000"


@contextmanager
def lm_eval_dir(src: ModelSource, log=print) -> Iterator[Path]:
    """A Hugging Face dir of ``src`` that lm-evaluation-harness loads with ``trust_remote_code`` running
    only this project's code: a stock Llama dir or an export whose modeling code is byte-identical to
    ours as it is; any other form (Megatron checkpoint, reference-format dir, an export with other
    modeling code) exported into a temporary NOSA-format dir (fp32, the model's tokenizer)."""
    if src.kind == "hf" and _runs_our_code(src.path):
        yield src.path
        return
    from checkpoints_convert.to_hf import export

    log(f"  exporting {src.path} to a temporary Hugging Face dir for lm-eval")
    with _megatron_checkpoint(src) as ckpt, tempfile.TemporaryDirectory(prefix="nosa_lm_eval_") as tmp:
        yield export(str(ckpt), str(Path(tmp) / "hf"), "fp32", str(src.tokenizer) if src.tokenizer else None,
                     log=lambda *_: None)


def _runs_our_code(hf_dir: Path) -> bool:
    """No modeling code (stock Llama), or an ``auto_map`` and files identical to what this project ships."""
    from checkpoints_convert.mapping import ConversionError
    from checkpoints_convert.verify import is_reference_export, trust_remote_code

    if is_reference_export(hf_dir):
        return False
    try:
        trust_remote_code(hf_dir)
    except ConversionError:
        return False
    return True
