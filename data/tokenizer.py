"""Tokenizer loading (local HF fast-tokenizer dirs only), the megatron-core adapter, BPE training.

A tokenizer dir may be a bare tokenizer or a whole model dir (an export of ``checkpoints_convert.to_hf``,
a stock Hugging Face model): :func:`load_hf_tokenizer` reads only the tokenizer files, never the
model's ``config.json``, so no model code runs and transformers asks nothing.

Conventions: ``eod`` = id of ``<|endoftext|>`` if present else the EOS id (appended after every
pretraining document); ``pad`` = a dedicated pad id distinct from ``eod`` or -1 (megatron-core's
"no pad" value), so padding never masks real EOD labels.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

EOD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOD_TOKEN, IM_START, IM_END, PAD_TOKEN]

# ChatML, identical to data.sft.render_chatml (a test checks they agree).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_hf_tokenizer(path: str):
    """The transformers tokenizer of the local dir ``path`` (``tokenizer.json`` required) without
    reading its model config: the class named in ``tokenizer_config.json`` when transformers has it,
    else the generic fast tokenizer. Tokenizer code shipped in the dir is never run."""
    from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

    try:  # a blank config stands in for config.json, which names the model class, not the tokenizer
        return AutoTokenizer.from_pretrained(path, config=PretrainedConfig(), trust_remote_code=False,
                                             local_files_only=True)
    except (ValueError, OSError, KeyError, AttributeError, ImportError):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


# tokenizer_config.json classes that build their backend straight from tokenizer.json
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                       "additional_special_tokens", "extra_special_tokens", "added_tokens_decoder")


def _token_strings(value) -> list[str]:
    """The token strings in a tokenizer_config value: a string, an AddedToken dict, or lists/dicts of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return [value["content"]]
        return [t for v in value.values() for t in _token_strings(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _token_strings(v)]
    return []


def _json_file(path: str, default):
    if not os.path.isfile(path):
        return default
    with open(path) as f:
        return json.load(f)


def plain_backend(path: str):
    """The Rust ``tokenizers.Tokenizer`` of ``path/tokenizer.json`` when transformers would give the same
    vocabulary (its class is the generic fast tokenizer, every special or added token its config names is
    in tokenizer.json already, no legacy ``added_tokens.json``), else None (transformers decides)."""
    try:
        cfg = _json_file(os.path.join(path, "tokenizer_config.json"), None)
        special = _json_file(os.path.join(path, "special_tokens_map.json"), {})
        if not isinstance(cfg, dict) or not isinstance(special, dict) or \
                cfg.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES or \
                os.path.exists(os.path.join(path, "added_tokens.json")):
            return None
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception:  # any doubt: transformers loads the dir (and reports what is wrong with it)
        return None
    named = _token_strings([cfg.get(k) for k in _SPECIAL_TOKEN_KEYS] + [special.get(k) for k in _SPECIAL_TOKEN_KEYS])
    return backend if all(backend.token_to_id(t) is not None for t in named) else None


class Tokenizer:
    """Thin wrapper over an HF fast tokenizer dir.

    ``hf``: the transformers tokenizer (chat templates); ``backend``: the Rust ``tokenizers.Tokenizer``
    used for fast batch encoding. ``vocab_size`` counts added tokens (= rows the embedding needs).
    ``vocab_size``, ``eod`` and ``pad`` come from tokenizer.json alone when :func:`plain_backend` says
    transformers would find the same; ``hf`` and ``backend`` are then loaded on first use (what
    pretraining needs does not import transformers).
    """

    def __init__(self, path: str):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"tokenizer dir {path!r} has no tokenizer.json: "
                             "only HF fast tokenizers saved locally are supported")
        self.path = os.path.abspath(path)
        self._hf = None
        self._backend = None
        vocab = plain_backend(path)
        if vocab is None:
            vocab = self.backend  # transformers loads it now, as it would report a bad dir
        self.vocab_size = int(vocab.get_vocab_size(with_added_tokens=True))
        eod = vocab.token_to_id(EOD_TOKEN)
        if eod is None:
            eod = self.hf.eos_token_id
        if eod is None:
            raise ValueError(f"tokenizer {path!r} has neither {EOD_TOKEN} nor an eos_token: cannot separate documents")
        self.eod = int(eod)
        pad = vocab.token_to_id(PAD_TOKEN)
        if pad is None:
            pad = self.hf.pad_token_id
        self.pad = int(pad) if pad is not None and pad != self.eod else -1
        self.eos = self.eod

    @property
    def hf(self):
        """The transformers tokenizer (loaded on first use)."""
        if self._hf is None:
            self._hf = load_hf_tokenizer(self.path)
        return self._hf

    @property
    def backend(self):
        """The transformers tokenizer's Rust ``tokenizers.Tokenizer`` (loaded on first use)."""
        if self._backend is None:
            self._backend = self.hf.backend_tokenizer
        return self._backend

    def token_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        """Encode raw documents; literal special-token strings in the text stay plain text."""
        self.backend.encode_special_tokens = True
        try:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        finally:
            self.backend.encode_special_tokens = False

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Encode rendered chat text (special tokens recognised); offsets are char spans."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def check_model_vocab(self, model_vocab_size: Optional[int]) -> None:
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ValueError(
                f"tokenizer {self.path} has {self.vocab_size} tokens but the model's vocabulary is {model_vocab_size}: "
                f"use a model with vocab_size >= {self.vocab_size} or a smaller tokenizer"
            )


class MegatronTokenizerAdapter:
    """What megatron-core's GPTDataset needs: ``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``."""

    def __init__(self, tok: Tokenizer):
        self.vocab_size = tok.vocab_size
        self.eod = tok.eod
        self.eos = tok.eod
        self.pad = tok.pad
        self.unique_identifiers = {"class": "nosa.data.Tokenizer", "path": tok.path, "vocab_size": tok.vocab_size,
                                   "eod": tok.eod, "pad": tok.pad}


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str, min_frequency: int = 2) -> str:
    """Train a byte-level BPE on ``texts`` and save an HF tokenizer dir with a ChatML template.

    Returns ``out_dir`` (containing tokenizer.json, tokenizer_config.json, special_tokens_map.json).
    """
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "bos_token": None,
        "eos_token": EOD_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, IM_END]},
                  f, indent=2)
    return out_dir
