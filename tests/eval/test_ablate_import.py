"""The ablation of an imported model (``--preset tiny_import``, the CPU size of ``smollm2_135m``): a Llama GGUF
file with its own tokenizer is imported once, every token of the corpus, the task set and the retrieval
documents comes from that tokenizer, each variant's CPT trains the import's model group (GQA 6 / 2 heads,
LongRoPE 512 -> 1024 from ``from_hf --target-length``) from its weights, and the table holds the imported
model's own row (scored at the lengths its context takes)."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # about 40 s on 2 cores


def test_ablation_of_an_imported_gguf_model(tmp_path):
    from data.demo_corpus import SMALL, iter_corpus
    from data.tokenizer import Tokenizer
    from eval.tasks import tokenizer_hash
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tests.convert.test_gguf_import import write_tiny_gguf

    texts = [r["text"] for r in itertools.islice(iter_corpus(SMALL), 300)]
    src = write_tiny_gguf(tmp_path / "Tiny-Model.F32.gguf", texts=texts, vocab=1024, context=512)
    out = tmp_path / "abl"
    r = subprocess.run([sys.executable, "-m", "eval.ablate", "--preset", "tiny_import", "--init", str(src), "--out",
                        str(out), "--devices", "cpu", "--variants", "ed_dma"], capture_output=True, text=True,
                       timeout=600,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    table = json.loads((out / "ablation.json").read_text())
    assert list(table["variants"]) == ["base", "ed_dma"]
    rows = table["variants"]
    assert all(row["status"] == "done" for row in rows.values())
    assert rows["base"]["steps"] == 0 and rows["ed_dma"]["steps"] == 3
    # the CPT ran the import's model: its group file, its tokenizer
    run_cfg = (out / "cpt" / "ed_dma" / "config.yaml").read_text()
    assert "num_attention_heads: 6" in run_cfg and "rope_type: longrope" in run_cfg
    assert f"tokenizer: {out / 'pretrain_import' / 'tokenizer'}" in run_cfg
    # every data file was tokenized with the model's tokenizer (ids below its vocabulary, not the demo BPE's)
    model_tok = out / "pretrain_import" / "tokenizer"
    assert json.loads((out / "tasks" / "tasks.json").read_text())["tokenizer_sha1"] == tokenizer_hash(model_tok)
    ids = IndexedDataset(str(out / "data" / "corpus_text_document"))
    assert max(int(ids[i].max()) for i in range(len(ids))) < Tokenizer(str(model_tok)).vocab_size
    base, ed = rows["base"]["result"], rows["ed_dma"]["result"]
    assert list(base["ruler"]["by_length"]) == ["512"] and base["ppl"]["buckets"]
    assert 0 < ed["locality"]["gamma_mean"] <= 1
    assert "No pretraining: the imported model" in (out / "ablation.md").read_text()
    # the decode stage on the trained weights: exports, the benchmark's rows, decode-time locality vs eval.locality
    r = subprocess.run([sys.executable, "-m", "eval.ablate", "--preset", "tiny_import", "--init", str(src), "--out",
                        str(out), "--devices", "cpu", "--variants", "ed_dma,dense", "--stage", "decode"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and "variant dense is not trained" in r.stderr, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run([sys.executable, "-m", "eval.ablate", "--preset", "tiny_import", "--init", str(src), "--out",
                        str(out), "--devices", "cpu", "--variants", "ed_dma", "--stage", "decode"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (out / "export" / "ed_dma" / "tokenizer.json").is_file()
    bench = json.loads((out / "decode" / "bench" / "inference.json").read_text())
    names = [row["row"] for row in bench["rows"] if "error" not in row]
    assert "decode nosa:ed_dma ctx960 b4" in names, names
    assert any(n.startswith("decode nosa:ed_dma offload ctx960") for n in names), names
    check = json.loads((out / "decode" / "locality_check.json").read_text())["variants"]["ed_dma"]
    assert check["error"] is None and check["locality_steps"] == 64
    assert 0 < check["decoder_hit_rate"] <= 1 and 0 < check["locality_hit_rate"] <= 1
    assert check["within_tolerance"] == (max(check["rel_diff_hit_rate"], check["rel_diff_fetched"]) <= 0.15)
