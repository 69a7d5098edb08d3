"""SFT conversations -> token ids + assistant masks, with bad / over-long examples counted.

A conversation is ``[{"role": r, "content": str}, ...]`` with roles in :data:`ROLES`. Rendering is
text first (ChatML or the tokenizer's Jinja template), then one tokenization with char offsets;
a token is supervised iff its first char lies inside an assistant span, which covers the
assistant content *and* its end-of-turn marker (``<|im_end|>``) but not the header before it
(``<|im_start|>assistant\\n``) nor the newline after it.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from data.sources import BadInputError, ReadStats, iter_rows
from data.tokenizer import IM_END, IM_START, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def render_chatml(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text and the char spans ``[start, end)`` of each assistant content + ``<|im_end|>``."""
    parts, spans, o = [], [], 0
    for m in messages:
        head = f"{IM_START}{m['role']}\n"
        body = m["content"] + IM_END
        if m["role"] == "assistant":
            spans.append((o + len(head), o + len(head) + len(body)))
        piece = head + body + "\n"
        parts.append(piece)
        o += len(piece)
    return "".join(parts), spans


def render_with_template(tok: Tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render with the tokenizer's own chat template; assistant spans by prefix differences.

    Span of assistant message i = render(messages[:i+1]) minus render(messages[:i], generation prompt),
    right-stripped of whitespace. Refuses templates whose renders are not prefixes of each other.
    """
    def r(msgs, gen=False):
        return tok.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = r(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = r(messages[:i], gen=True), r(messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError("the tokenizer's chat template is not prefix-stable (history changes with later turns); "
                             "use chat_template=chatml")
        spans.append((len(before), len(upto.rstrip())))
    return full, spans


def check_conversation(messages, field_name: str = "messages") -> str | None:
    """Return the reason a conversation is unusable, or None."""
    if not isinstance(messages, list) or not messages:
        return f"missing or empty {field_name!r}"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "malformed message (needs string 'role' and 'content')"
        if m["role"] not in ROLES:
            return f"unknown role {m['role']!r}"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def tokenize_conversation(tok: Tokenizer, messages: list[dict],
                          template: str = "chatml") -> tuple[np.ndarray, np.ndarray]:
    """Return ``ids`` int32 [n] and ``mask`` uint8 [n] (1 = assistant token incl. end-of-turn)."""
    text, spans = render_chatml(messages) if template == "chatml" else render_with_template(tok, messages)
    ids, offsets = tok.encode_with_offsets(text)
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return np.asarray(ids, dtype=np.int32), mask


@dataclass
class SFTData:
    """Tokenized conversations: ``ids[i]`` int32 [n_i], ``masks[i]`` uint8 [n_i], ``sources[i]`` the
    index of the input (``SFTConfig.inputs()``) it came from; ``stats`` counts."""

    ids: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)
    read: ReadStats = field(default_factory=ReadStats)
    origin: str = ""  # where it came from (for the summary): "tokenized", "from cache <dir>", ...

    def summary(self) -> str:
        s = dict(self.stats)
        extra = "; ".join(self.read.summary_lines()[1:]).strip()
        return (f"[sft] {len(self.ids)} conversations kept, {sum(len(x) for x in self.ids)} tokens, "
                f"{int(sum(m.sum() for m in self.masks))} supervised; counts {s}" + (f"; {extra}" if extra else "")
                + (f" ({self.origin})" if self.origin else ""))

    def subset(self, index) -> SFTData:
        """The conversations ``index`` (same stats, same read counts)."""
        return SFTData([self.ids[i] for i in index], [self.masks[i] for i in index],
                       [self.sources[i] for i in index], self.stats, self.read, self.origin)


def _progress_bar(inputs: list[str]):
    """A tqdm bar over the bytes of plain JSONL inputs (else over rows), on stderr."""
    import os

    from tqdm import tqdm

    plain = all(os.path.isfile(p) and p.endswith((".jsonl", ".json", ".ndjson")) for p in inputs)
    total = sum(os.path.getsize(p) for p in inputs) if plain else None
    return tqdm(total=total, unit="B" if plain else "conv", unit_scale=True, desc="sft tokenize", file=sys.stderr,
                mininterval=1.0)


def tokenize_inputs(cfg, tok: Tokenizer, progress: bool = False) -> SFTData:
    """Read, validate, render and tokenize every conversation of ``cfg.inputs()`` (an ``SFTConfig``);
    bad and over-long ones are counted (or raise with ``on_bad_example=error``). No threshold checks."""
    strict = cfg.on_bad_example == "error"
    out = SFTData(origin="tokenized")
    inputs = cfg.inputs()
    bar = _progress_bar(inputs) if progress else None
    try:
        for src, path in enumerate(inputs):
            for where, row in iter_rows(path, out.read, strict=strict):
                if bar is not None:
                    bar.update((out.read.bytes_read if bar.unit == "B" else out.read.rows) - bar.n)
                msgs = row.get(cfg.messages_field)
                reason = check_conversation(msgs, cfg.messages_field)
                if reason:
                    out.read.reject(reason, where, strict)
                    continue
                ids, mask = tokenize_conversation(tok, msgs, cfg.chat_template)
                if len(ids) > cfg.seq_length:
                    if cfg.overlong == "drop":
                        out.stats["dropped_overlong"] += 1
                        continue
                    ids, mask = ids[: cfg.seq_length], mask[: cfg.seq_length]
                    out.stats["truncated"] += 1
                if mask[1:].sum() == 0:  # position 0 is never a target
                    out.read.reject("no assistant tokens within seq_length", where, strict)
                    continue
                out.read.kept += 1
                out.ids.append(ids)
                out.masks.append(mask)
                out.sources.append(src)
    finally:
        if bar is not None:
            bar.close()
    for reason, n in out.read.rejected.items():
        out.stats[f"skipped: {reason}"] = n
    return out


def check_losses(data: SFTData, cfg, log=None) -> SFTData:
    """Refuse (one line) data without a usable conversation or losing more than
    ``max_dropped_fraction``; warn above ``warn_dropped_fraction``; log the summary."""
    log = log or (lambda m: print(m, file=sys.stderr))
    where = cfg.path or ", ".join(cfg.inputs())
    if not data.ids:
        raise BadInputError(f"no usable conversations in {where!r}: {'; '.join(data.read.summary_lines())}")
    lost = sum(data.read.rejected.values()) + data.stats["dropped_overlong"]
    share = lost / max(data.read.rows, 1)
    if share > cfg.max_dropped_fraction:
        raise BadInputError(f"{lost} of {data.read.rows} conversations in {where!r} ({share:.0%}) are unusable "
                            f"({'; '.join(f'{k}: {v}' for k, v in sorted(data.stats.items()))}), above "
                            f"sft.max_dropped_fraction={cfg.max_dropped_fraction}: fix the data or raise the limit")
    if share > cfg.warn_dropped_fraction:
        log(f"warning: {lost} of {data.read.rows} SFT conversations ({share:.0%}) were skipped or dropped, above "
            f"sft.warn_dropped_fraction={cfg.warn_dropped_fraction}")
    log(data.summary())
    return data


def load_sft(cfg, tok: Tokenizer | None = None, log=None) -> SFTData:
    """Tokenize every conversation of ``cfg`` (an ``SFTConfig``, no cache) and check what was lost."""
    tok = tok or Tokenizer(cfg.tokenizer)
    tok.check_model_vocab(cfg.model_vocab_size)
    return check_losses(tokenize_inputs(cfg, tok), cfg, log)


def split_validation(data: SFTData, fraction: float, seed: int) -> tuple[SFTData, SFTData | None]:
    """``(train, valid)``: ``round(fraction * n)`` conversations (at least 1 when ``fraction > 0``,
    chosen by ``seed``) held out for validation; ``valid`` is None for ``fraction == 0``."""
    n = len(data.ids)
    if fraction <= 0:
        return data, None
    k = max(1, round(fraction * n))
    if k >= n:
        raise BadInputError(f"sft.val_fraction={fraction} holds out {k} of {n} conversations, leaving none to "
                            f"train on: lower it or add data")
    held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
    return (data.subset([i for i in range(n) if i not in held]), data.subset(sorted(held)))
