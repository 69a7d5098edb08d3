"""Packed (THD) RoPE without host syncs equals megatron's per-document RoPE.

* ``document_positions`` (device-side, no ``.tolist()``) equals the reference layer's loop;
* a tiny NOSA model and a LongRoPE one (attention factor != 1, so ``mscale`` matters) run one
  packed row (odd lengths, 1-token documents) with ``NOSAMegatronSelfAttention.sync_free_rope``
  on and off: bitwise-equal logits and gradients, and megatron's THD RoPE is not called when on.
  The single-document row covers megatron's "freqs length == tokens" branch.
"""

from __future__ import annotations

import pytest
import torch

from nosa_layers.reference_layer import positions_from_cu_seqlens
from nosa_layers.rope import document_positions


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[7], [1], [1, 1, 1], [5, 1, 9, 3, 1], [0, 3, 0, 4, 0]])
def test_document_positions_restart_at_every_document(lengths):
    cu, T = _cu(lengths), sum(lengths)
    assert document_positions(cu, T).tolist() == positions_from_cu_seqlens(cu, T).tolist()


def test_document_positions_random_odd_lengths():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = (2 * torch.randint(0, 40, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen) + 1)
        cu, T = _cu(lengths.tolist()), int(lengths.sum())
        pos = document_positions(cu, T)
        assert pos.dtype == torch.int64 and pos.shape == (T,)
        assert torch.equal(pos, positions_from_cu_seqlens(cu, T))


@pytest.mark.parametrize("docs", ["docs", "one_doc"])
@pytest.mark.parametrize("case", ["packed", "longrope"])
def test_sync_free_packed_rope_is_bitwise_megatron(megatron_ref, case, docs):
    r = megatron_ref.status("ref", f"sync_free_rope/{case}/{docs}")
    assert r["thd_calls_megatron"] == 2 * r["layers"], "the reference run did not use megatron's THD RoPE"
    assert r["thd_calls_new"] == 0, "the sync-free run still called megatron's THD RoPE"
    if case == "longrope":
        assert r["mscale"] != 1.0, "the LongRoPE case does not exercise the attention factor"
    assert r["logits_equal"], f"logits differ: max abs {r['max_logit_diff']:.2e}"
    assert r["grads"] > 0 and r["grads_equal"], "gradients differ"


@pytest.mark.parametrize("docs", ["docs", "rows"])
@pytest.mark.parametrize("case", ["packed", "longrope"])
def test_fused_rope_is_bitwise_megatron_in_a_model(megatron_ref, case, docs):
    """``train.fusions``' RoPE kernel (here under the interpreter, fp32) replaces megatron's unfused
    RoPE in every layer, forward and backward, with bitwise-equal logits and gradients."""
    r = megatron_ref.status("ref", f"fused_rope/{case}/{docs}")
    assert r["dtype"] == "float32", "bitwise equality under the interpreter needs fp32 (its bf16 casts truncate)"
    assert r["calls_fused"] == {"kernel": 4 * r["layers"], "megatron": 0}, r["calls_fused"]  # q, k; fwd, bwd
    assert r["calls_unfused"] == {"kernel": 0, "megatron": 2 * r["layers"]}, r["calls_unfused"]
    if case == "longrope":
        assert r["mscale"] != 1.0, "the LongRoPE case does not exercise the attention factor"
    assert r["logits_equal"], f"logits differ: max abs {r['max_logit_diff']:.2e}"
    assert r["grads"] > 0 and r["grads_equal"], "gradients differ"
