"""RULER-style synthetic long-context tasks, generated offline from our own corpus.

Every sample is a prompt that ends with an answer prefix (no trailing space) and a list of answer
items; item ``j`` is scored as the continuation ``" " + a_0`` (j = 0) or ``", " + a_j`` after the
prompt and the previous items (teacher forcing). A sample is correct on an item when greedy
decoding would produce exactly that item's tokens (the lm-eval ``acc`` of a loglikelihood
request), so a task's score is RULER's string-match recall with the answer order fixed by the
prompt. Tasks (RULER's names in brackets):

* ``niah_single``: one needle "One of the special magic numbers for KEY is: VALUE." [niah_single]
* ``niah_multikey``: four needles with different keys, one queried [niah_multikey_1]
* ``niah_multivalue``: four values of one key, answered in order of appearance [niah_multivalue]
* ``niah_multiquery``: four keys queried at once, answered in query order [niah_multiquery]
* ``vt``: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... (4 hops); all names holding the value [vt]
* ``cwe``: a numbered word list; the words repeated most often, in order of first appearance [cwe]
* ``fwe``: a text of corpus words with Zipf-like counts; the three most frequent, most first [fwe]

Haystacks are consecutive corpus paragraphs; values are random digits; keys and words are corpus
words. Everything is drawn from ``random.Random(f"{seed}-{task}-{length}-{index}")``: the same
seed gives the same samples byte for byte. Each sample's full text (prompt and every answer item)
fits ``length`` tokens of the model's tokenizer.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Callable

from eval.errors import EvalError
from eval.tasks.haystack import Haystack

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.")
VALUE_DIGITS = 7


@dataclass
class TaskSample:
    """One sample: ``prompt`` (ends with the answer prefix), ``answers`` in scoring order, and
    ``evidence``: ``[start, end)`` character spans of the prompt holding each answer's needle or
    assignment (empty for the word-counting tasks)."""

    task: str
    length: int
    index: int
    prompt: str
    answers: list[str]
    evidence: list[list[int]] = field(default_factory=list)
    tokens: int = 0  # tokens of the full text (prompt + every item)

    def continuations(self) -> list[str]:
        return [(" " if j == 0 else ", ") + a for j, a in enumerate(self.answers)]

    def contexts(self) -> list[str]:
        conts = self.continuations()
        return [self.prompt + "".join(conts[:j]) for j in range(len(conts))]

    def full_text(self) -> str:
        return self.prompt + "".join(self.continuations())


class _Builder:
    """Shared pieces: a seeded RNG per sample, token counting and fitting to ``length``."""

    def __init__(self, hay: Haystack, encode: Callable[[str], list], task: str, length: int, index: int, seed: int):
        self.hay, self.encode, self.task, self.length, self.index = hay, encode, task, length, index
        self.rng = random.Random(f"{seed}-{task}-{length}-{index}")

    def n_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def value(self, digits: int = VALUE_DIGITS, avoid: set = frozenset()) -> str:
        while True:
            v = str(self.rng.randrange(10 ** (digits - 1), 10 ** digits))
            if v not in avoid:
                return v

    def words(self, n: int, pool: int = 3000) -> list[str]:
        cands = self.hay.words[:pool]
        if len(cands) < n:
            raise EvalError(f"the corpus has only {len(cands)} distinct words; give a larger --corpus")
        return self.rng.sample(cands, n)

    def paragraphs(self, budget: int) -> list[str]:
        """Consecutive paragraphs from a random start, about ``budget`` tokens."""
        hay, out, n = self.hay, [], 0
        i = self.rng.randrange(len(hay.paragraphs))
        while n < budget:
            out.append(hay.paragraphs[i % len(hay.paragraphs)])
            n += hay.paragraph_tokens[i % len(hay.paragraphs)]
            i += 1
        return out

    def sample(self, prompt: str, answers: list[str], evidence: list[list[int]]) -> TaskSample:
        s = TaskSample(self.task, self.length, self.index, prompt, answers, evidence)
        s.tokens = self.n_tokens(s.full_text())
        return s

    def haystack_sample(self, intro: str, inserts: list[str], depths: list[float], question: str,
                        answers: list[str], evidence_of: list[int]) -> TaskSample:
        """Paragraphs with ``inserts`` placed at ``depths`` (fractions, in order), then the question.

        ``evidence_of[j]``: the insert that holds answer ``j``. Paragraphs are dropped from the end
        until the full text fits ``length`` tokens."""
        fixed = self.n_tokens("\n".join([intro, *inserts, question, ", ".join(answers)])) + 8
        paras = self.paragraphs(max(0, self.length - fixed))
        while True:
            slots = [min(len(paras), round(d * len(paras))) for d in depths]
            body = []
            for i in range(len(paras) + 1):  # inserts of one slot keep their order
                body += [text for slot, text in zip(slots, inserts) if slot == i]
                body += paras[i:i + 1]
            prompt = intro + "\n" + "\n".join(body) + "\n" + question
            spans = []
            for text in inserts:
                start = prompt.index(text)
                spans.append([start, start + len(text)])
            s = self.sample(prompt, answers, [spans[i] for i in evidence_of])
            if s.tokens <= self.length:
                return s
            if not paras:
                raise EvalError(f"task {self.task}: the question and needles alone exceed {self.length} tokens; "
                                f"use a larger length")
            excess, last = s.tokens - self.length, paras[-1]
            keep = int(len(last) * (1 - (excess + 4) / max(1, self.n_tokens(last))))
            cut = last.rfind(" ", 0, keep) if keep > 0 else -1
            paras = paras[:-1] + ([last[:cut]] if cut > 0 else [])  # shorten the last paragraph, else drop it


def _needles(b: _Builder, keys: list[str], values: list[str]) -> list[str]:
    return [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]


def _depths(b: _Builder, n: int) -> list[float]:
    if n == 1:  # single needle: depths spread evenly over the samples
        return [((b.index * 0.618034) % 1.0)]
    return sorted(b.rng.random() for _ in range(n))


def niah_single(b: _Builder) -> TaskSample:
    key, value = b.words(1)[0], b.value()
    q = (f"What is the special magic number for {key} mentioned in the provided text? "
         f"The special magic number for {key} mentioned in the provided text is")
    return b.haystack_sample(NIAH_INTRO, _needles(b, [key], [value]), _depths(b, 1), q, [value], [0])


def niah_multikey(b: _Builder) -> TaskSample:
    keys = b.words(4)
    values = []
    for _ in keys:
        values.append(b.value(avoid=set(values)))
    pick = b.rng.randrange(4)
    q = (f"What is the special magic number for {keys[pick]} mentioned in the provided text? "
         f"The special magic number for {keys[pick]} mentioned in the provided text is")
    return b.haystack_sample(NIAH_INTRO, _needles(b, keys, values), _depths(b, 4), q, [values[pick]], [pick])


def niah_multivalue(b: _Builder) -> TaskSample:
    key = b.words(1)[0]
    values = []
    for _ in range(4):
        values.append(b.value(avoid=set(values)))
    q = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
         f"The special magic numbers for {key} mentioned in the provided text are")
    return b.haystack_sample(NIAH_INTRO, _needles(b, [key] * 4, values), _depths(b, 4), q, values, [0, 1, 2, 3])


def niah_multiquery(b: _Builder) -> TaskSample:
    keys = b.words(4)
    values = []
    for _ in keys:
        values.append(b.value(avoid=set(values)))
    order = b.rng.sample(range(4), 4)
    asked = ", ".join(keys[i] for i in order[:3]) + f" and {keys[order[3]]}"
    q = (f"What are all the special magic numbers for {asked} mentioned in the provided text? "
         f"The special magic numbers for {asked} mentioned in the provided text are")
    return b.haystack_sample(NIAH_INTRO, _needles(b, keys, values), _depths(b, 4), q,
                             [values[i] for i in order], order)


def vt(b: _Builder, hops: int = 4) -> TaskSample:
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(b.rng.choice(string.ascii_uppercase) for _ in range(5))
        if n not in names:
            names.append(n)
    value = b.value(digits=5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    intro = "Memorize and track the chain of variable assignments hidden in the following text."
    q = (f"Question: Find all variables that are assigned the value {value} in the text above. "
         f"Answer: According to the chain of variable assignments in the text above, {hops + 1} variables are "
         f"assigned the value {value}, they are:")
    return b.haystack_sample(intro, chain, _depths(b, hops + 1), q, names, list(range(hops + 1)))


def cwe(b: _Builder, num_common: int = 5) -> TaskSample:
    """Numbered list: ``num_common`` words repeated ``f_c`` times, the others twice, shuffled."""
    intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.")
    q = (f"Question: What are the {num_common} most common words in the above list? Answer in order of first "
         f"appearance. Answer: The top {num_common} words appearing most often in the list are:")
    per_entry = b.n_tokens("\n123. example") + 0.5
    entries = int((b.length - b.n_tokens(intro + q) - 6 * num_common - 16) / per_entry)
    freq_c = max(4, min(30, entries // (3 * num_common)))
    words = b.words(num_common + max(1, (entries - freq_c * num_common) // 2), pool=len(b.hay.words))
    common, rare = words[:num_common], words[num_common:]
    while True:
        items = [w for w in common for _ in range(freq_c)] + [w for w in rare for _ in range(2)]
        b.rng.shuffle(items)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        order = sorted(common, key=items.index)
        s = b.sample(intro + "\n" + listing + "\n" + q, order, [])
        if s.tokens <= b.length:
            return s
        if not rare:
            raise EvalError(f"task cwe: the common words alone exceed {b.length} tokens; use a larger length")
        rare = rare[:-max(1, (s.tokens - b.length) // 6)]


def fwe(b: _Builder, top: int = 3) -> TaskSample:
    """Corpus words with counts ``round(c / rank)``; the ``top`` most frequent are the answer."""
    intro = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequently appeared coded words.")
    q = ("Question: What are the three most frequently appeared words in the above coded text? Answer from the "
         "most frequent down. Answer: According to the coded text above, the three most frequently appeared words are:")
    budget_words = int((b.length - b.n_tokens(intro + q) - 24) / (b.n_tokens(" example") + 0.4))
    vocab = b.words(min(200, max(8, budget_words // 6)), pool=len(b.hay.words))
    harmonic = sum(1.0 / r for r in range(1, len(vocab) + 1))
    scale = budget_words / harmonic
    while True:
        counts = [max(1, round(scale / r)) for r in range(1, len(vocab) + 1)]
        if not counts[0] > counts[1] > counts[2] > max(counts[3:] or [0]):
            raise EvalError(f"task fwe: {b.length} tokens are too few for distinct word counts; use a larger length")
        items = [w for w, c in zip(vocab, counts) for _ in range(c)]
        b.rng.shuffle(items)
        lines = [" ".join(items[i:i + 16]) for i in range(0, len(items), 16)]
        s = b.sample(intro + "\n" + "\n".join(lines) + "\n" + q, vocab[:top], [])
        if s.tokens <= b.length:
            return s
        scale *= 0.97 * b.length / s.tokens


TASKS: dict[str, Callable[[_Builder], TaskSample]] = {
    "niah_single": niah_single, "niah_multikey": niah_multikey, "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery, "vt": vt, "cwe": cwe, "fwe": fwe,
}


def generate(task: str, hay: Haystack, encode: Callable[[str], list], length: int, count: int,
             seed: int, start: int = 0) -> list[TaskSample]:
    """Samples ``start .. start + count - 1`` of ``task`` at ``length`` tokens (``encode``: text -> token
    ids); sample ``i`` depends only on ``(seed, task, length, i)``."""
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    return [TASKS[task](_Builder(hay, encode, task, length, i, seed)) for i in range(start, start + count)]


def item_token_spans(sample: TaskSample, encode: Callable[[str], list]) -> tuple[list[int], list[list[int]]]:
    """Token ids of the full text and each item's ``[start, end)`` token span in them, split as
    lm-eval splits a loglikelihood request (``whole = enc(ctx + cont)``, ``cont = whole[len(enc(ctx)):]``).
    Raises if the tokenizer merges across an item boundary (then one forward would not equal lm-eval)."""
    full = encode(sample.full_text())
    spans = []
    for ctx, cont in zip(sample.contexts(), sample.continuations()):
        c, whole = encode(ctx), encode(ctx + cont)
        if whole != full[:len(whole)] or len(whole) <= len(c):
            raise EvalError(f"task {sample.task}: the tokenizer merges across an answer boundary; "
                            f"items cannot be scored from one forward pass")
        spans.append([len(c), len(whole)])
    return full, spans
