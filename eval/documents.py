"""Long evaluation documents from an indexed dataset prefix or a JSONL file, as token ids.

``--data`` is either a megatron-core indexed dataset prefix (``<prefix>.bin/.idx``, as written by
``data.preprocess``) or a JSONL file with a ``text`` field (tokenized here with the model's
tokenizer). ``split`` (the trainer's ``data.split``, e.g. ``95,5,0``) keeps only the documents of
the validation part, which megatron-core takes as a contiguous range of document indices: the
training run never saw them. Documents shorter than the requested length are skipped; the others
are cut to it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from eval.errors import EvalError


def heldout_range(split: str, num_docs: int) -> range:
    """Document indices of the validation part of a megatron split string (``"95,5,0"``)."""
    try:
        w = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise EvalError(f"--split {split!r}: give the trainer's data.split, e.g. 95,5,0") from None
    if len(w) != 3 or min(w) < 0 or sum(w) <= 0 or w[1] == 0:
        raise EvalError(f"--split {split!r}: need three non-negative weights with a validation part, e.g. 95,5,0")
    total = sum(w)
    lo, hi = w[0] / total, (w[0] + w[1]) / total
    return range(int(round(lo * num_docs)), int(round(hi * num_docs)))


def _file_hash(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def check_same_tokenizer(prefix: str, tokenizer_dir: str) -> None:
    """Refuse an indexed dataset written with another tokenizer (``<prefix>.summary.json``)."""
    summary = Path(prefix + ".summary.json")
    if not summary.is_file():
        return
    used = Path(json.loads(summary.read_text()).get("tokenizer", "")) / "tokenizer.json"
    mine = Path(tokenizer_dir) / "tokenizer.json"
    if used.is_file() and mine.is_file() and _file_hash(used) != _file_hash(mine):
        raise EvalError(f"tokenizer mismatch: {prefix} was tokenized with {used.parent}, the model uses "
                        f"{mine.parent}; re-tokenize the data with the model's tokenizer or pass --tokenizer")


def load_documents(data: str, tok, length: int, count: int, vocab_size: int, split: Optional[str] = None,
                   text_key: str = "text", join: bool = False, log=print) -> list[Tensor]:
    """The first ``count`` documents of at least ``length`` tokens, cut to ``length`` (int64 ``[length]``).

    ``join``: when fewer are that long, fill up with runs of consecutive shorter documents joined
    with their end-of-document token (a note says so)."""
    if count < 1:
        raise EvalError(f"--docs {count}: give at least 1 document to evaluate")
    docs = _token_documents(data, tok, split, text_key)
    longest = max((len(d) for d in docs), default=0)
    picked = [d[:length] for d in docs if len(d) >= length][:count]
    if join and len(picked) < count:
        run: list[Tensor] = []
        for d in (d for d in docs if len(d) < length):
            run.append(torch.cat([d, torch.tensor([tok.eod])]))
            if sum(len(x) for x in run) >= length:
                picked.append(torch.cat(run)[:length])
                run = []
                if len(picked) == count:
                    break
        log(f"(only {sum(len(d) >= length for d in docs)} document(s) of {length} tokens in {data}: "
            f"the others join consecutive shorter documents)")
    if not picked:
        where = f" (validation part of split {split})" if split else ""
        raise EvalError(f"--data {data}{where}: no document has {length} tokens (longest {longest}); "
                        f"lower --length or give longer documents")
    top = max(int(d.max()) for d in picked)
    if top >= vocab_size:
        raise EvalError(f"tokenizer mismatch: --data {data} holds token id {top} but the model's vocabulary is "
                        f"{vocab_size}; tokenize the data with the model's tokenizer")
    return picked


def _token_documents(data: str, tok, split: Optional[str], text_key: str) -> list[Tensor]:
    """Every document of ``data`` (its validation part with ``split``) as token ids, without EOD."""
    if Path(data + ".bin").is_file() and Path(data + ".idx").is_file():
        check_same_tokenizer(data, tok.path)
        from data.indexed import read_indexed

        ds = read_indexed(data)
        n = len(ds.sequence_lengths)
        docs = [torch.from_numpy(ds[i][:-1].astype("int64")) for i in (heldout_range(split, n) if split else range(n))]
    elif Path(data).is_file():
        from data.sources import ReadStats, iter_rows

        texts = [row.get(text_key) for _, row in iter_rows(data, ReadStats())]
        texts = [t for t in texts if isinstance(t, str) and t]
        docs = [torch.tensor(ids, dtype=torch.int64) for ids in tok.encode_plain(texts)] if texts else []
    else:
        raise EvalError(f"--data {data}: neither an indexed dataset prefix ({data}.bin/.idx) nor a JSONL file")
    return docs
