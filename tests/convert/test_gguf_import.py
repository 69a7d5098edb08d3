"""``from_hf --gguf``: a tiny random Llama GGUF file (written here with the ``gguf`` package: a byte-level BPE
vocabulary, 6 query / 2 KV heads, tied embeddings, rope theta 1e5) imports into a checkpoint whose Hugging Face
export computes the logits transformers computes from the GGUF file itself, with the file's tokenizer and
token ids; the model group it writes carries the LongRoPE factors of ``--target-length``; bad files are one
line."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

H, LAYERS, HEADS, KV, FFN, CTX = 48, 2, 6, 2, 96, 256


def _bpe(texts=None, vocab=300):
    """A byte-level BPE trained on ``texts`` (a few sentences by default): (tokens, merges), ids 0-2 special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = texts or ["the quick brown fox jumps over the lazy dog", "a needle in a haystack of passkeys"] * 20
    specials = ["<|endoftext|>", "<s>", "</s>"]  # GPT-2 style: the converted tokenizer adds no token of its own
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    return tokens, merges


def write_tiny_gguf(path, seed=0, texts=None, vocab=300, context=CTX):
    """A random Llama GGUF (F32) at ``path`` of a ``context``-token model with a byte-level BPE trained on ``texts``
    (``vocab`` entries)."""
    tokens, merges = _bpe(texts, vocab)
    g = torch.Generator().manual_seed(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Tiny GGUF Llama")
    w.add_context_length(context)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def t(name, *shape, scale=0.05):
        w.add_tensor(name, (torch.randn(*shape, generator=g) * scale).numpy().astype(np.float32))

    t("token_embd.weight", len(tokens), H)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * torch.randn(H, generator=g)).numpy())
        t(f"blk.{i}.attn_q.weight", H, H)
        t(f"blk.{i}.attn_k.weight", KV * H // HEADS, H)
        t(f"blk.{i}.attn_v.weight", KV * H // HEADS, H)
        t(f"blk.{i}.attn_output.weight", H, H)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * torch.randn(H, generator=g)).numpy())
        t(f"blk.{i}.ffn_gate.weight", FFN, H)
        t(f"blk.{i}.ffn_up.weight", FFN, H)
        t(f"blk.{i}.ffn_down.weight", H, FFN)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_import_matches_transformers_and_writes_its_model_group(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoints_convert.from_hf import import_hf
    from checkpoints_convert.to_hf import export

    src = write_tiny_gguf(tmp_path / "Tiny-Llama.F32.gguf")
    lines = []
    out = import_hf(None, str(tmp_path / "imported"), gguf=str(src), target_length=1024, log=lines.append)
    group = out / "model" / "tiny_llama_f32.yaml"
    assert group.is_file() and any("model=tiny_llama_f32" in line and "hydra.searchpath" in line for line in lines)
    import yaml

    fields = yaml.safe_load(group.read_text())
    assert (fields["num_attention_heads"], fields["num_kv_heads"], fields["tie_embeddings"]) == (HEADS, KV, True)
    assert fields["rope_type"] == "longrope" and fields["max_position_embeddings"] == 1024
    assert fields["longrope"]["original_max_position_embeddings"] == CTX and fields["rope_theta"] == 100000.0
    assert len(fields["longrope"]["long_factor"]) == H // HEADS // 2 and max(fields["longrope"]["long_factor"]) == 4.0

    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name, dtype=torch.float32)
    hf = export(str(out), str(tmp_path / "hf"), dtype="fp32", tokenizer=str(out / "tokenizer"), log=lambda m: None)
    got = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, trust_remote_code=True)
    got_tok = AutoTokenizer.from_pretrained(str(hf))
    text = "the lazy fox jumps over a haystack"
    ids = want_tok(text, return_tensors="pt").input_ids
    assert torch.equal(got_tok(text, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        err = (got(ids).logits - want(ids).logits).abs().max().item()
    assert err < 1e-5, err
    cfg = json.loads((hf / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_bad_gguf_inputs_are_one_line(tmp_path, capsys):
    from checkpoints_convert.from_hf import main

    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    for args, want in ((["--gguf", str(not_gguf)], "not a GGUF file"),
                       (["--gguf", str(tmp_path / "missing.gguf")], "no such file"),
                       ([], "give the source as --ckpt <HF dir> or --gguf <file>")):
        assert main([*args, "--out", str(tmp_path / "o")]) != 0
        err = capsys.readouterr().err.strip()
        assert want in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
