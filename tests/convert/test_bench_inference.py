"""``python -m bench.inference --quick`` on CPU: the offload rows of a tiny model run end to end (the script a
GPU session relies on), with the decode in batch parts and the per-kernel profile."""

from __future__ import annotations

import json

import torch

from bench import inference


def test_quick_offload_rows(tmp_path):
    assert inference.main(["--out", str(tmp_path), "--quick", "--only", "offload", "--decode-streams", "2",
                       "--part-fetch-grid", "3", "--profile"]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "inference.json").read_text())["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    gpu, off = rows["max batch nosa gpu_kv ctx512"], rows["max batch nosa offload ctx512"]
    assert off["batch"] > gpu["batch"] >= 2 and off["per_seq_cache_mib"] <= gpu["per_seq_cache_mib"]
    dec = rows["decode nosa offload ctx512 max batch"]
    assert dec["tok_per_s"] > 0 and dec["h2d_bytes_per_token"] > 0 and dec["profile_top"]
    assert (tmp_path / "inference.md").read_text().startswith("device: cpu")
    assert inference.main(["--out", str(tmp_path), "--quick", "--decode-streams", "0"]) == 2
    assert inference.main(["--out", str(tmp_path), "--quick", "--part-fetch-grid", "0"]) == 2
    if not torch.cuda.is_available():
        assert inference.main(["--out", str(tmp_path), "--quick", "--memory-profile"]) == 2


def test_batch_search_finds_the_largest_batch_under_a_nonlinear_memory_curve():
    """The largest-batch search against synthetic peaks: a per-sequence cost that the batch 1 -> 2
    slope overstates (so the first prediction is low) and a step above some batch (so a re-prediction
    overshoots): the result is the largest batch under the limit, found by re-predicting then
    bisecting."""
    import argparse

    gib = inference.GIB
    for jump_at in (37, 52, 60):
        def peak(b, jump_at=jump_at):
            return int(3.8 * gib + 0.13 * gib * b + (0.3 * gib if b == 2 else 0) + (0.5 * gib if b >= jump_at else 0))

        runner = inference.Bench.__new__(inference.Bench)
        runner.args = argparse.Namespace(mem_limit_gib=12.0, host_mem_limit_gib=1e6)
        runner.free = lambda: None
        probed = []

        def probe(model, b, offload, peak=peak, probed=probed):
            probed.append(b)
            return {"batch": b, "peak_bytes": peak(b), "device": peak(b), "host": b * 1000}

        runner.probe = probe
        got = runner.largest_batch(None, offload=True)
        want = max(b for b in range(1, 200) if peak(b) <= 12 * gib)
        assert got["batch"] == want, (jump_at, probed)
        assert len(probed) <= 12
