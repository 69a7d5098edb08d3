"""Fixtures of the eval tests: one tiny ablation run end to end (subprocess), reused by the others.
It runs the two sparse variants (``SPARSE_VARIANTS``); the dense one is trained and evaluated by
``test_ablate.py::test_staged_run_hands_over_small_files`` (its CPT starts from the staged export).

megatron-core runs only in subprocesses (``python -m eval.ablate``), never in the pytest process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.subproc import child_env, run_logged

ABLATION_TIMEOUT_S = 600
SPARSE_VARIANTS = ("ed_dma", "none")  # the tiny preset's variants but dense


def run_ablate(out: Path, *extra: str, timeout: int = ABLATION_TIMEOUT_S) -> tuple[int, str]:
    log = out.parent / f"{out.name}-{len(list(out.parent.glob(out.name + '-*.log')))}.log"
    rc = run_logged([sys.executable, "-m", "eval.ablate", "--preset", "tiny", "--out", str(out), "--progress", "5",
                     *extra], log, timeout, env=child_env(OMP_NUM_THREADS="2"))
    return rc, log.read_text(errors="replace")


@pytest.fixture(scope="session")
def tiny_ablation(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ablation") / "run"
    rc, text = run_ablate(out, "--variants", ",".join(SPARSE_VARIANTS))
    if rc != 0:
        pytest.fail(f"tiny ablation exited with {rc}:\n{text[-6000:]}")
    return out


@pytest.fixture(scope="session")
def small_demo(tiny_ablation) -> dict:
    """The SMALL demo corpus the ablation built (tokenizer, corpus.jsonl, indexed prefix)."""
    return json.loads((tiny_ablation / "data" / "demo" / "manifest.json").read_text()) | {
        k: str(tiny_ablation / "data" / "demo" / v) for k, v in
        {"tokenizer": "tokenizer", "corpus": "corpus.jsonl", "indexed_prefix": "corpus_text_document"}.items()}
