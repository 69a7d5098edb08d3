"""NOSA self-attention for megatron-core: the ``SelfAttention`` subclass and the core attentions.

Data flow of one layer (``s`` tokens, ``b`` sequences, per-rank head counts)::

    NOSASelfAttention.get_query_key_value_tensors      q [s,b,Hq/tp,D], k/v [s,b,Hkv_local,D], pre-RoPE
      -> eviction head on ALL heads (gathered over TP)  score/bias [b,s,Hkv_local] (this rank's heads)
    megatron applies RoPE (LongRoPE attention factor as RoPE ``mscale``)
    NOSACoreAttention(q, k, v, ...)                     -> nosa_attention(...)  [s,b,Hq/tp*D]

The eviction outputs travel from the parent to the core attention through
``core_attention.pending_eviction`` (set right before, consumed once) or, under selective
recompute, through checkpointed keyword tensors (``evict_score`` / ``evict_bias``). Under selective
recompute the selection (and the Triton index) is computed once before the checkpoint and handed
over as ``prepared``, so the recompute does not select again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from nosa_layers import (EvictionOutput, NOSAConfig, PreparedSelection, build_eviction_head, document_spans,
                         nosa_attention, prepare_selection)
from nosa_layers.megatron.heads import (
    HeadLayout,
    gather_group_queries,
    gather_heads,
    replicate_grad,
)


def _tp_group_and_layout(pg_collection, num_q_heads: int, num_kv_heads: int):
    group = pg_collection.tp
    size = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    return group, HeadLayout(size, rank, num_q_heads, num_kv_heads)


def _packed_cu_seqlens(packed_seq_params: Optional[PackedSeqParams]) -> Optional[Tensor]:
    if packed_seq_params is None:
        return None
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"NOSA attention supports packed sequences in 'thd' format only, "
                         f"got qkv_format={packed_seq_params.qkv_format!r}")
    if packed_seq_params.cu_seqlens_q_padded is not None and not torch.equal(
            packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q):
        raise ValueError("padded packed sequences (cu_seqlens_q_padded != cu_seqlens_q) are not supported; "
                         "pack documents without per-document padding")
    return packed_seq_params.cu_seqlens_q


def _to_bthd(x: Tensor, packed: bool) -> Tensor:
    """megatron ``[s, b, h, D]`` (or packed ``[t, h, D]``) -> ``[b, s, h, D]``."""
    return x.unsqueeze(0) if packed else x.transpose(0, 1)


def _from_bthd(x: Tensor, packed: bool) -> Tensor:
    """``[b, s, h, D]`` -> megatron core-attention output ``[s, b, h*D]`` (packed: ``[t, h*D]``)."""
    if packed:
        return x.squeeze(0).flatten(-2)
    return x.transpose(0, 1).flatten(-2).contiguous()


class DenseCoreAttention(MegatronModule):
    """Causal softmax attention (PyTorch SDPA, GQA), documents isolated for packed sequences.

    The local-spec stand-in for ``TEDotProductAttention``. q ``[s,b,np,D]``, k/v ``[s,b,ng,D]``
    post-RoPE -> ``[s, b, np*D]``; packed ``thd`` inputs ``[t, h, D]`` -> ``[t, np*D]``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                 pg_collection=None, **unused) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("DenseCoreAttention has no context parallelism; "
                                      "use the Transformer Engine spec for context_parallel > 1")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"DenseCoreAttention is causal only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused) -> Tensor:
        if attention_bias is not None:
            raise ValueError("DenseCoreAttention does not take attention_bias")
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        q, k, v = (_to_bthd(x, packed).transpose(1, 2) for x in (query, key, value))  # [b, h, s, D]
        outs = []
        for s, e in document_spans(cu, q.shape[2]):
            outs.append(F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1]))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return _from_bthd(out.transpose(1, 2), packed)


