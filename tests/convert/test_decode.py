"""The shipped HF model's decode path: per-step NOSA selection equals the training path row by row
(batch > 1, different lengths, left padding), and ``generate`` with a KV cache at batch > 1."""

from __future__ import annotations

import dataclasses
import json
import shutil

import torch

from checkpoints_convert.common import rel_err
from nosa_layers.config import tiny_geometry
from tests.convert._cases import CASES
from tests.convert.conftest import load_hf

LONG = "llama3-nosa-pp2-long"


def _cache_kw(out) -> dict:
    cache = getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}


def test_decode_selection_equals_training_path(megatron_ckpts, exports):
    """Two sequences (prompts of 4580 and 4530 tokens, the shorter left-padded) decode 28 tokens
    each with the KV cache; every step's blocks per (layer, KV head) equal the Megatron training
    forward's row at that position, and the step logits equal its logits."""
    case = CASES[LONG]
    ref = megatron_ckpts.result(LONG)
    toks = ref["tokens"][0]
    model = load_hf(exports[LONG])
    model.record(True)
    bs = case.attn.nosa.block_size
    lens, steps = [4580, 4530], 28
    P = max(lens)
    ids = torch.zeros(2, P, dtype=torch.long)
    mask = torch.zeros(2, P, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, P - n:], mask[b, P - n:] = toks[:n], 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
    # prefill: each sequence's rows equal the training path's rows of its own prefix
    for layer, per_seq in model.selections().items():
        for b, n in enumerate(lens):
            for h in range(case.model.num_kv_heads):
                want = ref["selections"][(layer, h)][:n, :per_seq[b].shape[-1]]
                assert torch.equal(per_seq[b][h], want), f"prefill seq {b} layer {layer} head {h}"
    errs = []
    for j in range(steps):
        nxt = torch.stack([toks[n + j] for n in lens])[:, None]
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        with torch.no_grad():
            out = model(nxt, attention_mask=mask, use_cache=True, **_cache_kw(out))
        for layer, per_seq in model.selections().items():
            for b, n in enumerate(lens):
                pos = n + j
                got = per_seq[b][:, 0]  # [Hkv, nb(pos)]
                nb = got.shape[-1]
                assert nb == pos // bs + 1
                for h in range(case.model.num_kv_heads):
                    row = ref["selections"][(layer, h)][pos]
                    assert torch.equal(got[h], row[:nb]) and not row[nb:].any(), \
                        f"step {j} seq {b} (pos {pos}) layer {layer} head {h}"
        for b, n in enumerate(lens):
            errs.append(rel_err(out.logits[b, -1], ref["logits"][0, n + j]))
    assert max(errs) <= 1e-4, f"decode logits vs Megatron: max rel {max(errs):.2e}"
    sparse = ref["selections"][(0, 0)][lens[1]:lens[1] + steps].sum(-1)
    assert int(sparse.max()) <= case.attn.nosa.topk < lens[1] // bs


def tiny_geometry_export(src, dst):
    """The same weights with the tiny geometry (16-token blocks, 6-block budget): sparse at ~100 tokens."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["nosa_config"].update(dataclasses.asdict(tiny_geometry(eviction_head=cfg["nosa_config"]["eviction_head"])))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_generate_batch_with_padding(exports, tmp_path):
    """Greedy ``generate`` on a left-padded batch of 3 prompts equals generating each prompt alone;
    a right-padded prefill gives every row the logits of its unpadded sequence."""
    model = load_hf(tiny_geometry_export(exports["minicpm4-nosa-tp2-long"], tmp_path / "tiny"))
    gen = torch.Generator().manual_seed(0)
    lens = [90, 131, 57]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lens]
    P, new = max(lens), 14
    ids = torch.zeros(3, P, dtype=torch.long)
    mask = torch.zeros(3, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=new, do_sample=False, pad_token_id=0)
            assert torch.equal(batch[b, P:], alone[0, len(p):]), f"prompt {b}"
        right = torch.zeros(3, P, dtype=torch.long)
        rmask = torch.zeros(3, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            right[b, :len(p)], rmask[b, :len(p)] = p, 1
        logits = model(right, attention_mask=rmask).logits
        for b, p in enumerate(prompts):
            alone = model(p[None]).logits[0]
            assert rel_err(logits[b, :len(p)], alone) <= 1e-5
