"""Load a model to evaluate from any of the three checkpoint forms, with its tokenizer.

``--ckpt`` may be a training run dir (``runs/x``), its ``checkpoints/`` dir or one ``iter_*`` dir
(megatron-core ``torch_dist`` with ``nosa_config.json``), or a Hugging Face export
(``config.json`` + safetensors, from ``checkpoints_convert.to_hf``). Every form is run as the
Megatron model (TP = PP = 1, local layer spec): NOSA layers use the Triton kernels on CUDA and
the PyTorch reference on CPU. An HF export is first imported into a temporary Megatron
checkpoint by ``checkpoints_convert.from_hf`` (the same tensors, bitwise).

The tokenizer is ``--tokenizer``, else the export's own files, else the ``data.tokenizer`` (or
``sft.tokenizer``) of the run's ``config.yaml``.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor

from eval.errors import EvalError

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class ModelSource:
    """Where a model comes from: ``kind`` is ``megatron`` (``path`` = the iter_* dir) or ``hf``."""

    kind: str
    path: Path
    model: object  # nosa_layers.megatron.ModelConfig
    attn: object  # nosa_layers.megatron.AttentionConfig
    tokenizer: Optional[Path]
    step: Optional[int] = None

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
        raise EvalError(f"--ckpt {ckpt}: no such file or directory (give a run dir, a checkpoint dir or an HF export)")
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        from checkpoints_convert.from_hf import configs_from_hf

        model, attn = configs_from_hf(json.loads((p / "config.json").read_text()))
        tok = Path(tokenizer) if tokenizer else (p if (p / "tokenizer.json").is_file() else None)
        step = (json.loads((p / "config.json").read_text()).get("nosa_export") or {}).get("step")
        return ModelSource("hf", p, model, attn, tok, step)
    from checkpoints_convert.common import read_model_config, resolve_checkpoint

    path = resolve_checkpoint(p)  # ConversionError (a one-line ValueError) when there is none
    model, attn, extra = read_model_config(path)
    tok = Path(tokenizer) if tokenizer else _run_tokenizer(path)
    return ModelSource("megatron", path, model, attn, tok, extra.get("step"))


def _run_tokenizer(ckpt: Path) -> Optional[Path]:
    """The tokenizer named in the ``config.yaml`` of the run that wrote ``ckpt`` (None if absent)."""
    for run_dir in (ckpt.parent.parent, ckpt.parent, ckpt):
        cfg = run_dir / "config.yaml"
        if not cfg.is_file():
            continue
        import yaml

        raw = yaml.safe_load(cfg.read_text()) or {}
        for section in ("data", "sft"):
            name = (raw.get(section) or {}).get("tokenizer")
            for cand in (Path(name), REPO_ROOT / name) if name else ():
                if (cand / "tokenizer.json").is_file():
                    return cand
    return None


def load_tokenizer(src: ModelSource):
    """The model's ``data.tokenizer.Tokenizer``; one-line errors when missing or too large."""
    from data.tokenizer import Tokenizer

    if src.tokenizer is None:
        raise EvalError(f"{src.path}: no tokenizer found (none in the export, none in the run's config.yaml); "
                        f"pass --tokenizer DIR")
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
        out = import_hf(str(src.path), str(Path(tmp) / "ckpt"), log=lambda *_: None)
        yield out / "iter_0000000"
