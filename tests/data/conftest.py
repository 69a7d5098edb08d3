"""Fixtures for the data-pipeline tests: a small demo build and synthetic indexed datasets."""

import os

import numpy as np
import pytest

from data.demo_corpus import SMALL, build_demo
from data.indexed import write_indexed

EOD = 0  # synthetic datasets: token 0 is EOD, document tokens are unique positive ids


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The SMALL demo build (corpus, tokenizer, .bin/.idx, sft, longctx) in a session tmp dir."""
    return build_demo(str(tmp_path_factory.mktemp("demo")), SMALL, log=lambda m: None)


@pytest.fixture(scope="session")
def tok(demo):
    from data.tokenizer import Tokenizer

    return Tokenizer(demo["tokenizer"])


def make_synthetic(prefix, n_docs, seed, start=1, min_len=3, max_len=120):
    """Write docs of unique ids ``start, start+1, ...`` each followed by EOD; returns the doc list."""
    rng = np.random.default_rng(seed)
    docs, nxt = [], start
    for _ in range(n_docs):
        n = int(rng.integers(min_len, max_len))
        docs.append(np.concatenate([np.arange(nxt, nxt + n), [EOD]]).astype(np.int64))
        nxt += n
    write_indexed(prefix, docs, vocab_size=1 << 20)
    return docs


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    """Two synthetic indexed datasets with disjoint token ranges: (prefix_a, docs_a, prefix_b, docs_b)."""
    d = tmp_path_factory.mktemp("synth")
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    docs_a = make_synthetic(a, 400, seed=1, start=1)
    docs_b = make_synthetic(b, 400, seed=2, start=1_000_000)
    return a, docs_a, b, docs_b
