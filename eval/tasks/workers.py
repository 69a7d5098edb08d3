"""A process pool for the task generators: each worker loads the tokenizer and builds the haystack
once, then runs jobs; small workloads run in this process (a pool costs seconds to start)."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable, Iterator

_WORKER: dict = {}


def init_worker(corpus: str, tokenizer_dir: str) -> None:
    """Load the tokenizer and the haystack of ``corpus`` into this process (once)."""
    if _WORKER.get("key") == (corpus, tokenizer_dir):
        return
    from data.tokenizer import Tokenizer
    from eval.tasks import encoder, load_haystack

    tok = Tokenizer(tokenizer_dir)
    _WORKER.update(key=(corpus, tokenizer_dir), tok=tok, enc=encoder(tok), hay=load_haystack(corpus, tok))


def state() -> dict:
    """``tok``, ``enc`` and ``hay`` of this worker."""
    return _WORKER


@contextlib.contextmanager
def job_results(fn: Callable, jobs: list, corpus: str, tokenizer_dir: str, workers: int) -> Iterator[Iterable]:
    """``fn(job)`` of every job, in order: in a spawned pool of ``workers`` processes, or here when
    ``workers <= 1``. ``fn`` must be a module-level function that reads :func:`state`."""
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        init_worker(corpus, tokenizer_dir)
        yield map(fn, jobs)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers, init_worker, (corpus, tokenizer_dir)) as pool:
        yield pool.imap(fn, jobs)


def default_workers() -> int:
    return os.cpu_count() or 1
