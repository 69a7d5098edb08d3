"""The locality demo (README main job) runs end to end and reports sane numbers."""

import json

from nosa_layers.demo import main


def test_demo_tiny(tmp_path):
    results = main(["--out", str(tmp_path), "--tiny", "--seq-len", "260", "--layers", "1"])
    saved = json.loads((tmp_path / "locality.json").read_text())
    assert set(saved["results"]) == {"ed_dma", "none"}
    for name, r in results.items():
        assert r["grads_finite"]
        assert 0 < r["gamma_min"] <= r["gamma_mean"] <= 1
        assert r["gamma_min_sparse"] is not None
    assert results["ed_dma"]["gamma_min_sparse"] >= results["ed_dma"]["bound_k_e_over_k"]
