"""The NOSA megatron layer: megatron's ``SelfAttention`` plus the eviction head and LongRoPE.

Data flow of one layer (``s`` tokens, ``b`` sequences, per-rank head counts)::

    NOSAMegatronSelfAttention.get_query_key_value_tensors  q [s,b,Hq/tp,D], k/v [s,b,Hkv_local,D], pre-RoPE
      -> eviction head on ALL heads (gathered over TP)      score/bias [b,s,Hkv_local] (this rank's heads)
      -> packed THD (sync-free path): RoPE here             q/k [T,1,H,D] at per-document positions
    otherwise megatron applies RoPE (LongRoPE attention factor as RoPE ``mscale`` in both cases)
    NOSACoreAttention(q, k, v, ...)                         -> nosa_attention(...)  [s,b,Hq/tp*D]

The eviction head is the layer's ``eviction_head`` submodule (a ``ModuleSpec`` of the layer spec, built
with megatron's ``build_module``). Its outputs reach the core attention as the keyword tensors
``evict_score`` / ``evict_bias``: megatron's ``Attention.forward`` calls the core attention with fixed
arguments, so this layer holds them from the QKV projection until the core attention's forward
pre-hook (:meth:`NOSAMegatronSelfAttention._hand_over_eviction`) adds them (consumed once), or, under
selective recompute, passes them through the checkpoint itself. Under selective
recompute the selection (and the Triton index) is computed once before the checkpoint and handed
over as ``prepared``, so the recompute does not select again. The megatron-core internals used
here (``_checkpointed_attention_forward``, ``_yarn_concentration_factor``,
``_apply_rotary_pos_emb_bshd``) are checked by ``tests/megatron/test_megatron_hooks.py``.

RoPE applied here (:meth:`NOSAMegatronSelfAttention.forward` hands megatron ``rotary_pos_emb=None``
and rotates q/k itself right after the QKV projection), in two cases:

* packed (THD) sequences: megatron's THD RoPE syncs with the host (``cu_seqlens.tolist()`` /
  ``.item()``) for q and k in every layer; here the angles are taken per token, ``freqs[pos]``
  (positions computed on the device once per step, cached on the ``PackedSeqParams``; with context
  parallelism the positions of this rank's chunks, ``context_parallel.py``: always here, megatron's THD
  RoPE splits each document instead);
* ``fused_rope`` (``train.fusions``) on CUDA inputs (or under the Triton interpreter), packed or
  not: one Triton kernel each way (``nosa_layers.ops.rope``) instead of megatron's six elementwise
  passes, with cos / sin tables computed once per forward and shared by the layers
  (:func:`rope_tables_for`).

Either way the math is megatron's unfused ``_apply_rotary_pos_emb_bshd`` per token, so the result
is bitwise equal. Conditions (else megatron's path): megatron's own RoPE fusion off, no
inference context, no flash decode; packed: no padded ``cu_seqlens``; fused: non-interleaved RoPE
over the whole head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from nosa_layers import EvictionOutput
from nosa_layers.megatron.context_parallel import context_parallel_plan, cp_group_of, local_document_positions
from nosa_layers.megatron.core_attention import NOSACoreAttention
from nosa_layers.megatron.heads import gather_heads, replicate_grad, tp_head_layout
from nosa_layers.rope.packed import document_positions

_TABLES: dict = {}  # rope_tables_for's one entry: (freqs, mscale, dtype) -> (cos, sin)


@dataclass
class NOSAMegatronSelfAttentionSubmodules(SelfAttentionSubmodules):
    """``SelfAttentionSubmodules`` plus the eviction head (None for dense and InfLLM-V2 layers)."""

    eviction_head: Optional[Union[ModuleSpec, type]] = None


def packed_positions(packed_seq_params, cu_seqlens: Tensor, num_tokens: int, cp_group=None) -> Tensor:
    """Position of every token of a packed row within its document ``[T]`` (int64, on the device),
    computed once per ``cu_seqlens`` and cached on ``packed_seq_params`` (all layers of a step share
    it; the cache keeps ``cu_seqlens`` alive, so its ``id`` stays its own). With a context-parallel
    group the ``num_tokens`` tokens are this rank's chunks of the row (``context_parallel.py``)."""
    cache = packed_seq_params.__dict__.setdefault("_nosa_doc_positions", {})
    if id(cu_seqlens) not in cache:
        if cp_group is None:
            pos = document_positions(cu_seqlens, num_tokens)
        else:
            plan = context_parallel_plan(cp_group, num_tokens, cu_seqlens.device, packed_seq_params, cu_seqlens)
            pos = local_document_positions(plan, cu_seqlens)
        cache[id(cu_seqlens)] = (cu_seqlens, pos)
    return cache[id(cu_seqlens)][1]


