"""Retrieval training data: documents of the RULER-style tasks, generated and tokenized in parallel
straight into an indexed dataset.

    python -m eval.tasks.training_data --tokenizer DIR --corpus <jsonl | prefix> --out PREFIX \\
        --lengths 512,1024,2048,4095 --tokens 60e6 [--seed 0] [--workers N]

A :class:`RetrievalMix` asks for ``tokens`` tokens split evenly over its lengths and tasks, so short
documents (many retrieval events per token) and long ones (long-range evidence) weigh the same in
tokens. Documents are drawn with ``seed + TRAIN_SEED_OFFSET`` (never an evaluation sample of
``seed``); document ``i`` of a (task, length) depends only on the seed, so the dataset is the same
for any number of workers. Each document is its full text (prompt and answers) plus EOD, as
``data.preprocess`` would store it. With ``answers_only`` (the default) ``<prefix>.loss_from.npy``
holds each document's first answer token, so training (``data.packing=best_fit``) learns to answer
from the evidence rather than to memorise the haystack, whose paragraphs repeat across documents.
Written under a temporary prefix and renamed on success, with ``<prefix>.summary.json`` (tokenizer,
mix, documents, tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from data.loss_spans import LOSS_FROM, write_loss_from
from eval.errors import EvalError

TOKENS_PER_JOB = 1_000_000  # a worker's unit of work (documents of one task and length)
SERIAL_BELOW_TOKENS = 2_000_000  # smaller mixes are generated in this process


@dataclass
class RetrievalMix:
    """``tokens`` tokens of task documents, the same share for every (task, length)."""

    lengths: list[int]
    tokens: int
    tasks: list[str] = field(default_factory=list)  # empty: every task
    seed: int = 0
    answers_only: bool = True  # train on the answers only (<prefix>.loss_from.npy), not on the haystack

    def task_names(self) -> list[str]:
        from eval.tasks.ruler import TASKS

        return list(self.tasks or TASKS)

    def plan(self) -> list[tuple[str, int, int]]:
        """``(task, length, documents)`` for every pair (at least one document each)."""
        tasks = self.task_names()
        per_pair = self.tokens / (len(tasks) * len(self.lengths))
        return [(t, n, max(1, round(per_pair / n))) for n in self.lengths for t in tasks]

    def validate(self) -> "RetrievalMix":
        from eval.tasks.ruler import TASKS

        bad = [t for t in self.task_names() if t not in TASKS]
        if bad:
            raise EvalError(f"unknown task(s) {bad}; choose from {sorted(TASKS)}")
        if not self.lengths or min(self.lengths) < 256:
            raise EvalError(f"retrieval document lengths {self.lengths}: give lengths of at least 256 tokens")
        if self.tokens <= 0:
            raise EvalError(f"retrieval tokens {self.tokens}: give a positive number")
        return self


def jobs(mix: RetrievalMix) -> list[tuple[str, int, int, int]]:
    """``(task, length, start, count)`` units of about ``TOKENS_PER_JOB`` tokens, in output order."""
    out = []
    for task, length, count in mix.plan():
        step = max(1, TOKENS_PER_JOB // length)
        out += [(task, length, s, min(step, count - s)) for s in range(0, count, step)]
    return out


def _run_job(job: tuple[str, int, int, int, int]):
    """``(tokens with EOD, first answer token)`` of one job's documents."""
    import numpy as np

    from eval.tasks import TRAIN_SEED_OFFSET
    from eval.tasks.ruler import generate

    from eval.tasks.workers import state

    task, length, start, count, seed = job
    w = state()
    samples = generate(task, w["hay"], w["enc"], length, count, seed + TRAIN_SEED_OFFSET, start=start)
    eod, enc = w["tok"].eod, w["enc"]
    out = []
    for s in samples:
        ids, prompt = enc(s.full_text()), enc(s.prompt)
        start = len(prompt) if ids[:len(prompt)] == prompt else 0  # 0: the tokenizer merged across the boundary
        out.append((np.asarray(ids + [eod], dtype=np.int32), start))
    return out


