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
    assert inference.main(["--out", str(tmp_path), "--quick", "--decode-cells", "4096x"]) == 2
    assert inference.parse_cells("4096x1, 32768X8") == ((4096, 1), (32768, 8))
    if not torch.cuda.is_available():
        assert inference.main(["--out", str(tmp_path), "--quick", "--memory-profile"]) == 2


def test_shape_file_and_model_choice(tmp_path):
    """``--shape`` (a model YAML with LongRoPE) and ``--models llama``: only the stock Llama's decode rows, with
    the export's RoPE; bad values are one-line usage errors."""
    shape = tmp_path / "shape.yaml"
    shape.write_text("family: llama3\nsize: tiny\nnum_layers: 2\nhidden_size: 96\nnum_attention_heads: 6\n"
                     "num_kv_heads: 2\nhead_dim: 16\nffn_hidden_size: 96\nvocab_size: 300\n"
                     "max_position_embeddings: 256\nrope_type: longrope\nlongrope:\n"
                     "  short_factor: [1, 1, 1, 1, 1, 1, 1, 1]\n  long_factor: [1, 1, 1, 1, 2, 2, 2, 2]\n"
                     "  original_max_position_embeddings: 128\n")
    out = tmp_path / "out"
    assert inference.main(["--out", str(out), "--shape", str(shape), "--models", "llama", "--only", "decode",
                           "--decode-cells", "160x1,96x2", "--steps", "2"]) == 0
    doc = json.loads((out / "inference.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert doc["meta"]["shape"]["num_attention_heads"] == 6 and doc["meta"]["shape"]["rope_type"] == "longrope"
    assert sorted(rows) == ["decode llama_sdpa ctx160 b1", "decode llama_sdpa ctx96 b2",
                            "decode llama_sdpa static ctx160 b1", "decode llama_sdpa static ctx96 b2"]
    assert not [r for r in rows.values() if "error" in r], rows
    assert rows["decode llama_sdpa static ctx160 b1"]["rope"] == "pinned_long"  # past the original 128
    assert "rope" not in rows["decode llama_sdpa static ctx96 b2"]
    assert inference.main(["--out", str(out), "--models", "llama,gpt"]) == 2
    assert inference.main(["--out", str(out), "--shape", str(tmp_path / "none.yaml")]) == 2
    assert inference.main(["--out", str(out), "--shape", str(shape), "--quick"]) == 2
    shape.write_text("num_layers: 2\nhidden: 64\n")
    assert inference.main(["--out", str(out), "--shape", str(shape)]) == 2


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


def test_trained_exports_rows(tmp_path):
    """``--model`` with a NOSA and a dense export (weights on disk), held-out text prompts and one device
    budget from the dense export: every row runs; the offload rows report a hit rate; the dense export
    gets its static-cache decode (eager on a CPU) beside the dynamic-cache one."""
    from safetensors.torch import save_file

    from checkpoints_convert.random_export import load_random_model, stock_llama, write_random_export
    from data.tokenizer import train_bpe
    from nosa_layers.config import tiny_geometry
    from nosa_layers.megatron.config import AttentionConfig

    texts = [p.read_text() for p in sorted((inference.REPO / "eval").glob("*.py"))]
    tok = train_bpe(texts, 400, str(tmp_path / "tok"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in texts))
    args = inference.main.__globals__["argparse"].Namespace(quick=True, shape=None, layers=None, kv_heads=None)
    shape = inference.model_shape(args)
    nosa = write_random_export(tmp_path / "nosa", shape, AttentionConfig(variant="nosa", nosa=tiny_geometry()))
    save_file({k: v.contiguous() for k, v in load_random_model(nosa, eviction_scale=1.0).state_dict().items()},
              str(nosa / "model.safetensors"))
    stock_llama(shape).save_pretrained(str(tmp_path / "dense"))
    out = tmp_path / "out"
    assert inference.main(["--out", str(out), "--quick", "--model", f"{nosa},{tmp_path / 'dense'}", "--data",
                           str(corpus), "--tokenizer", str(tok), "--budget-batch", "2",
                           "--only", "decode,offload"]) == 0
    rows = {r["row"]: r for r in json.loads((out / "inference.json").read_text())["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    budget = next(r for name, r in rows.items() if name.startswith("budget llama:dense"))
    assert budget["batch"] == 2 and budget["peak_gib"] > 0
    assert rows["decode llama:dense static ctx512 b4"]["tok_per_s"] > 0
    assert rows["max batch llama:dense gpu_kv ctx512"]["batch"] >= 2
    off = rows["decode nosa:nosa offload ctx512 max batch"]
    assert 0 <= off["hit_rate"] <= 1 and off["h2d_bytes_per_token"] > 0
    assert inference.main(["--out", str(out), "--model", str(tmp_path / "nowhere")]) == 2
    assert inference.main(["--out", str(out), "--data", str(corpus)]) == 2


def test_quick_decode_rows_and_step_profile(tmp_path):
    """``--only decode --profile`` on CPU: the decode cells of NOSA and the stock Llama (eager and static
    cache), and the per-layer profile of one NOSA step: every layer has its units, the selection is a
    part of each NOSA layer, the compiled body was traced."""
    import json

    assert inference.main(["--out", str(tmp_path), "--quick", "--only", "decode", "--profile", "--steps", "2"]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "inference.json").read_text())["rows"]}
    for n, b in inference.QUICK_DECODE_CELLS:
        for name in (f"decode nosa ctx{n} b{b}", f"decode llama_sdpa ctx{n} b{b}",
                     f"decode llama_sdpa static ctx{n} b{b}"):
            assert rows[name].get("tok_per_s", 0) > 0, rows[name]
    for n, b in inference.QUICK_PROFILE_CELLS:
        p = rows[f"profile nosa ctx{n} b{b}"]
        assert "error" not in p, p
        assert all(r["units"] > 0 and r["selection_units"] > 0 for r in p["profile_layers"]), p["profile_layers"]
        assert p["profile_sections"]["selection"]["units"] > 0 and p["profile_layer_table"]
        assert p["profile_compiled"]["units"] > 0
    assert "x the best dense decode" in (tmp_path / "inference.md").read_text()
