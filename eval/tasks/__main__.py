"""``python -m eval.tasks --tokenizer DIR --corpus <jsonl | prefix> --out DIR [--lengths 4096,8192,16384]
[--samples 20] [--seed 0] [--tasks niah_single,...] [--train-docs N [--train-lengths ...]]``: generate a
RULER-style task set (and, with ``--train-docs``, training documents of the same tasks)."""

from __future__ import annotations

import argparse
import sys

from eval.tasks import DEFAULT_LENGTHS, TASKS, TaskSetConfig, build_task_set


def run(a) -> None:
    from eval.errors import EvalError, int_list
    from data.tokenizer import Tokenizer

    lengths = int_list(a.lengths, "--lengths")
    train_lengths = int_list(a.train_lengths, "--train-lengths") if a.train_lengths else None
    try:
        tok = Tokenizer(a.tokenizer)
    except ValueError as e:
        raise EvalError(f"--tokenizer {a.tokenizer}: {e}") from None
    cfg = TaskSetConfig(lengths=lengths, tasks=a.tasks.split(","), samples=a.samples, seed=a.seed,
                        train_docs=a.train_docs, train_lengths=train_lengths)
    print(f"generating {len(cfg.tasks)} task(s) x {cfg.lengths} x {cfg.samples} samples (seed {cfg.seed})")
    out = build_task_set(a.corpus, tok, a.out, cfg)
    print(f"wrote task set {out}")


def main(argv=None) -> int:
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.tasks", description=__doc__)
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer dir")
    ap.add_argument("--corpus", required=True, help="haystack source: JSONL (text field) or indexed prefix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=20, help="samples per (task, length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-docs", type=int, default=0,
                    help="also write train.jsonl with N documents per (task, length)")
    ap.add_argument("--train-lengths", default=None, help="lengths of the training documents (default --lengths)")
    return run_cli("eval.tasks", run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
