"""Hugging Face model of a NOSA / InfLLM-V2 Llama (shipped into every sparse export by
``checkpoints_convert.to_hf``; loaded with ``trust_remote_code=True``).

Needs only ``torch`` and ``transformers``. The NOSA math is NOT re-implemented here: an export holds,
next to this file, copies of the training framework's pure-PyTorch reference (``nosa_layers``:
``nosa_config.py``, ``nosa_selection.py``, ...) and of its decode engine (``inference``: the block KV
cache ``nosa_block_cache.py`` and its modules, the decode kernels of ``nosa_layers.ops``), written by the
exporter with their imports made relative (``checkpoints_convert.hf_modeling.SHIPPED``); this file's own
imports of those packages are rewritten the same way. The attention layer (``NOSAAttention``) is
``attention_nosa.py``, shipped next to this file. When the framework itself is installed and the
tensors are on a GPU, the prefill runs its Triton kernels (one packed
``nosa_attention(..., cu_seqlens, backend="triton")`` call per layer for the whole batch); otherwise
everything is PyTorch. The KV cache: 64-token blocks, a batched decode step that recomputes the reference
selection from incrementally kept state, captured as a CUDA graph on GPUs, with the token's attention over
its selected blocks read in place by a Triton kernel on GPUs, and an offloaded mode (blocks in pinned host
memory, the selection's blocks in GPU slots).

Weight names follow the public ``openbmb/NOSA-*`` checkpoints: ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``self_attn.A``, ``self_attn.delta.weight`` (Locret ablation: ``self_attn.fc1/fc2``), ``mlp.{gate,up,down}_proj``.

Differences from the public remote code (all deliberate, see the framework's README):

* batch > 1 works: every sequence uses its own positions and blocks (left or right padding,
  different lengths), in prefill and decode; nothing is kept in module state;
* the decode step recomputes the selection of that sequence's newest token (same result as the
  parallel (training) path's row, tested), for all sequences of the batch at once;
* CPU works (pure PyTorch reference); prefill rows are processed in chunks to bound memory.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor, nn
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
)
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaMLP,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from inference.block_cache import NOSABlockCache
from inference.decode_graph import DecodeGraph
from inference.storage import LayerSpec

from .attention_nosa import NOSAAttention
from .configuration_nosa import NOSALlamaConfig


def _cache_field(cls) -> str:
    """Name of the cache field of an output dataclass (``cache`` in transformers 5, else ``past_key_values``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return "cache" if "cache" in names else "past_key_values"


class NOSADecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = NOSAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: Tensor, valid: Tensor, position_embeddings, cache=None) -> Tensor:
        attn, _ = self.self_attn(self.input_layernorm(hidden_states), valid, position_embeddings, cache)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class NOSALlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = NOSALlamaConfig
    _no_split_modules = ["NOSADecoderLayer"]
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _supports_attention_backend = False
    _can_record_outputs = {}

    def _init_weights(self, module) -> None:
        super()._init_weights(module)
        if isinstance(module, NOSAAttention):
            module.init_eviction_parameters()