def packed_rope_freqs(freqs: Tensor, packed_seq_params, cu_seqlens: Tensor, num_tokens: int, cp_group=None) -> Tensor:
    """Per-token RoPE angles ``[T, 1, 1, D]`` of a packed row from megatron's ``[max_s, 1, 1, D]``:
    ``freqs[position within the document]``, as megatron's THD RoPE applies them (CP=1); with a
    context-parallel group, of this rank's tokens at their global positions."""
    return freqs[packed_positions(packed_seq_params, cu_seqlens, num_tokens, cp_group)]


def rope_tables_for(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The fused RoPE's ``cos, sin`` ``[P, D]`` of megatron's angles ``freqs`` (``ops.rope.rope_tables``),
    computed once per ``freqs`` tensor: the model makes one per forward and every layer reads it, so
    one cached entry serves all layers of a micro-batch (held until the next ``freqs`` replaces it)."""
    from nosa_layers.ops.rope import rope_tables

    key = (mscale, dtype)
    hit = _TABLES.get("entry")
    if hit is None or hit[0] is not freqs or hit[1] != key:
        hit = (freqs, key, rope_tables(freqs, mscale, dtype))
        _TABLES["entry"] = hit
    return hit[2]


class NOSAMegatronSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` + NOSA eviction head + LongRoPE attention factor.

    Used for every layer of a NOSA model (dense layers simply have no eviction head), so RoPE
    scaling is applied the same way everywhere. Eviction-head TP design: parameters replicated on
    all TP ranks; inputs (pre-RoPE v, and q/k for heads with ``reads_qk``) all-gathered over TP; the head runs on all
    KV heads identically on every rank; its output's gradient is all-reduced over TP
    (:func:`replicate_grad`) so the replicated parameters receive identical, complete gradients.
    RoPE is applied here (packed without host syncs, or fused) when :meth:`_rope_applies_here`
    (module docstring); ``fused_rope`` comes from the layer spec (``train.fusions``).
    """

    sync_free_rope: bool = True  # False: packed RoPE always through megatron's per-document loop

    def __init__(self, config, submodules: NOSAMegatronSelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None,
                 rope_attention_factor: float = 1.0, fused_rope: bool = False) -> None:
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
        self.fused_rope = fused_rope
        self.cp_group_ = cp_group_of(self.pg_collection)
        self._pending_rope = None  # ((q_freqs, k_freqs), packed_seq_params or None) while RoPE is applied here
        self._pending_eviction: Optional[EvictionOutput] = None  # from the QKV projection to the core attention
        self.eviction_head = None
        if getattr(submodules, "eviction_head", None) is not None:
            self.eviction_head = build_module(submodules.eviction_head)
            self.core_attention.register_forward_pre_hook(self._hand_over_eviction, with_kwargs=True)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        """megatron's forward; RoPE moves into :meth:`get_query_key_value_tensors` when it can."""
        rope = kwargs.get("rotary_pos_emb")
        if args or not self._rope_applies_here(rope, kwargs, hidden_states):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._pending_rope = (rope if isinstance(rope, tuple) else (rope, rope), kwargs.get("packed_seq_params"))
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._pending_rope = None

    def _fuses_rope(self) -> bool:
        """Whether the fused kernel covers this layer's RoPE (non-interleaved, not MLA's)."""
        cfg = self.config
        return self.fused_rope and not cfg.rotary_interleaved and not cfg.multi_latent_attention

    def _rope_applies_here(self, rope, kwargs: dict, hidden_states: Tensor) -> bool:
        """Training/eval forward whose RoPE this layer applies itself (module docstring): packed THD rows
        (sync-free; unpadded ``cu_seqlens``), or any rows when the fused kernel runs (CUDA inputs)."""
        psp, cfg = kwargs.get("packed_seq_params"), self.config
        if rope is None or kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            return False
        no_rope = bool(cfg.no_rope_freq) and cfg.no_rope_freq[self.layer_number - 1]
        if cfg.apply_rope_fusion or cfg.flash_decode or no_rope:
            if self.cp_group_ is not None and psp is not None:
                raise ValueError("packed rows with context parallelism need the NOSA layer's RoPE: turn off "
                                 "apply_rope_fusion / flash_decode (no_rope layers are not supported with CP)")
            return False
        if psp is None:  # with CP megatron hands over this rank's rows of the angles (its zigzag)
            if not self._fuses_rope():
                return False
            from nosa_layers.ops._common import kernels_run_on

            return kernels_run_on(hidden_states)
        unpadded = all(pad is None or pad is cu for pad, cu in ((psp.cu_seqlens_q_padded, psp.cu_seqlens_q),
                                                                (psp.cu_seqlens_kv_padded, psp.cu_seqlens_kv)))
        if self.cp_group_ is not None:  # megatron's THD RoPE splits each document (not this layout's zigzag rows)
            if not (psp.qkv_format == "thd" and unpadded):
                raise ValueError("context parallelism takes unpadded packed rows (qkv_format='thd')")
            return True
        return psp.qkv_format == "thd" and unpadded and (self.sync_free_rope or self._fuses_rope())

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if not isinstance(out, tuple) or len(out) < 3:
            if self._pending_rope is not None:
                raise RuntimeError("RoPE in the NOSA layer needs split q/k/v (split_qkv=True)")
            return out
        query, key, value = out[0], out[1], out[2]
        if self.eviction_head is not None:
            self._pending_eviction = self._eviction(query, key, value)
        if self._pending_rope is not None:
            out = (*self._rope(query, key), *out[2:])
        return out

    def _rope(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE on q ``[s, b, Hq/tp, D]`` and k ``[s, b, Hkv_local, D]``: at per-document positions for
        packed rows (b = 1), at the row index otherwise; fused on CUDA inputs when ``_fuses_rope``."""
        (q_freqs, k_freqs), psp = self._pending_rope
        mscale = self._yarn_concentration_factor
        cpg = self.cp_group_

        def rope(x: Tensor, freqs: Optional[Tensor], cu: Optional[Tensor]) -> Tensor:
            if freqs is None:
                return x
            if self._fuses_rope() and freqs.shape[-1] == x.shape[-1]:
                from nosa_layers.ops._common import kernels_run_on
                from nosa_layers.ops.rope import fused_rope

                if kernels_run_on(x):
                    cos, sin = rope_tables_for(freqs, mscale, x.dtype)
                    return fused_rope(x, cos, sin, None if cu is None else packed_positions(psp, cu, x.size(0), cpg))
            f = freqs if cu is None else packed_rope_freqs(freqs, psp, cu, x.size(0), cpg)
            return _apply_rotary_pos_emb_bshd(x, f, rotary_interleaved=self.config.rotary_interleaved, mscale=mscale)

        if psp is None:
            return rope(query, q_freqs, None), rope(key, k_freqs, None)
        return rope(query, q_freqs, psp.cu_seqlens_q), rope(key, k_freqs, psp.cu_seqlens_kv)

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
            x = replicate_grad(x, lay, grp)
            return x if (lo, hi) == (0, x.shape[-1]) else x[..., lo:hi]  # (a full slice costs a backward copy)

        if ev.bias is ev.score:
            s = local(ev.score)
            return EvictionOutput(score=s, bias=s)
        return EvictionOutput(score=local(ev.score), bias=local(ev.bias))

    def _hand_over_eviction(self, core_attention, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """Forward pre-hook of the core attention: adds the eviction outputs of this forward's QKV
        projection as ``evict_score`` / ``evict_bias`` (once; nothing when none is pending)."""
        ev, self._pending_eviction = self._pending_eviction, None
        if ev is None:
            return None
        return args, {**kwargs, "evict_score": ev.score, "evict_bias": ev.bias}

    def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                        attn_mask_type=None, attention_bias=None, packed_seq_params=None,
                                        core_attention_extra_kwargs=None):
        ev, self._pending_eviction = self._pending_eviction, None
        extra = dict(core_attention_extra_kwargs or {})
        if ev is not None:
            extra.update(evict_score=ev.score, evict_bias=ev.bias)
        if isinstance(self.core_attention, NOSACoreAttention):
            # Select once here, outside the checkpoint: the recompute in the backward reuses the
            # selection and the kernels' index instead of recomputing them (no grad flows through them).
            extra["prepared"] = self.core_attention.prepare(query, key, None if ev is None else ev.score,
                                                            packed_seq_params)
        return super()._checkpointed_attention_forward(
            query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb, attn_mask_type=attn_mask_type,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params, core_attention_extra_kwargs=extra)
