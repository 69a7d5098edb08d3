"""Core attentions of the NOSA megatron layers (megatron's ``core_attention`` seam).

``NOSACoreAttention`` runs NOSA / InfLLM-V2 block-sparse attention on this rank's heads,
``DenseCoreAttention`` is the local-spec (no Transformer Engine) causal attention of dense
layers. Both take megatron's post-RoPE ``q [s,b,np,D]``, ``k/v [s,b,ng,D]`` (packed ``thd``:
``[t, h, D]``) and return ``[s, b, np*D]`` (packed: ``[t, np*D]``). The eviction score/bias of
NOSA layers come from :class:`~nosa_layers.megatron.self_attention.NOSAMegatronSelfAttention` as the
keyword tensors ``evict_score`` / ``evict_bias`` ``[b, s, Hkv_local]`` fp32.

Context parallelism (megatron-core's CP group, ``context_parallel.py``): the layer's tokens are this
rank's zigzag chunks; keys, values and the eviction score/bias are all-gathered over the group (reduce-
scattered in the backward) and the rank's queries attend to the whole causal prefix.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from nosa_layers import NOSAConfig, PreparedSelection, nosa_attention, prepare_selection
from nosa_layers.megatron.context_parallel import ContextParallelPlan, context_parallel_plan, cp_group_of
from nosa_layers.megatron.dense_varlen import (
    causal_varlen_attention,
    chunked_varlen_attention,
    pieces_attention,
    varlen_supported,
)
from nosa_layers.megatron.heads import gather_group_queries, tp_head_layout
from nosa_layers.selection import document_spans


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


class _CausalCoreAttention(MegatronModule):
    """What both core attentions check and keep: causal masks only; the context-parallel group."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 softmax_scale: Optional[float], pg_collection=None) -> None:
        super().__init__(config=config)
        name = type(self).__name__
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"{name} is causal only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        self.cp_group = cp_group_of(pg_collection)

    def _cp_plan(self, query: Tensor, packed_seq_params: Optional[PackedSeqParams],
                 cu: Optional[Tensor]) -> Optional[ContextParallelPlan]:
        """This micro-batch's context-parallel plan (``None`` without CP); ``query`` in megatron's layout."""
        if self.cp_group is None:
            return None
        return context_parallel_plan(self.cp_group, query.shape[0], query.device, packed_seq_params, cu)