class NOSALlamaModel(NOSALlamaPreTrainedModel):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([NOSADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.cache_options: dict = {}  # keyword arguments of new_cache() for caches made by forward()
        self._compiled: dict = {}  # torch.compile backend -> the compiled _decode_body
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def _graph_decode_applies(self, cache, T: int, x: Tensor) -> bool:
        return (isinstance(cache, NOSABlockCache) and T == 1 and cache.seen > 0
                and (not cache.offload or cache.fetch == "uva")
                and x.is_cuda and self.cache_options.get("cuda_graphs", True) and not torch.is_grad_enabled()
                and not any(layer.self_attn.record_selection for layer in self.layers))

    def _decode_fn(self, cache: NOSABlockCache, graphed: bool):
        """The decode body of this step: ``_decode_body`` compiled by ``torch.compile`` or plain.

        Cache option ``compile``: ``"auto"`` (default) = Inductor for a CUDA-graphed step of a GPU-resident
        cache decoded in one part (the graph is our own capture around the compiled code: no Inductor
        CUDA graphs); ``True`` = Inductor for every batched decode step (CPU included); ``False`` = plain;
        another string = that ``torch.compile`` backend (e.g. ``"aot_eager"``). Compiled once per model and
        backend with static shapes (a new batch size or cache capacity compiles again; positions are tensors)."""
        mode = self.cache_options.get("compile", "auto")
        if mode == "auto":
            if not graphed or cache.offload or cache.splits_decode():
                return self._decode_body
            mode = True
        if not mode or any(layer.self_attn.record_selection for layer in self.layers):
            return self._decode_body
        backend = "inductor" if mode is True else str(mode)
        if backend not in self._compiled:
            try:
                self._compiled[backend] = torch.compile(self._decode_body, backend=backend, dynamic=False)
            except Exception as e:  # noqa: BLE001 (no torch.compile here: the plain body)
                self._compile_failed(e, "decoding uncompiled from now on")
                return self._decode_body
        cache.prepare_compiled_decode()
        return self._compiled[backend]

    def _compile_failed(self, e: Exception, what: str) -> None:
        """Warn once and decode uncompiled from now on."""
        import warnings

        warnings.warn(f"NOSA decode: torch.compile of the decode step failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:300] if str(e) else ''}); {what}", stacklevel=3)
        self.cache_options = {**self.cache_options, "compile": False}

    def _decode_body(self, h: Tensor, position_embeddings, cache: NOSABlockCache) -> Tensor:
        """Every layer's decode step; with ``decode_streams`` > 1 the batch runs in parts, layer by
        layer, each part on its own CUDA stream (``NOSABlockCache.decode_parts``)."""
        recording = any(layer.self_attn.record_selection for layer in self.layers)
        parts = [] if recording else cache.decode_parts()
        if not parts:
            for layer in self.layers:
                h = layer(h, None, position_embeddings, cache)
            return self.norm(h)
        return self.norm(self._decode_in_parts(h, position_embeddings, cache, parts))

    def _decode_in_parts(self, h: Tensor, position_embeddings, cache, parts: list) -> Tensor:
        """The layers over each part of the batch (views of ``cache``), part ``i`` on stream ``i``; the
        streams fork from and join into the current one (also inside a graph capture)."""
        cos, sin = position_embeddings
        spans = [p.part_range for p in parts]
        hs = [h[a:b] for a, b in spans]
        pes = [(cos[a:b], sin[a:b]) for a, b in spans]
        streams = cache.part_streams(len(parts)) if h.is_cuda else [None] * len(parts)
        cur = torch.cuda.current_stream() if h.is_cuda else None
        for s in streams:
            if s is not None:
                s.wait_stream(cur)
        for layer in self.layers:
            for i, (part, s) in enumerate(zip(parts, streams)):
                with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
                    hs[i] = layer(hs[i], None, pes[i], part)
        capturing = h.is_cuda and torch.cuda.is_current_stream_capturing()
        for s, t in zip(streams, hs):
            if s is not None:
                cur.wait_stream(s)
                if not capturing:  # made on s, read on cur below (a captured graph keeps its pool)
                    t.record_stream(cur)
        cache.gather_parts(parts)
        return torch.cat(hs)

    def _graph_decode(self, x: Tensor, attention_mask, position_ids, cache) -> Tensor | None:
        """One decode step through a captured CUDA graph (see ``DecodeGraph``); ``None`` if capturing
        failed (the model then stays on the eager path, with a warning)."""
        B = x.shape[0]
        valid_new = (torch.ones(B, 1, dtype=torch.bool, device=x.device) if attention_mask is None
                     else attention_mask[:, -1:].to(torch.bool))
        cache.begin(valid_new, 1, x.device, x.dtype)
        if position_ids is None:
            position_ids = cache.lens[:, None]
        cos, sin = self.rotary_emb(x, position_ids)
        if cache.graph is None or cache.graph.version != cache.version or cache.graph.batch != cache.batch:
            cache.graph = DecodeGraph(cache)
        body = self._decode_fn(cache, graphed=True)
        try:
            try:
                h = cache.graph.step(cache, lambda e, pe: body(e, pe, cache), x, cos, sin, valid_new)
                cache.graph.compiled = body is not self._decode_body
            except Exception as e:  # noqa: BLE001 (compiled: retry with the plain body, then eager)
                if body is self._decode_body:
                    raise
                self._compile_failed(e, "capturing the uncompiled step")
                cache.graph = DecodeGraph(cache)
                h = cache.graph.step(cache, lambda e, pe: self._decode_body(e, pe, cache), x, cos, sin, valid_new)
        except Exception as e:  # noqa: BLE001 (fall back to the eager step, which computes the same)
            import warnings

            warnings.warn(f"NOSA decode: CUDA graph capture failed ({type(e).__name__}: {e}); "
                          "decoding eagerly from now on", stacklevel=2)
            self.cache_options = {**self.cache_options, "cuda_graphs": False}
            cache.graph = None
            h = self._decode_body(x, (cos, sin), cache)
            cache.end()
            return h
        cache.end(lens_advanced=True)
        return h

    def layer_specs(self) -> list:
        """What each layer keeps in a :class:`NOSABlockCache`."""
        return [LayerSpec(cfg=a.cfg, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                          has_score=a._evict is not None and a._evict.has_score)
                for a in (layer.self_attn for layer in self.layers)]

    def new_cache(self, offload: bool = False, gpu_blocks: int | None = None, dynamic: bool = False,
                  reserve: int | None = None, fetch: str = "auto", attention: str = "auto",
                  decode_streams: int | None = None):
        """An empty KV cache for this model: the block cache (``offload=True``: blocks in pinned CPU
        memory, ``gpu_blocks`` slots per sequence and KV head on the GPU; ``reserve`` tokens per sequence
        allocated up front; ``fetch``: how offloaded blocks move, ``uva`` = Triton kernels reading pinned host
        memory directly (no host synchronisation, CUDA-graph friendly), ``copy`` = gathered on the host and
        copied, ``auto`` = ``uva`` when Triton and CUDA are there; ``attention``: the decode attention over
        the selected blocks, ``triton`` = a kernel reading them in place, ``torch`` = gathered copies,
        ``auto`` = ``triton`` on CUDA when installed; ``decode_streams``: parts of the batch decoded on
        their own CUDA streams, default 4 offloaded and 1 otherwise, see ``NOSABlockCache``), or with
        ``dynamic=True`` transformers' ``DynamicCache`` (the slow reference decode path)."""
        if dynamic:
            try:
                return DynamicCache(config=self.config)
            except TypeError:
                return DynamicCache()
        return NOSABlockCache(self.layer_specs(), offload=offload, gpu_blocks=gpu_blocks, reserve=reserve,
                              fetch=fetch, attention=attention, decode_streams=decode_streams)

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", False)
        if use_cache and cache is None:
            step_only = ("cuda_graphs", "compile")  # options of the decode step, not of the cache
            cache = self.new_cache(**{k: v for k, v in self.cache_options.items() if k not in step_only})
        B, T = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if self._graph_decode_applies(cache, T, inputs_embeds):
            h = self._graph_decode(inputs_embeds, attention_mask, position_ids, cache)
            if h is not None:
                return BaseModelOutputWithPast(**{"last_hidden_state": h, _cache_field(BaseModelOutputWithPast): cache})
        if attention_mask is None:
            valid = torch.ones(B, past + T, dtype=torch.bool, device=inputs_embeds.device)
        else:
            if attention_mask.dim() != 2:
                raise ValueError("NOSA models take a 2D attention_mask [batch, past + new tokens] (1 = token, 0 = pad)")
            valid = attention_mask.to(torch.bool)
            if valid.shape[1] == T and past > 0:  # mask of the new tokens only
                valid = torch.cat([valid.new_ones(B, past), valid], dim=1)
            if valid.shape[1] != past + T:
                raise ValueError(f"attention_mask covers {valid.shape[1]} positions; expected past + new = {past + T}")
        if position_ids is None:  # per-sequence positions: padding does not shift a sequence
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        h = inputs_embeds
        block_cache = isinstance(cache, NOSABlockCache)
        if block_cache:
            cache.begin(valid, T, h.device, h.dtype)
        if block_cache and cache.decoding:
            body = self._decode_fn(cache, graphed=False)
            try:
                h = body(h, position_embeddings, cache)
            except Exception as e:  # noqa: BLE001 (the plain body computes the same)
                if body is self._decode_body:
                    raise
                self._compile_failed(e, "decoding uncompiled from now on")
                h = self._decode_body(h, position_embeddings, cache)
        else:
            for layer in self.layers:
                h = layer(h, valid, position_embeddings, cache)
            h = self.norm(h)
        if block_cache:
            cache.end()
        return BaseModelOutputWithPast(**{"last_hidden_state": h, _cache_field(BaseModelOutputWithPast): cache})


class NOSALlamaForCausalLM(NOSALlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = LlamaForCausalLM._tied_weights_keys
    _tp_plan = {}
    _pp_plan = {}

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = NOSALlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        field = _cache_field(CausalLMOutputWithPast)
        return CausalLMOutputWithPast(**{"loss": loss, "logits": logits, field: getattr(out, _cache_field(type(out)))})

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward() makes a NOSABlockCache; generate() takes it from the outputs

    def new_cache(self, offload: bool = False, gpu_blocks: int | None = None, dynamic: bool = False,
                  reserve: int | None = None, fetch: str = "auto", attention: str = "auto",
                  decode_streams: int | None = None):
        """An empty KV cache to pass to ``generate(..., cache=...)`` (see ``NOSALlamaModel.new_cache``)."""
        return self.model.new_cache(offload=offload, gpu_blocks=gpu_blocks, dynamic=dynamic, reserve=reserve,
                                    fetch=fetch, attention=attention, decode_streams=decode_streams)

    def set_cache_options(self, offload: bool = False, gpu_blocks: int | None = None, dynamic: bool = False,
                          cuda_graphs: bool = True, fetch: str = "auto", attention: str = "auto",
                          decode_streams: int | None = None, compile: bool | str = "auto") -> None:
        """Options of the caches that ``forward`` / ``generate`` make when given none (e.g. under lm-eval);
        ``cuda_graphs=False`` keeps GPU decode steps eager (default: captured once per cache layout);
        ``compile``: the decode step through ``torch.compile`` (``auto``: Inductor inside the CUDA graph of a
        GPU-resident cache; ``True``: every batched step; ``False``; or a backend name; see
        ``NOSALlamaModel._decode_fn``)."""
        if not isinstance(compile, bool) and not (isinstance(compile, str) and compile):
            raise ValueError(f"compile must be a bool or a torch.compile backend name, got {compile!r}")
        self.model.cache_options = {"offload": offload, "gpu_blocks": gpu_blocks, "dynamic": dynamic,
                                    "cuda_graphs": cuda_graphs, "fetch": fetch, "attention": attention,
                                    "decode_streams": decode_streams, "compile": compile}

    def selections(self) -> dict:
        """``{layer: [per-sequence bool [Hkv, rows, blocks]]}`` of the last forward (after ``record(True)``)."""
        return {i: layer.self_attn.last_selection for i, layer in enumerate(self.model.layers)
                if layer.self_attn.cfg is not None}

    def record(self, on: bool = True) -> None:
        for layer in self.model.layers:
            layer.self_attn.record_selection = on


__all__ = ["NOSAAttention", "NOSABlockCache", "NOSALlamaForCausalLM", "NOSALlamaModel", "NOSALlamaPreTrainedModel"]

