"""Context parallelism end to end (CPU, gloo, fp32): from the same initial weights CP=2, CP=4 (with selective
recompute) and CP=2 x PP=2 (with full recompute) give the per-step losses and gradient norms of CP=1 over 4 steps,
and CP=2 x TP=2 (sequence parallel) those of TP=2, for a model of dense, InfLLM-V2 and NOSA layers (every
attention type in one model: the layer specs are chosen per layer), on packed rows of short documents of odd
lengths that cross the chunk borders (relative differences <= 1e-6); a checkpoint saved at CP=2 resumes at CP=1,
2 and 4 with bitwise equal weights and the same next step. Initial weights are a function of (seed, parameter)
only: TP=2 x PP=2 starts from exactly the weights of TP=1 (the one layout splits tensors and stages at once, so
a TP-only or a PP-only init bug shows in it too).

Against CP=1 (no TP) the TP=2 layouts' gradient norm differs by up to ~1e-5: the reported norm is an fp32
norm over each rank's shard of the embedding and output gradients (242K entries each), whose rounding
depends on the shard shape, and it differs so for TP=2 at CP=1 too; the gradients themselves agree (an fp64
norm of the full gradients of TP=1 and TP=2 agreed to 3e-9), and the losses agree to 1e-6.

One launch of 4 rank processes (``tests.subproc.run_ranks``) runs every job (``_cp_worker.py``); the tests read
what it wrote.
Recompute runs only in layouts that are compared to CP=1 exactly (the recomputed forward is the same code,
so those layouts stand for their plain forms too); CP=2 alone runs without recompute.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.subproc import run_ranks
from tests.train.conftest import ROOT, metrics

LAYOUTS = ("cp2", "cp4_selective", "cp2_pp2_full")
REL = 1e-6
REL_TP_NORM = 3e-5  # the reported gradient norm of a TP=2 layout against TP=1 (module docstring)
SEQ, CP_MAX = 384, 4


def _synthetic_corpus(prefix: Path, eod: int) -> list[int]:
    """Short documents of odd and even lengths (21..300 tokens + EOD) of ids the demo vocabulary holds."""
    from data.indexed import write_indexed

    rng = np.random.default_rng(7)
    lengths = [int(n) for n in rng.integers(21, 300, size=160)]
    docs = [np.concatenate([rng.integers(5, 1000, size=n), [eod]]) for n in lengths]
    write_indexed(str(prefix), docs, vocab_size=1024)
    return lengths


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, demo_data):
    from data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("cp")
    prefix = out / "short_docs"
    _synthetic_corpus(prefix, Tokenizer(demo_data["tokenizer"]).eod)
    cmd = [sys.executable, str(ROOT / "tests" / "train" / "_cp_worker.py"), "--out", str(out), "--data", str(prefix),
           "--tokenizer", demo_data["tokenizer"]]
    log = out / "worker.log"
    rc = run_ranks(cmd, 4, log, timeout_s=900)
    text = log.read_text(errors="replace")
    summary = out / "summary.json"
    if rc != 0 or not summary.exists():
        pytest.fail(f"the context-parallel launch exited with {rc}:\n{text[-6000:]}")
    failed = {k: v for k, v in json.loads(summary.read_text()).items() if v != 0}
    assert not failed, f"jobs failed: {failed}\n{text[-6000:]}"
    return out


def _steps(run: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(run) if r.get("loss") is not None}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_context_parallel_matches_cp1(cp_runs):
    model, layouts = "mixed", LAYOUTS
    ref = _steps(cp_runs / f"{model}_cp1")
    assert sorted(ref) == [1, 2, 3, 4]
    assert all(math.isfinite(x) for pair in ref.values() for x in pair)
    assert ref[4][0] < ref[1][0], "the loss does not move: the comparison would be empty"
    for layout in layouts:
        got = _steps(cp_runs / f"{model}_{layout}")
        assert sorted(got) == sorted(ref), f"{model}_{layout}: steps {sorted(got)}"
        worst = max(max(_rel(got[s][0], ref[s][0]), _rel(got[s][1], ref[s][1])) for s in ref)
        print(f"\n{model}_{layout}: losses {[round(got[s][0], 6) for s in sorted(got)]}, max rel diff {worst:.1e}")
        assert worst <= REL, f"{model}_{layout}: loss / grad norm differ from CP=1 by {worst:.2e} (rel)"


def test_context_parallel_with_tensor_parallel(cp_runs):
    """CP=2 x TP=2 (sequence parallel) against TP=2 at CP=1 (the same TP shards): <= 1e-6; against CP=1 the
    losses too, the gradient norm within the TP rounding of its fp32 norm (module docstring)."""
    ref, tp2, got = (_steps(cp_runs / f"mixed_{lay}") for lay in ("cp1", "tp2", "cp2_tp2"))
    assert sorted(got) == sorted(tp2) == sorted(ref) == [1, 2, 3, 4]
    worst = max(max(_rel(got[s][0], tp2[s][0]), _rel(got[s][1], tp2[s][1])) for s in ref)
    print(f"\nmixed_cp2_tp2 vs tp2: max rel diff {worst:.1e}")
    assert worst <= REL, f"CP=2 x TP=2 differs from TP=2 by {worst:.2e} (rel)"
    assert max(_rel(got[s][0], ref[s][0]) for s in ref) <= REL
    assert max(_rel(got[s][1], ref[s][1]) for s in ref) <= REL_TP_NORM


def test_rows_pack_odd_documents_across_chunk_borders(cp_runs):
    """The data really exercises packing: documents of odd lengths, starting and ending inside the chunks of
    the CP=4 split (chunk = SEQ / 8 tokens), several documents per row."""
    cus = torch.load(cp_runs / "batches.pt")
    assert len(cus) >= 4
    chunk = SEQ // (2 * CP_MAX)
    crossing, odd, docs = 0, 0, 0
    for cu in cus:
        cu = cu.reshape(-1).tolist()
        cu = [c for i, c in enumerate(cu) if i == 0 or c != cu[i - 1]]
        docs += len(cu) - 1
        odd += sum((b - a) % 2 for a, b in zip(cu, cu[1:]))
        crossing += sum(a // chunk != (b - 1) // chunk for a, b in zip(cu, cu[1:]) if a % chunk)
    assert docs >= 2 * len(cus) and odd > 0 and crossing > 0, (docs, odd, crossing)


def test_checkpoint_resumes_across_cp_sizes_bitwise(cp_runs):
    saved = torch.load(cp_runs / "params_ckpt_cp2_saved.pt")
    assert saved and _steps(cp_runs / "ckpt_cp2").keys() == {1, 2, 3, 4}
    after = {}
    for layout in ("cp1", "cp2", "cp4"):
        restored = torch.load(cp_runs / f"params_resume_{layout}_restored.pt")
        assert restored.keys() == saved.keys()
        different = [k for k in saved if not torch.equal(saved[k], restored[k])]
        assert not different, f"resumed at {layout}: {len(different)} tensors differ from the CP=2 save"
        after[layout] = _steps(cp_runs / f"resume_{layout}")[5]
    ref = after["cp2"]
    for layout in ("cp1", "cp4"):
        assert _rel(after[layout][0], ref[0]) <= REL and _rel(after[layout][1], ref[1]) <= REL, (layout, after)


def test_every_layout_starts_from_the_same_weights(cp_runs):
    """TP=2 x PP=2 saves, after one step that changes no weight, exactly the weights of TP=1 (bitwise); the
    first loss of identical weights on identical data is equal up to the reduction order over TP."""
    from checkpoints_convert.common import load_megatron_tensors
    from runtime.checkpoint_files import find_checkpoint

    ref, got = (load_megatron_tensors(find_checkpoint(cp_runs / name)) for name in ("init_tp1", "init_tp2_pp2"))
    assert got.keys() == ref.keys() and ref
    different = [k for k, v in ref.items() if not torch.equal(got[k], v)]
    assert not different, f"TP=2 x PP=2 starts from other weights: {different[:3]}"
    first = [_steps(cp_runs / name)[1][0] for name in ("init_tp1", "init_tp2_pp2")]
    assert _rel(first[1], first[0]) <= REL, first
