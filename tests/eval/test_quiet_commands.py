"""The eval commands print their own lines only: megatron-core's warnings are the one folded note."""

import json
import subprocess
import sys


def test_ppl_prints_no_third_party_warnings(tmp_path):
    """``python -m eval.ppl`` on a small Hugging Face Llama: stdout is the note, the per-document lines and the
    result; stderr is empty (it held megatron-core's "Could not determine rank ..." warning, 2 lines)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from data.third_party_noise import missing_optional, note_line
    from data.tokenizer import train_bpe
    from tests.subproc import REPO, child_env

    texts = ["the quick brown fox jumps over the lazy dog and runs far away into the woods"] * 8
    tok = train_bpe(texts, 300, str(tmp_path / "tok"), min_frequency=1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(texts)}) + "\n" for _ in range(2)))
    p = subprocess.run([sys.executable, "-m", "eval.ppl", "--ckpt", str(tmp_path / "hf"), "--tokenizer", tok,
                        "--data", str(data), "--length", "32", "--docs", "1", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    note = [note_line()] if missing_optional() else []
    out = p.stdout.splitlines()
    assert out[:len(note)] == note and out.count(note_line()) == len(note), out
    assert out[len(note):-1] == ["  ppl document 1/1"] and out[-1].startswith("ppl 0-8: "), out
    assert p.stderr.strip() == ""
