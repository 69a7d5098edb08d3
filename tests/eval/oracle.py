"""A scripted retriever for scorer tests: it reads the prompt as a program would (needles, variable
chains, word counts) and predicts its answers' tokens, so the scorer must say "yes" to it. It never
looks at the answer text that follows the prompt.

``token_logprobs(ids)`` has the signature of ``eval.load.EvalModel.token_logprobs``; ``OracleLM``
wraps it as an lm-evaluation-harness model. ``corrupt=True`` changes the last character of every
answer (strict score 0, most answer tokens still right: the graded signals must see that)."""

from __future__ import annotations

import re
from collections import Counter

import torch

LEAD_INS = [
    re.compile(r"mentioned in the provided text (?:is|are)"),  # the four needle tasks
    re.compile(r"assigned the value \d+, they are:"),  # vt
    re.compile(r"appearing most often in the list are:"),  # cwe
    re.compile(r"the three most frequently appeared words are:"),  # fwe
]


def split_prompt(text: str) -> str:
    """The prompt: the text up to the end of the last answer lead-in."""
    ends = [m.end() for rx in LEAD_INS for m in rx.finditer(text)]
    if not ends:
        raise ValueError("no answer lead-in in the text")
    return text[:max(ends)]


def solve(prompt: str) -> list[str]:
    """The answers a perfect reader gives, from the prompt alone."""
    q = prompt[prompt.rindex("\n") + 1:]
    if "special magic number" in q:
        needles = re.findall(r"One of the special magic numbers for (\w+) is: (\d+)\.", prompt)
        asked = re.search(r"The special magic numbers? for (.+?) mentioned in the provided text (?:is|are)$",
                          q).group(1)
        keys = re.split(r", | and ", asked)
        return [v for k in keys for key, v in needles if key == k]
    if "VAR " in prompt and "they are:" in q:
        value = re.search(r"assigned the value (\d+), they are:$", q).group(1)
        assigned = re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d+)\.", prompt)
        holds, names = {value}, []
        for name, src in assigned:  # a chain is written in order of assignment
            if src in holds:
                holds.add(name)
                names.append(name)
        return names
    if "numbered list of words" in prompt:
        n = int(re.search(r"What are the (\d+) most common words", q).group(1))
        listing = re.findall(r"^\d+\. ([a-z]+)$", prompt, re.M)
        top = [w for w, _ in Counter(listing).most_common(n)]
        return sorted(top, key=listing.index)
    body = prompt.split("\n", 1)[1].rsplit("\nQuestion:", 1)[0]
    return [w for w, _ in Counter(body.split()).most_common(3)]


class RetrievalOracle:
    def __init__(self, encode, decode, corrupt: bool = False):
        self.encode, self.decode, self.corrupt = encode, decode, corrupt

    def answer_text(self, prompt: str) -> str:
        answers = solve(prompt)
        if self.corrupt:
            answers = [a[:-1] + ("0" if a[-1] != "0" else "1") if a[-1].isdigit() else a[:-1] + "q" for a in answers]
        return prompt + "".join((" " if j == 0 else ", ") + a for j, a in enumerate(answers))

    @torch.no_grad()
    def token_logprobs(self, ids: torch.Tensor):
        """``(logprob of ids[t+1], greedy id)`` for t < T-1: the prompt's own tokens, then the oracle's."""
        ids = ids.reshape(-1).tolist()
        predicted = self.encode(self.answer_text(split_prompt(self.decode(ids))))
        greedy = [predicted[t + 1] if t + 1 < len(predicted) else ids[t + 1] for t in range(len(ids) - 1)]
        greedy_t = torch.tensor(greedy)
        lp = torch.where(greedy_t == torch.tensor(ids[1:]), torch.tensor(-0.01), torch.tensor(-9.0))
        return lp, greedy_t


def oracle_lm(oracle: RetrievalOracle):
    """The oracle as an ``lm_eval.api.model.LM`` (loglikelihood requests only)."""
    from lm_eval.api.model import LM

    class OracleLM(LM):
        def loglikelihood(self, requests):
            out = []
            for req in requests:
                ctx, cont = req.args
                ids = oracle.encode(ctx + cont)
                n_ctx = len(oracle.encode(ctx))
                lp, greedy = oracle.token_logprobs(torch.tensor(ids))
                seg = slice(n_ctx - 1, len(ids) - 1)
                target = torch.tensor(ids[1:])[seg]
                out.append((float(lp[seg].sum()), bool((greedy[seg] == target).all())))
            return out

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    return OracleLM()
