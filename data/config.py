"""Typed data configs (plain dataclasses, primitive fields) and their single validation point.

The trainer builds these from Hydra YAML (``OmegaConf.to_object``); every check lives in
:func:`validate`, which raises a one-line ``ValueError`` naming the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

PACKING_MODES = ("document", "eod", "best_fit")
CHAT_TEMPLATES = ("chatml", "tokenizer")
OVERLONG_POLICIES = ("truncate", "drop")
BAD_EXAMPLE_POLICIES = ("count", "error")


@dataclass
class DataConfig:
    """Pretraining / CPT data over megatron-core indexed datasets (``<prefix>.bin/.idx``).

    paths / weights: blend of indexed-dataset prefixes; weights None = proportional to size.
    split: train,valid,test weights as in Megatron (e.g. "98,2,0"), applied per prefix.
    seq_length: tokens per sample S (4096 pretraining, 16384 CPT).
    packing: "document" emits ``cu_seqlens`` and per-document ``position_ids`` (NOSA);
             "eod" is plain concatenation with EOD separators and running positions (dense);
             "best_fit" keeps documents whole (best-fit packed rows with ``cu_seqlens``; weights are
             token shares; see :mod:`data.best_fit_loader`).
    eod_mask_loss: zero the loss where the *input* token is EOD (its label would be the first
             token of the next, unrelated document).
    train_samples / valid_samples: samples to index (None = one epoch); loaders wrap around.
    """

    paths: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None
    tokenizer: str = ""
    split: str = "98,2,0"
    seq_length: int = 4096
    micro_batch_size: int = 1
    packing: str = "document"
    eod_mask_loss: bool = True
    seed: int = 1234
    train_samples: Optional[int] = None
    valid_samples: Optional[int] = None
    cache_dir: Optional[str] = None
    model_vocab_size: Optional[int] = None
    num_builder_threads: int = 1


@dataclass
class SFTConfig:
    """Supervised fine-tuning on chat conversations (rows with ``messages: [{role, content}]``).

    path: JSONL / parquet file or HF dataset dir (``save_to_disk``) or HF data dir.
    paths / weights: several such inputs instead of ``path``; ``weights`` (one per path, None = all 1)
          is how often each input's conversations appear per epoch: 1 = each once, 2 = twice,
          0.5 = a random half (drawn anew every epoch).
    val_fraction: share of the conversations held out (by ``seed``) for validation (``val_loss``).
    cache_dir: where tokenized conversations are cached, keyed by a content hash of the inputs,
          the tokenizer and the settings below (null: ``.sft_cache`` next to the first input).
          Rank 0 tokenizes once; the other ranks wait and read the cache (use a shared filesystem).
    chat_template: "chatml" (built-in renderer) or "tokenizer" (the tokenizer's own Jinja template).
    pack: pack several conversations per row of ``seq_length`` tokens (with ``cu_seqlens``);
          otherwise one conversation per row, right-padded.
    overlong: conversations longer than ``seq_length`` are "truncate"d or "drop"ped (counted).
    on_bad_example: "count" (skip and count unknown roles / empty / no assistant) or "error".
    warn_dropped_fraction / max_dropped_fraction: share of rows skipped or dropped (bad, over-long)
          above which loading warns / stops with an error.
    """

    path: str = ""
    tokenizer: str = ""
    seq_length: int = 4096
    micro_batch_size: int = 1
    chat_template: str = "chatml"
    pack: bool = True
    overlong: str = "truncate"
    on_bad_example: str = "count"
    messages_field: str = "messages"
    seed: int = 1234
    model_vocab_size: Optional[int] = None
    warn_dropped_fraction: float = 0.1
    max_dropped_fraction: float = 0.5
    paths: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None
    val_fraction: float = 0.0
    cache_dir: Optional[str] = None

    def inputs(self) -> list[str]:
        """The input files / dirs: ``paths``, or ``[path]``."""
        return list(self.paths) if self.paths else ([self.path] if self.path else [])


def _check_tokenizer_dir(path: str, what: str, model_vocab_size: Optional[int] = None) -> None:
    if not path:
        raise ValueError(f"{what}.tokenizer is empty: set it to an HF tokenizer dir "
                         "(e.g. from `python -m data.demo_corpus`)")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"{what}.tokenizer={path!r} has no tokenizer.json: point it to a saved HF fast-tokenizer dir")
    if model_vocab_size is not None:
        from tokenizers import Tokenizer as RustTokenizer

        n = RustTokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        if n > model_vocab_size:
            raise ValueError(f"{what}.tokenizer={path!r} has {n} tokens but the model's vocabulary is "
                             f"{model_vocab_size}: use a model with vocab_size >= {n} or a smaller tokenizer")


def _check_indexed(prefix: str) -> None:
    """Both files of an indexed dataset exist, are whole (:func:`data.indexed.read_index`) and hold at least one
    document."""
    from data.indexed import read_index

    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise ValueError(f"data.paths entry {prefix!r}: {prefix + ext} not found; build it with "
                             f"`python -m data.preprocess --out {prefix}`")
    try:
        lengths, _ = read_index(prefix)
    except ValueError as e:
        raise ValueError(f"data.paths entry {prefix!r}: {e}") from None
    if len(lengths) == 0 or os.path.getsize(prefix + ".bin") == 0:
        raise ValueError(f"data.paths entry {prefix!r} is empty (0 documents); rebuild it with "
                         f"`python -m data.preprocess --out {prefix}`")


def _check_common(c, what: str, dp_size: int) -> None:
    if c.seq_length <= 0:
        raise ValueError(f"{what}.seq_length={c.seq_length} must be > 0")
    if c.micro_batch_size <= 0:
        raise ValueError(f"{what}.micro_batch_size={c.micro_batch_size} must be > 0")
    if dp_size <= 0:
        raise ValueError(f"dp_size={dp_size} must be > 0")
    if c.model_vocab_size is not None and c.model_vocab_size <= 0:
        raise ValueError(f"{what}.model_vocab_size={c.model_vocab_size} must be > 0 or null")


def validate(cfg: DataConfig | SFTConfig, dp_size: int = 1, check_files: bool = True) -> None:
    """Raise a one-line ``ValueError`` for the first invalid field of ``cfg``."""
    if isinstance(cfg, DataConfig):
        what = "data"
        _check_common(cfg, what, dp_size)
        if not cfg.paths:
            raise ValueError("data.paths is empty: give one or more indexed-dataset prefixes "
                             "(<prefix>.bin/.idx from `python -m data.preprocess`)")
        if cfg.weights is not None:
            if len(cfg.weights) != len(cfg.paths):
                raise ValueError(f"data.weights has {len(cfg.weights)} entries but data.paths has {len(cfg.paths)}: "
                                 "give one weight per path or null")
            if any(w < 0 for w in cfg.weights) or sum(cfg.weights) <= 0:
                raise ValueError(f"data.weights={cfg.weights} must be non-negative with a positive sum")
        if cfg.packing not in PACKING_MODES:
            raise ValueError(f"data.packing={cfg.packing!r} is not one of {PACKING_MODES}")
        if cfg.packing in ("document", "best_fit") and not cfg.eod_mask_loss:
            raise ValueError(f"data.eod_mask_loss=false with packing={cfg.packing} would train labels across "
                             "documents: set it true")
        parts = [p for p in cfg.split.replace(" ", "").split(",") if p]
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"data.split={cfg.split!r} must be comma-separated numbers like '98,2,0'") from None
        if not 1 <= len(nums) <= 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
            raise ValueError(f"data.split={cfg.split!r} needs 1-3 non-negative weights with a positive sum, "
                             "like '98,2,0'")
        for n in ("train_samples", "valid_samples"):
            v = getattr(cfg, n)
            if v is not None and v <= 0:
                raise ValueError(f"data.{n}={v} must be > 0 or null (one epoch)")
        if check_files:
            from data.loss_spans import has_loss_from

            for p in cfg.paths:
                _check_indexed(p)
                if has_loss_from(p) and cfg.packing != "best_fit":
                    raise ValueError(f"data.paths entry {p!r} trains only parts of its documents "
                                     f"({p}.loss_from.npy), which needs data.packing=best_fit")
            from data.indexed import check_parts_fill_a_sample, check_token_ids

            if cfg.packing != "best_fit":  # best-fit rows are counted when the loader builds its epoch
                weighted = cfg.weights is not None and len(cfg.paths) > 1
                check_parts_fill_a_sample(cfg, [1, 1, 1 if weighted else None], weighted)  # the trainer's asks
            _check_tokenizer_dir(cfg.tokenizer, what, cfg.model_vocab_size)
            if cfg.model_vocab_size is not None:  # reads every token once
                for p in cfg.paths:
                    check_token_ids(p, cfg.model_vocab_size, "data.paths entry")
    elif isinstance(cfg, SFTConfig):
        what = "sft"
        _check_common(cfg, what, dp_size)
        if cfg.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"sft.chat_template={cfg.chat_template!r} is not one of {CHAT_TEMPLATES}")
        if cfg.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"sft.overlong={cfg.overlong!r} is not one of {OVERLONG_POLICIES}")
        if cfg.on_bad_example not in BAD_EXAMPLE_POLICIES:
            raise ValueError(f"sft.on_bad_example={cfg.on_bad_example!r} is not one of {BAD_EXAMPLE_POLICIES}")
        if not 0 <= cfg.warn_dropped_fraction <= cfg.max_dropped_fraction <= 1:
            raise ValueError(f"need 0 <= sft.warn_dropped_fraction ({cfg.warn_dropped_fraction}) <= "
                             f"sft.max_dropped_fraction ({cfg.max_dropped_fraction}) <= 1")
        if cfg.path and cfg.paths:
            raise ValueError("sft.path and sft.paths are both set: give one input as sft.path or several as sft.paths")
        if cfg.weights is not None:
            if len(cfg.weights) != len(cfg.inputs()):
                raise ValueError(f"sft.weights has {len(cfg.weights)} entries but there are {len(cfg.inputs())} inputs "
                                 f"(sft.paths): give one weight per path or null")
            if any(w < 0 for w in cfg.weights) or sum(cfg.weights) <= 0:
                raise ValueError(f"sft.weights={cfg.weights} must be non-negative with a positive sum")
        if not 0 <= cfg.val_fraction < 1:
            raise ValueError(f"sft.val_fraction={cfg.val_fraction} must be in [0, 1) (e.g. 0.01)")
        if check_files:
            if not cfg.inputs():
                raise ValueError("sft.path is empty: give a JSONL/parquet file or an HF dataset dir "
                                 "(or several as sft.paths)")
            for p in cfg.inputs():
                if not os.path.exists(p):
                    key = "sft.path" if cfg.path else "sft.paths entry"
                    raise ValueError(f"{key}={p!r} does not exist: give a JSONL/parquet file or an HF dataset dir")
            _check_tokenizer_dir(cfg.tokenizer, what, cfg.model_vocab_size)
    else:
        raise ValueError(f"validate() got {type(cfg).__name__}: expected DataConfig or SFTConfig")
