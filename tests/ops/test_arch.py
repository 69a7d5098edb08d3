"""Every kernel compiles for the sm80 (A100 / A800) and sm90 (H100 / H200) targets with the launch
configuration of that architecture and fits its shared memory, so an Ampere break shows up here
before a cluster run (Triton compiles for a target it does not run on; no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.conftest import HAS_TRITON

SHARED_PER_BLOCK = {"sm80": 166912, "sm90": 232448}  # bytes of shared memory one program may use
KERNELS = {"fwd", "dq", "dkdv", "dkdv_reduce", "delta", "pack_lists", "inv_count", "scan", "inv_fill", "compress",
           "sel_lse", "sel_block", "topk_nb64", "topk_nb512",
           "rms_norm_fwd_h2048", "rms_norm_bwd_h2048", "rms_norm_fwd_h4096", "rms_norm_bwd_h4096",
           *(f"rope_h{h}_{d}" for h in (2, 16, 32) for d in ("fwd", "bwd")),
           *(f"gated_score_h{h}_{d}" for h in (2, 8) for d in ("fwd", "bwd", "reduce"))}
GLUON_KERNELS = {"fwd_sm90", "fwd_pairs_sm90", "dq_sm90", "dkdv_sm90"}  # attention_sm90*: Hopper only


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_ampere_and_hopper():
    script = Path(__file__).with_name("compile_targets.py")
    repo = script.parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
    from tests.ops.compile_targets import GROUP_KERNELS

    groups = (8, 3)  # a power-of-two group, and SmolLM2's (9 / 3 heads: padded query tiles)
    r = subprocess.run([sys.executable, str(script), *map(str, groups)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    for G in groups:
        for arch, limit in SHARED_PER_BLOCK.items():
            mine = {row["kernel"]: row["shared"] for row in rows if row["arch"] == arch and row["G"] == G}
            want = KERNELS | (GLUON_KERNELS if arch == "sm90" else set())
            if G != groups[0]:
                want = want & GROUP_KERNELS
            assert set(mine) == want, f"{arch}, G={G}: compiled {sorted(mine)}"
            too_big = {k: v for k, v in mine.items() if v > limit}
            assert not too_big, f"{arch}, G={G}: shared memory over {limit} B: {too_big}"