class NOSACoreAttention(MegatronModule):
    """NOSA / InfLLM-V2 block-sparse attention on this rank's heads.

    Equals ``nosa_attention(q, k, v, score, cfg, cu_seqlens, attn_bias=bias)`` of the same heads at
    TP=1. When a KV group's query heads span TP ranks the selection is computed from the whole
    group (queries all-gathered without grad), so it equals the TP=1 selection.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                 pg_collection=None, nosa_config: Optional[NOSAConfig] = None, backend: str = "auto",
                 num_q_heads: Optional[int] = None, num_kv_heads: Optional[int] = None, **unused) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("NOSA attention does not support context_parallel > 1 yet "
                                      "(see nosa_layers/megatron/README.md); use context_parallel=1")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"NOSA attention is causal only, got {attn_mask_type}")
        if nosa_config is None:
            raise ValueError("NOSACoreAttention needs nosa_config (set by the NOSA layer spec)")
        self.cfg = nosa_config
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        # megatron may hand us a config whose num_query_groups was raised to tp (KV replication):
        # the true head counts come from the spec.
        self.num_q_heads = num_q_heads or config.num_attention_heads
        self.num_kv_heads = num_kv_heads or config.num_query_groups
        self.tp_group, self.layout = _tp_group_and_layout(pg_collection, self.num_q_heads, self.num_kv_heads)
        self.pending_eviction: Optional[EvictionOutput] = None
        self.record_selection = False  # debug/test hook: keep the last selection in last_selection
        self.last_selection: Optional[Tensor] = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, evict_score: Optional[Tensor] = None,
                evict_bias: Optional[Tensor] = None, prepared: Optional[PreparedSelection] = None,
                **unused) -> Tensor:
        if attention_bias is not None:
            raise ValueError("NOSA attention does not take megatron's attention_bias")
        if evict_score is None and evict_bias is None and self.pending_eviction is not None:
            evict_score, evict_bias = self.pending_eviction.score, self.pending_eviction.bias
        self.pending_eviction = None
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        q, k, v = (_to_bthd(x, packed) for x in (query, key, value))
        if prepared is None:
            prepared = self._prepare(q, k, evict_score, cu)
        if self.record_selection:
            self.last_selection = prepared.selected
        out = nosa_attention(q, k, v, evict_score, self.cfg, cu_seqlens=cu, backend=self.backend, attn_bias=evict_bias,
                             softmax_scale=self.softmax_scale, selected=prepared)
        return _from_bthd(out, packed)

    def prepare(self, query: Tensor, key: Tensor, evict_score: Optional[Tensor],
                packed_seq_params: Optional[PackedSeqParams] = None) -> PreparedSelection:
        """The selection (and the backend's index) of megatron-layout ``query``/``key``, computed
        without grad; ``forward(..., prepared=...)`` reuses it (selective recompute)."""
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        return self._prepare(_to_bthd(query, packed), _to_bthd(key, packed), evict_score, cu)

    def _prepare(self, q: Tensor, k: Tensor, score: Optional[Tensor], cu: Optional[Tensor]) -> PreparedSelection:
        # When the group's query heads span TP ranks, select once on the whole (gathered) group.
        if self.layout.group_spans_ranks:
            q = gather_group_queries(q, self.layout, self.tp_group)
        return prepare_selection(q, k, score, self.cfg, cu, backend=self.backend, softmax_scale=self.softmax_scale)


@dataclass
class NOSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """``SelfAttentionSubmodules`` plus the eviction head (None for dense and InfLLM-V2 layers)."""

    eviction_head: Optional[Union[ModuleSpec, type]] = None


def eviction_head_builder(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                          detach_value: bool, dtype: torch.dtype = torch.float32):
    """The registry's eviction head with the FULL head counts (replicated on every TP rank)."""
    head = build_eviction_head(name, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               bias=bias, detach_value=detach_value)
    return head.to(dtype)


class NOSASelfAttention(SelfAttention):
    """megatron ``SelfAttention`` + NOSA eviction head + LongRoPE attention factor.

    Used for every layer of a NOSA model (dense layers simply have no eviction head), so RoPE
    scaling is applied the same way everywhere. Eviction-head TP design: parameters replicated on
    all TP ranks; inputs (pre-RoPE v, and q/k for Locret) all-gathered over TP; the head runs on all
    KV heads identically on every rank; its output's gradient is all-reduced over TP
    (:func:`replicate_grad`) so the replicated parameters receive identical, complete gradients.
    """

    def __init__(self, config, submodules: NOSASelfAttentionSubmodules, layer_number: int,
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
        self.tp_group_, self.layout = _tp_group_and_layout(
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
