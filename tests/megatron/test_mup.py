"""MiniCPM4 muP: the megatron model's logits equal a plain re-implementation of MiniCPM's formulas
(embeddings x scale_emb, residual branches x scale_depth/sqrt(L), logits / (hidden/dim_model_base));
measured rel ~2e-7 (fp32 model vs fp64 formulas)."""

from __future__ import annotations

import math

from tests.megatron._cases import tiny_minicpm4
from tests.recipes import model_recipe


def test_mup_forward_matches_minicpm_formulas(megatron_ref):
    r = megatron_ref.status("ref", "mup")
    assert r["rel"] <= 1e-5, f"muP logits differ from MiniCPM's formulas: rel {r['rel']:.2e}"


def test_minicpm4_8b_mup_multipliers():
    m = model_recipe("minicpm4_8b")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (32, 4096, 32, 2)
    assert m.scale_emb == 12 and m.dim_model_base == 256
    assert math.isclose(m.residual_scale, 1.4 / math.sqrt(32))
    assert math.isclose(m.logit_scale, 256 / 4096)
    assert tiny_minicpm4().use_mup
