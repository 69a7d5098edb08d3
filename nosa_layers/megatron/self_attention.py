"""The NOSA megatron layer: megatron's ``SelfAttention`` plus the eviction head and LongRoPE.

Data flow of one layer (``s`` tokens, ``b`` sequences, per-rank head counts)::

    NOSAMegatronSelfAttention.get_query_key_value_tensors  q [s,b,Hq/tp,D], k/v [s,b,Hkv_local,D], pre-RoPE
      -> eviction head on ALL heads (gathered over TP)      score/bias [b,s,Hkv_local] (this rank's heads)
    megatron applies RoPE (LongRoPE attention factor as RoPE ``mscale``)
    NOSACoreAttention(q, k, v, ...)                         -> nosa_attention(...)  [s,b,Hq/tp*D]

The eviction outputs travel from this module to the core attention through
``core_attention.pending_eviction`` (set right before, consumed once) or, under selective
recompute, through checkpointed keyword tensors (``evict_score`` / ``evict_bias``). Under selective
recompute the selection (and the Triton index) is computed once before the checkpoint and handed
over as ``prepared``, so the recompute does not select again. The megatron-core internals used
here (``_checkpointed_attention_forward``, ``_yarn_concentration_factor``) are checked by
``tests/megatron/test_megatron_hooks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from nosa_layers import EvictionOutput, build_eviction_head
from nosa_layers.megatron.core_attention import NOSACoreAttention
from nosa_layers.megatron.heads import gather_heads, replicate_grad, tp_head_layout


@dataclass
class NOSAMegatronSelfAttentionSubmodules(SelfAttentionSubmodules):
    """``SelfAttentionSubmodules`` plus the eviction head (None for dense and InfLLM-V2 layers)."""

    eviction_head: Optional[Union[ModuleSpec, type]] = None


def eviction_head_builder(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                          detach_value: bool, dtype: torch.dtype = torch.float32):
    """The registry's eviction head with the FULL head counts (replicated on every TP rank)."""
    head = build_eviction_head(name, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               bias=bias, detach_value=detach_value)
    return head.to(dtype)


class NOSAMegatronSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` + NOSA eviction head + LongRoPE attention factor.

    Used for every layer of a NOSA model (dense layers simply have no eviction head), so RoPE
    scaling is applied the same way everywhere. Eviction-head TP design: parameters replicated on
    all TP ranks; inputs (pre-RoPE v, and q/k for heads with ``reads_qk``) all-gathered over TP; the head runs on all
    KV heads identically on every rank; its output's gradient is all-reduced over TP
    (:func:`replicate_grad`) so the replicated parameters receive identical, complete gradients.
    """

    def __init__(self, config, submodules: NOSAMegatronSelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None,
                 rope_attention_factor: float = 1.0) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name)
        if rope_attention_factor != 1.0:
            if not hasattr(self, "_yarn_concentration_factor"):
                raise RuntimeError("this megatron-core has no RoPE mscale hook (_yarn_concentration_factor); "
                                   "LongRoPE attention_factor cannot be applied")
            self._yarn_concentration_factor = float(rope_attention_factor)
        self.tp_group_, self.layout = tp_head_layout(
            self.pg_collection, config.num_attention_heads, config.num_query_groups)
        self.eviction_head = None
        if getattr(submodules, "eviction_head", None) is not None:
            spec = submodules.eviction_head
            self.eviction_head = spec.module(**spec.params) if isinstance(spec, ModuleSpec) else spec()
            if not any(True for _ in self.eviction_head.parameters()) and not self.eviction_head.has_score:
                self.eviction_head = None  # InfLLM-V2 ("none" head): nothing to run

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if self.eviction_head is None or not isinstance(out, tuple) or len(out) < 3:
            return out
        query, key, value = out[0], out[1], out[2]
        self.core_attention.pending_eviction = self._eviction(query, key, value)
        return out

    def _eviction(self, query: Tensor, key: Tensor, value: Tensor) -> EvictionOutput:
        """Eviction score/bias of this rank's KV heads, ``[b, s, Hkv_local]`` fp32 (from pre-RoPE q/k/v)."""
        lay, grp = self.layout, self.tp_group_
        v_all = gather_heads(value, lay, grp, kv=True)
        needs_qk = getattr(self.eviction_head, "reads_qk", True)
        q_all = gather_heads(query, lay, grp, kv=False) if needs_qk else query
        k_all = gather_heads(key, lay, grp, kv=True) if needs_qk else key
        with torch.profiler.record_function("nosa.eviction_head"):
            ev = self.eviction_head(q_all.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1))
        lo, hi = lay.kv_start, lay.kv_start + lay.kv_per_rank

        def local(x: Optional[Tensor]) -> Optional[Tensor]:
            if x is None:
                return None
            return replicate_grad(x, lay, grp)[..., lo:hi]

        if ev.bias is ev.score:
            s = local(ev.score)
            return EvictionOutput(score=s, bias=s)
        return EvictionOutput(score=local(ev.score), bias=local(ev.bias))

    def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                        attn_mask_type=None, attention_bias=None, packed_seq_params=None,
                                        core_attention_extra_kwargs=None):
        ev = getattr(self.core_attention, "pending_eviction", None)
        extra = dict(core_attention_extra_kwargs or {})
        if ev is not None:
            self.core_attention.pending_eviction = None
            extra.update(evict_score=ev.score, evict_bias=ev.bias)
        if isinstance(self.core_attention, NOSACoreAttention):
            # Select once here, outside the checkpoint: the recompute in the backward reuses the
            # selection and the kernels' index instead of recomputing them (no grad flows through them).
            extra["prepared"] = self.core_attention.prepare(query, key, None if ev is None else ev.score,
                                                            packed_seq_params)
        return super()._checkpointed_attention_forward(
            query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb, attn_mask_type=attn_mask_type,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params, core_attention_extra_kwargs=extra)