def build_retrieval_dataset(corpus: str, tokenizer_dir: str, out_prefix: str, mix: RetrievalMix,
                            workers: int | None = None, log=print) -> dict:
    """Write ``out_prefix.bin/.idx`` (+ ``.summary.json``); returns the summary. Skips the work when a
    complete dataset of the same mix and tokenizer is already there."""
    from data.indexed import IndexedWriter
    from data.tokenizer import Tokenizer
    from eval.tasks import tokenizer_hash
    from eval.tasks.workers import default_workers, job_results

    mix.validate()
    tok = Tokenizer(tokenizer_dir)
    want = {"mix": asdict(mix), "tokenizer": str(Path(tokenizer_dir).resolve()),
            "tokenizer_sha1": tokenizer_hash(tokenizer_dir)}
    summary_path = Path(out_prefix + ".summary.json")
    if summary_path.is_file() and Path(out_prefix + ".idx").is_file():
        have = json.loads(summary_path.read_text())
        if all(have.get(k) == v for k, v in want.items() if k != "tokenizer"):
            log(f"retrieval data: {out_prefix} is complete ({have['documents']} documents, {have['tokens']} tokens)")
            return have
    todo = [(*j, mix.seed) for j in jobs(mix)]
    # a pool pays its start (imports, one haystack per worker: seconds) only for real work
    workers = 1 if mix.tokens < SERIAL_BELOW_TOKENS else (workers or default_workers())
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out_prefix}.tmp-{os.getpid()}"
    writer = IndexedWriter(tmp, tok.vocab_size)
    loss_from: list[int] = []
    t0 = last = time.perf_counter()
    ok = False
    try:
        with job_results(_run_job, todo, corpus, tokenizer_dir, workers) as results:
            for k, docs in enumerate(results):
                for d, start in docs:
                    writer.add(d)
                    loss_from.append(start)
                if time.perf_counter() - last > 10 or k + 1 == len(todo):
                    last = time.perf_counter()
                    log(f"retrieval data: {k + 1}/{len(todo)} jobs, {writer.documents} documents, "
                        f"{writer.tokens / 1e6:.1f}M tokens ({last - t0:.0f} s, {workers} workers)")
        writer.close()
        summary = {**want, "documents": writer.documents, "tokens": writer.tokens,
                   "seconds": round(time.perf_counter() - t0, 1), "workers": workers}
        if mix.answers_only:
            write_loss_from(tmp, loss_from)
        for ext in (".bin", ".idx") + ((LOSS_FROM,) if mix.answers_only else ()):
            os.replace(tmp + ext, out_prefix + ext)
        tmp_summary = summary_path.with_suffix(f".tmp-{os.getpid()}")
        tmp_summary.write_text(json.dumps(summary, indent=2))
        os.replace(tmp_summary, summary_path)
        ok = True
        return summary
    finally:
        if not ok:
            writer.discard()
            for ext in (".bin", ".idx", LOSS_FROM):
                Path(tmp + ext).unlink(missing_ok=True)


def main(argv=None) -> int:
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.tasks.training_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", required=True, help="haystack source: JSONL (text field) or indexed prefix")
    ap.add_argument("--out", required=True, help="output prefix (<out>.bin/.idx)")
    ap.add_argument("--lengths", required=True, help="comma-separated document lengths in tokens")
    ap.add_argument("--tokens", type=float, required=True, help="total tokens (e.g. 60e6)")
    ap.add_argument("--tasks", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None)
    a = ap.parse_args(argv)
    mix = RetrievalMix([int(x) for x in a.lengths.split(",")], int(a.tokens),
                       [t for t in a.tasks.split(",") if t], a.seed)
    return run_cli("eval.tasks.training_data", build_retrieval_dataset, a.corpus, a.tokenizer, a.out, mix, a.workers)


if __name__ == "__main__":
    sys.exit(main())