class DenseCoreAttention(_CausalCoreAttention):
    """Causal softmax attention (PyTorch SDPA, GQA), documents isolated for packed sequences:
    the local-spec stand-in for ``TEDotProductAttention``. Packed documents on a GPU run as one
    variable-length FlashAttention call (``dense_varlen``); elsewhere one SDPA call per document.
    With context parallelism the keys and values are all-gathered and each piece of this rank's
    chunks attends to its document's prefix (one variable-length call on a GPU)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                 pg_collection=None, **unused) -> None:
        super().__init__(config, layer_number, attn_mask_type, softmax_scale, pg_collection)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused) -> Tensor:
        if attention_bias is not None:
            raise ValueError("DenseCoreAttention does not take attention_bias")
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        plan = self._cp_plan(query, packed_seq_params, cu)
        if plan is not None:
            key, value = plan.gather(key), plan.gather(value)
            if varlen_supported(query, key):
                return _from_bthd(chunked_varlen_attention(
                    _to_bthd(query, packed), _to_bthd(key, packed), _to_bthd(value, packed), plan,
                    self.softmax_scale), packed)
            q, k, v = (_to_bthd(x, packed).transpose(1, 2) for x in (query, key, value))  # [b, h, s, D]
            return _from_bthd(pieces_attention(q, k, v, plan.pieces, self.softmax_scale).transpose(1, 2), packed)
        if packed and varlen_supported(query, key):
            longest = packed_seq_params.max_seqlen_q  # the trainer's batch carries it (no host sync)
            if longest is None:
                longest = int((cu[1:] - cu[:-1]).max())
            return causal_varlen_attention(query, key, value, cu, longest, self.softmax_scale).flatten(-2)
        q, k, v = (_to_bthd(x, packed).transpose(1, 2) for x in (query, key, value))  # [b, h, s, D]
        outs = []
        for s, e in document_spans(cu, q.shape[2]):
            outs.append(F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1]))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return _from_bthd(out.transpose(1, 2), packed)


class NOSACoreAttention(_CausalCoreAttention):
    """NOSA / InfLLM-V2 block-sparse attention on this rank's heads.

    Equals ``nosa_attention(q, k, v, score, cfg, cu_seqlens, attn_bias=bias)`` of the same heads at
    TP=1. When a KV group's query heads span TP ranks the selection is computed from the whole
    group (queries all-gathered without grad), so it equals the TP=1 selection. With context
    parallelism k, v and the score/bias are all-gathered over the CP group and this rank's query
    chunks attend to the whole row (``nosa_attention(..., q_chunks=...)``).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                 pg_collection=None, nosa_config: Optional[NOSAConfig] = None, backend: str = "auto",
                 num_q_heads: Optional[int] = None, num_kv_heads: Optional[int] = None, **unused) -> None:
        super().__init__(config, layer_number, attn_mask_type, softmax_scale, pg_collection)
        if nosa_config is None:
            raise ValueError("NOSACoreAttention needs nosa_config (set by the NOSA layer spec)")
        self.cfg = nosa_config
        self.backend = backend
        # megatron may hand us a config whose num_query_groups was raised to tp (KV replication):
        # the true head counts come from the spec.
        self.num_q_heads = num_q_heads or config.num_attention_heads
        self.num_kv_heads = num_kv_heads or config.num_query_groups
        self.tp_group, self.layout = tp_head_layout(pg_collection, self.num_q_heads, self.num_kv_heads)
        self.record_selection = False  # debug/test hook: keep the last selection in last_selection
        self.last_selection: Optional[Tensor] = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, evict_score: Optional[Tensor] = None,
                evict_bias: Optional[Tensor] = None, prepared: Optional[PreparedSelection] = None,
                **unused) -> Tensor:
        if attention_bias is not None:
            raise ValueError("NOSA attention does not take megatron's attention_bias")
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        plan = self._cp_plan(query, packed_seq_params, cu)
        if plan is not None:
            key, value = plan.gather(key), plan.gather(value)
            evict_score, evict_bias = self._gather_eviction(plan, evict_score, evict_bias)
        q, k, v = (_to_bthd(x, packed) for x in (query, key, value))
        if prepared is None:
            prepared = self._prepare(q, k, evict_score, cu, plan)
        if self.record_selection:
            self.last_selection = prepared.selected
        out = nosa_attention(q, k, v, evict_score, self.cfg, cu_seqlens=cu, backend=self.backend, attn_bias=evict_bias,
                             softmax_scale=self.softmax_scale, selected=prepared,
                             q_chunks=None if plan is None else plan.chunks)
        return _from_bthd(out, packed)

    @staticmethod
    def _gather_eviction(plan: ContextParallelPlan, score: Optional[Tensor], bias: Optional[Tensor],
                         grad: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The whole row's score and bias ``[b, s, Hkv]`` from this rank's; the score only ranks blocks
        (no gradient through the selection), the bias carries one (reduce-scattered back)."""
        def gather(x: Optional[Tensor], with_grad: bool) -> Optional[Tensor]:
            return None if x is None else plan.gather(x.transpose(0, 1), grad=with_grad).transpose(0, 1)

        if bias is score:
            full = gather(bias, grad)
            return full, full
        return gather(score, False), gather(bias, grad)

    def prepare(self, query: Tensor, key: Tensor, evict_score: Optional[Tensor],
                packed_seq_params: Optional[PackedSeqParams] = None) -> PreparedSelection:
        """The selection (and the backend's index) of megatron-layout ``query``/``key``, computed
        without grad; ``forward(..., prepared=...)`` reuses it (selective recompute)."""
        cu = _packed_cu_seqlens(packed_seq_params)
        packed = cu is not None
        plan = self._cp_plan(query, packed_seq_params, cu)
        if plan is not None:
            key = plan.gather(key, grad=False)
            evict_score, _ = self._gather_eviction(plan, evict_score, None, grad=False)
        return self._prepare(_to_bthd(query, packed), _to_bthd(key, packed), evict_score, cu, plan)

    def _prepare(self, q: Tensor, k: Tensor, score: Optional[Tensor], cu: Optional[Tensor],
                 plan: Optional[ContextParallelPlan] = None) -> PreparedSelection:
        # When the group's query heads span TP ranks, select once on the whole (gathered) group;
        # the kernels' query tiles follow the heads this rank attends with.
        heads = q.shape[2]
        if self.layout.group_spans_ranks:
            q = gather_group_queries(q, self.layout, self.tp_group)
        return prepare_selection(q, k, score, self.cfg, cu, backend=self.backend, softmax_scale=self.softmax_scale,
                                 attn_heads=heads, q_chunks=None if plan is None else plan.chunks)
