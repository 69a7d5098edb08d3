"""``bench/inference.py --quick`` on CPU: the offload rows of a tiny model run end to end (the script a
GPU session relies on), with the decode in batch parts and the per-kernel profile."""

from __future__ import annotations

import json

import torch

from tests.bench.loader import load_bench


def _bench():
    return load_bench("inference")


def test_quick_offload_rows(tmp_path):
    bench = _bench()
    assert bench.main(["--out", str(tmp_path), "--quick", "--only", "offload", "--decode-streams", "2",
                       "--part-fetch-grid", "3", "--profile"]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "inference.json").read_text())["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    gpu, off = rows["max batch nosa gpu_kv ctx512"], rows["max batch nosa offload ctx512"]
    assert off["batch"] > gpu["batch"] >= 2 and off["per_seq_cache_mib"] <= gpu["per_seq_cache_mib"]
    dec = rows["decode nosa offload ctx512 max batch"]
    assert dec["tok_per_s"] > 0 and dec["h2d_bytes_per_token"] > 0 and dec["profile_top"]
    assert (tmp_path / "inference.md").read_text().startswith("device: cpu")
    assert bench.main(["--out", str(tmp_path), "--quick", "--decode-streams", "0"]) == 2
    assert bench.main(["--out", str(tmp_path), "--quick", "--part-fetch-grid", "0"]) == 2
    if not torch.cuda.is_available():
        assert bench.main(["--out", str(tmp_path), "--quick", "--memory-profile"]) == 2
