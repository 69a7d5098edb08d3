"""The megatron NOSA attention equals the pure-PyTorch reference.

* core level: the q/k/v (post-RoPE) and eviction score/bias that ``NOSACoreAttention`` receives in
  a real model forward, fed to ``nosa_attention(backend="reference")``: identical output
  (measured rel 0.0) for ed_dma, s_dma, locret, InfLLM-V2, one KV head and packed documents;
* layer level: a megatron ``NOSAMegatronSelfAttention`` (projections, RoPE, eviction head, sparse attention)
  vs ``nosa_layers.reference_layer.NOSAReferenceSelfAttention`` in fp64 with the same weights (measured rel ~2e-7).
"""

from __future__ import annotations

import pytest

CORE_CASES = ["nosa", "nosa_kv1", "infllm_v2", "locret", "s_dma", "packed"]


@pytest.mark.parametrize("case", CORE_CASES)
def test_core_attention_equals_reference(megatron_ref, case):
    r = megatron_ref.status("ref", f"core_attention/{case}")
    assert r["layers"] >= 3, "no NOSA core attention was exercised"
    assert r["rel"] <= 1e-6, f"core attention differs from nosa_attention: rel {r['rel']:.2e}"


def test_megatron_layer_equals_plain_reference_layer(megatron_ref):
    r = megatron_ref.status("ref", "layer_vs_reference")
    assert r["rel"] <= 1e-5, f"megatron NOSAMegatronSelfAttention vs reference layer: rel {r['rel']:.2e}"
