"""Haystack material from our own corpus: clean paragraphs and a word vocabulary.

Paragraphs (blank-line separated) of 40-800 characters that hold no number of 4+ digits (so a
needle's number is the only one of its kind), no special-token text (``<|``) and no control
characters; words are lowercase alphabetic words of 4-9 letters seen at least 3 times in those paragraphs.
The corpus is a JSONL file with a ``text`` field or an indexed dataset prefix (decoded with the
tokenizer).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eval.errors import EvalError

_DIGITS = re.compile(r"\d{4,}")
_WORD = re.compile(r"\b[a-z]{4,9}\b")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass
class Haystack:
    paragraphs: list[str]
    paragraph_tokens: list[int]  # tokens of each paragraph (+1 for its newline separator)
    words: list[str]  # sorted by corpus frequency, most frequent first


def corpus_texts(corpus: str, tok, max_docs: int = 2000) -> list[str]:
    """Document texts of a JSONL file (``text`` field) or an indexed dataset prefix."""
    if Path(corpus + ".bin").is_file() and Path(corpus + ".idx").is_file():
        from data.indexed import read_indexed

        ds = read_indexed(corpus)
        n = len(ds.sequence_lengths)
        step = max(1, n // max_docs)
        return [tok.decode(ds[i][:-1].tolist()) for i in range(0, n, step)]
    if Path(corpus).is_file():
        from data.sources import ReadStats, iter_rows

        texts = [row.get("text") for _, row in iter_rows(corpus, ReadStats())]
        texts = [t for t in texts if isinstance(t, str) and t]
        step = max(1, len(texts) // max_docs)
        return texts[::step]
    raise EvalError(f"--corpus {corpus}: neither an indexed dataset prefix ({corpus}.bin/.idx) nor a JSONL file")


def build_haystack(texts: list[str], tok, min_paragraphs: int = 50, max_paragraphs: int = 8000) -> Haystack:
    """Usable paragraphs (at most ``max_paragraphs``, spread over the corpus, in corpus order) and words."""
    paras = []
    for text in texts:
        for p in text.split("\n\n"):
            p = p.strip()
            if 40 <= len(p) <= 800 and not _DIGITS.search(p) and "<|" not in p and not _CONTROL.search(p):
                paras.append(p)
    paras = paras[::max(1, len(paras) // max_paragraphs)][:max_paragraphs]
    if len(paras) < min_paragraphs:
        raise EvalError(f"the corpus has only {len(paras)} usable paragraphs (need {min_paragraphs}); "
                        "give a larger --corpus")
    lens = [len(ids) + 1 for ids in tok.encode_plain(paras)]
    counts = Counter(w for p in paras for w in _WORD.findall(p))
    words = [w for w, c in counts.most_common() if c >= 3]
    return Haystack(paras, lens, words)
