"""``bench/cp_attention.py``: the communication bytes on paper, and the chunk-by-chunk equality and share
timing of the GPU measurement run end to end under the Triton interpreter at a tiny shape."""

from __future__ import annotations

import json

import pytest
import torch

from bench import cp_attention
from tests.nosa.common import tiny_cfg


def test_communication_bytes_of_the_8b_layouts(tmp_path):
    m = cp_attention
    row = m.comm_row(65536, 4, 2)  # TP=4 replicates the 2 KV heads: one per rank
    per_token = 2 * 2 * 128 + 4  # K and V in bf16, the score in fp32
    assert row["kv_heads_per_rank"] == 1 and row["bytes_per_token"] == per_token
    assert row["gathered_mib_per_layer"] == pytest.approx(65536 * per_token / 2**20)
    wire = 65536 * per_token / 2  # (CP - 1) / CP through each rank's link
    assert row["allgather_mib_per_layer"] == pytest.approx(wire / 2**20)
    assert row["nvlink_us_per_layer_full"] == pytest.approx(3 * wire / 450e9 * 1e6)  # AG, AG again, RS
    assert row["ib_ms_per_step_none"] == pytest.approx(32 * 2 * wire / 50e9 * 1e3)
    assert m.comm_row(65536, 1, 8)["kv_heads_per_rank"] == 2
    assert m.main(["--out", str(tmp_path), "--comm"]) == 0
    rows = json.loads((tmp_path / "cp_communication.json").read_text())["rows"]
    assert [(r["seq"], r["tp"], r["cp"]) for r in rows] == m.LAYOUTS


def test_chunk_by_chunk_equality_and_share_timing_run():
    """The measurement's own check: each emulated rank's selection rows, outputs and dQ equal the whole
    sequence's, and dK / dV / d(bias) summed over the ranks the whole sequence's."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and TRITON_INTERPRET is not set")
    m = cp_attention
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = m.measure(128, 4, 2, [2], equality=True, cfg=tiny_cfg(), device=device, dtype=torch.float32)
    assert [r["kind"] for r in rows] == ["whole_sequence", "cp_share"]
    eq = rows[1]["equality"]
    assert eq["selection_mismatches"] == 0
    tol = 1e-5 if device == "cpu" else 5e-3
    assert max(eq[k] for k in ("out", "dq", "dk", "dv", "dbias")) <= tol, eq
    assert rows[1]["ratio"] > 0 and rows[1]["whole_over_cp_ms"] == pytest.approx(rows[0]["total_ms"] / 2)
    table = m.gpu_table(rows).splitlines()
    assert table[2].startswith("| 0K | NOSA |") and table[-1].startswith("| 0K | 2 |")  # 128 tokens


def test_device_timing_takes_what_the_installed_do_bench_returns(monkeypatch):
    """API drift of ``triton.testing.do_bench`` (a list for one quantile in older triton, a float in 3.6)
    cannot break the GPU benchmarks: the arguments bind to the installed signature, and either result
    is one float."""
    import inspect

    import triton.testing

    from bench import device_timing

    inspect.signature(triton.testing.do_bench).bind(lambda: None, warmup=10, rep=100, return_mode="median")
    for returned in (1.25, [1.25], (1.25, 1.0, 2.0)):
        monkeypatch.setattr(triton.testing, "do_bench", lambda fn, returned=returned, **kw: returned)
        assert device_timing.median_ms(lambda: None) == 1.25
    with pytest.raises(ValueError):
        device_timing.as_ms([])
