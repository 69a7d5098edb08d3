"""Bad inputs of the eval commands: one line naming the fix, exit status 2, nothing written."""

import pytest


import re

NOISE = re.compile(r"^[WI]\d{4} |Warning|warnings.warn")  # third-party import warnings, not our output


def _one_line(capsys, prog: str) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not NOISE.search(ln)]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    from data.tokenizer import train_bpe

    texts = ["a small corpus of words for another tokenizer", "with other merges and fewer tokens"] * 20
    return train_bpe(texts, 300, str(tmp_path_factory.mktemp("tok") / "tokenizer"), min_frequency=1)


def test_locality_errors(tiny_ablation, small_demo, other_tokenizer, tmp_path, capsys):
    from eval.locality import main

    ckpt, out = str(tiny_ablation / "cpt" / "ed_dma"), tmp_path / "out"
    data = small_demo["indexed_prefix"]
    cases = [
        (["--ckpt", str(tmp_path / "missing"), "--data", data, "--length", "256"], "no such file or directory"),
        (["--ckpt", ckpt, "--data", str(tmp_path / "nodata"), "--length", "256"], "neither an indexed dataset prefix"),
        (["--ckpt", ckpt, "--data", data, "--length", "100000"], "exceeds the model's max_position_embeddings=512"),
        (["--ckpt", ckpt, "--data", data, "--length", "256", "--tokenizer", other_tokenizer], "tokenizer mismatch"),
        (["--ckpt", ckpt, "--data", data, "--length", "512", "--split", "90,0,10"], "validation part"),
        (["--ckpt", ckpt, "--data", data, "--length", "256", "--docs", "0"], "--docs 0: give at least 1 document"),
    ]
    for argv, msg in cases:
        assert main([*argv, "--out", str(out)]) == 2
        assert msg in _one_line(capsys, "eval.locality"), argv
        assert not out.exists()


def test_ruler_and_ppl_errors(tiny_ablation, small_demo, other_tokenizer, tmp_path, capsys):
    from eval import ppl, ruler

    ckpt, out = str(tiny_ablation / "cpt" / "ed_dma"), tmp_path / "out"
    tasks = str(tiny_ablation / "tasks")
    cases = [
        (["--tasks", str(tmp_path)], "no task set there"),
        (["--tasks", tasks, "--lengths", "1024"], "has no length(s) [1024]"),
        (["--tasks", tasks, "--tokenizer", other_tokenizer], "tokenizer mismatch"),
    ]
    for argv, msg in cases:
        assert ruler.main(["--ckpt", ckpt, *argv, "--out", str(out)]) == 2
        assert msg in _one_line(capsys, "eval.ruler"), argv
    assert ppl.main(["--ckpt", ckpt, "--data", small_demo["corpus"], "--length", "5000", "--out", str(out)]) == 2
    assert "exceeds the model's max_position_embeddings" in _one_line(capsys, "eval.ppl")
    assert ppl.main(["--ckpt", ckpt, "--data", small_demo["corpus"], "--length", "256", "--docs", "0",
                     "--out", str(out)]) == 2
    assert "--docs 0: give at least 1 document" in _one_line(capsys, "eval.ppl")
    assert not out.exists()


def test_unusable_hugging_face_dirs_are_one_line(tmp_path, capsys):
    """A model dir without safetensors weights, or of an architecture the converter does not map."""
    import json

    import torch
    from safetensors.torch import save_file

    from eval import ppl

    hf, out = tmp_path / "hf", tmp_path / "out"
    hf.mkdir()
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64}
    (hf / "config.json").write_text(json.dumps(cfg))
    argv = ["--ckpt", str(hf), "--data", str(tmp_path / "docs.jsonl"), "--length", "64", "--out", str(out)]
    assert ppl.main(argv) == 2
    assert "config.json but no *.safetensors weights" in _one_line(capsys, "eval.ppl")
    save_file({"lm_head.weight": torch.zeros(64, 32)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert ppl.main(argv) == 2
    assert "unsupported Hugging Face config: model_type='gpt2'" in _one_line(capsys, "eval.ppl")
    assert not out.exists()


def test_a_bad_option_value_or_a_binary_metrics_file_is_one_line_naming_it(tmp_path, capsys):
    from eval.compare import main as compare_main
    from eval.tasks.__main__ import main as tasks_main

    out = tmp_path / "out"
    assert tasks_main(["--tokenizer", str(tmp_path), "--corpus", str(tmp_path / "c.jsonl"), "--out", str(out),
                       "--lengths", "abc"]) == 2
    assert "--lengths 'abc': give comma-separated whole numbers of tokens, like 4096,8192" in _one_line(
        capsys, "eval.tasks")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(bytes(range(256)) * 4)
    assert compare_main([str(run), "--out", str(out)]) == 2
    assert _one_line(capsys, "eval.compare") == (f"eval.compare: error: {run / 'metrics.jsonl'} holds no JSON rows "
                                                 f"(1024 bytes): not a metrics file written by train/main.py")
    assert not out.exists()
