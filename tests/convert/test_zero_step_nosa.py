"""``from_hf --attention nosa``: a dense Llama imported as a NOSA model at 0 steps."""

import json

import torch


def test_a_dense_llama_becomes_nosa_at_zero_steps(tmp_path):
    """``from_hf --attention nosa`` (then ``to_hf``): one import makes a NOSA model of a dense Llama with no
    training step: new eviction heads at A = 0, the same logits as the source below the selection budget (the
    first 6 blocks of 16 tokens here), sparse attention beyond it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from checkpoints_convert.from_hf import import_hf
    from checkpoints_convert.to_hf import export

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    geo = "block_size=16,kernel_size=8,kernel_stride=4,init_blocks=1,local_blocks=2,select_blocks=2,topk=6"
    ckpt = import_hf(str(tmp_path / "dense"), str(tmp_path / "nosa"), attention="nosa", geometry_override=geo,
                     log=lambda m: None)
    hf = export(str(ckpt), str(tmp_path / "hf"), dtype="fp32", log=lambda m: None)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, trust_remote_code=True)
    ids = torch.randint(0, 120, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (got(ids).logits - want(ids).logits).abs().amax(-1)[0]
    assert diff[:96].max() < 1e-4, diff[:96].max()  # the budget (6 x 16 tokens) covers every key: dense
    assert diff[96:].max() > 1e-3  # past it the selection drops keys
    assert json.loads((hf / "config.json").read_text())["nosa_config"]["topk"] == 6
