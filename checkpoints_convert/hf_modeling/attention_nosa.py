"""The attention layer of exported NOSA / InfLLM-V2 Llamas (shipped next to ``modeling_nosa.py``, which
builds its decoder layers from it; needs only ``torch``, and ``transformers`` through that file).

``NOSAAttention`` runs one layer's variant (dense, InfLLM-V2 or NOSA with its eviction head) on the
copies of the framework's NOSA reference shipped next to it (imports made relative by the exporter):

* with the block KV cache (``nosa_block_cache.py``): prompts appended and attended per sequence (fresh
  prompts of a batch as one packed Triton call when the framework's kernels run), decode steps batched
  by the cache;
* with transformers' ``DynamicCache`` or none: per sequence, padded slots dropped; on a GPU a full
  prefill runs the Triton kernels, otherwise the reference selection and attention, rows in chunks of
  at most ``ROW_CHUNK_ELEMENTS`` fp32 logits.

The eviction head's parameters live directly on this module (``A``, ``delta``, ...), as in the public
``openbmb/NOSA-*`` checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference.block_cache import NOSABlockCache
from nosa_layers.config import NOSAConfig, eviction_head_name
from nosa_layers.decode import nosa_decode_step
from nosa_layers.dispatch import nosa_attention, resolve_backend
from nosa_layers.eviction import build_eviction_head
from nosa_layers.reference import block_sparse_attention
from nosa_layers.selection import select_rows

from .configuration_nosa import nosa_settings

# Bound on the fp32 attention logits of one chunk of prefill rows in the PyTorch path.
ROW_CHUNK_ELEMENTS = 1 << 27


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class NOSAAttention(nn.Module):
    """Llama attention whose layer variant is dense, InfLLM-V2 (query-aware blocks) or NOSA (+ eviction head).

    The eviction head (any head of the shipped registry, ``nosa_eviction.py``) keeps its parameters
    directly on this module (``A``, ``delta``, ...), as in the public checkpoints; the head object
    of the reference module is kept unregistered and re-pointed at them before every use.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        s = nosa_settings(config)
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.variant = s["layer_variants"][layer_idx]
        self.backend = s.get("backend", "auto")
        bias = bool(getattr(config, "attention_bias", False))
        d, h = self.head_dim, config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.cfg: Optional[NOSAConfig] = None
        self._head_args: dict = {}
        self._head_params: tuple = ()
        self._head_children: tuple = ()
        object.__setattr__(self, "_evict", None)
        if self.variant in ("nosa", "infllm_v2"):
            head = eviction_head_name([self.variant], s["eviction_head"])
            self.cfg = NOSAConfig.from_fields(s, eviction_head=head).validate()
            self._head_args = dict(name=head, num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=d, bias=bool(s.get("eviction_bias", False)))
            ev = build_eviction_head(**self._head_args)
            self._head_children = tuple(n for n, _ in ev.named_children())
            self._head_params = tuple(n for n, _ in ev.named_parameters(recurse=False))
            for n, m in ev.named_children():
                self.add_module(n, m)
            for n, p in ev.named_parameters(recurse=False):
                self.register_parameter(n, p)
            object.__setattr__(self, "_evict", ev)
        elif self.variant != "dense":
            raise ValueError(f"layer {layer_idx}: unknown attention variant {self.variant!r}")
        self.record_selection = False  # test hook: keep the blocks selected by the last call
        self.last_selection: list = []

    # ------------------------------------------------------------------ eviction head
    def _head(self):
        ev = self._evict
        for n in self._head_children:
            ev._modules[n] = self._modules[n]
        for n in self._head_params:
            ev._parameters[n] = self._parameters[n]
        return ev

    def init_eviction_parameters(self) -> None:
        """The head's own parameters as the registry's module initialises them (NOSA: ``A = 0``);
        its sub-layers (``delta``, ...) are HF's usual linear layers."""
        if self._head_params:
            fresh = build_eviction_head(**self._head_args)
            with torch.no_grad():
                for n in self._head_params:
                    self._parameters[n].copy_(fresh._parameters[n])

    def _scores(self, q: Tensor, k: Tensor, v: Tensor, v_all: Tensor, cache, fresh: bool):
        """Eviction score and bias ``[B, L, Hkv]`` of every cached token (L = cache length)."""
        if self._evict is None:
            return None, None
        head = self._head()
        if not head.reads_qk:  # a function of v alone: recompute from the value cache
            ev = head(None, None, v_all)
            return ev.score, ev.bias
        ev = head(q, k, v)  # needs the token's own pre-RoPE q/k: keep a side cache of the outputs
        if cache is None:
            return ev.score, ev.bias
        store = cache.__dict__.setdefault("_nosa_eviction", {})
        prev = None if fresh else store.get(self.layer_idx)
        score = ev.score if prev is None else torch.cat([prev[0], ev.score], dim=1)
        bias = ev.bias if prev is None else torch.cat([prev[1], ev.bias], dim=1)
        if score.shape[1] != v_all.shape[1]:
            raise RuntimeError(f"layer {self.layer_idx}: eviction-score cache ({score.shape[1]}) out of step with "
                               f"the KV cache ({v_all.shape[1]}); {head.name!r} heads do not support cache edits")
        store[self.layer_idx] = (score, bias)
        return score, bias

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: Tensor, valid: Tensor, position_embeddings, cache=None, **kwargs):
        B, T, _ = hidden_states.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(hidden_states).view(B, T, Hq, D)
        k = self.k_proj(hidden_states).view(B, T, Hkv, D)
        v = self.v_proj(hidden_states).view(B, T, Hkv, D)
        cos, sin = position_embeddings  # [B, T, D]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        q_r = q * cos + rotate_half(q) * sin
        k_r = k * cos + rotate_half(k) * sin
        if isinstance(cache, NOSABlockCache):
            out = self._with_block_cache(q, k, v, q_r, k_r, cache)
            return self.o_proj(out.reshape(B, T, Hq * D)), None
        fresh = cache is None or cache.get_seq_length(self.layer_idx) == 0
        if cache is not None:
            k_all, v_all = cache.update(k_r.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, L, Hkv, D]
        else:
            k_all, v_all = k_r, v
        score, bias = self._scores(q, k, v, v_all, cache, fresh)
        out = self._attend(q_r, k_all, v_all, score, bias, valid)
        return self.o_proj(out.reshape(B, T, Hq * D)), None

    def _new_token_scores(self, q: Tensor, k: Tensor, v: Tensor):
        """Eviction score and bias ``[B, T, Hkv]`` of the new tokens (pre-RoPE q, k); ``bias is score``
        when the head adds its score (ED-DMA)."""
        if self._evict is None:
            return None, None
        ev = self._head()(q, k, v)
        return ev.score, ev.bias

    def _with_block_cache(self, q: Tensor, k: Tensor, v: Tensor, q_r: Tensor, k_r: Tensor,
                          cache: NOSABlockCache) -> Tensor:
        """Attention with the block KV cache: a batched decode step, or (prompt / chunk) append the valid
        new tokens and attend each sequence's new rows to its whole cached context."""
        score, bias = self._new_token_scores(q, k, v)
        if cache.decoding:
            out, sel = cache.decode(self.layer_idx, q_r, k_r, v, score, bias, record=self.record_selection)
            self.last_selection = sel or []
            return out
        per_seq = cache.extend(self.layer_idx, k_r, v, score, bias)
        out = q_r.new_zeros(q_r.shape)
        self.last_selection = []
        fresh = all(n0 == 0 for n0 in cache.start)
        if fresh and self.cfg is not None and len(per_seq) > 1 and \
                resolve_backend(self.backend, q_r.device, q_r.shape[-1], self.cfg.block_size) == "triton":
            return self._attend_packed(q_r, per_seq, out)
        for b, (rows, kb, vb, sb, bb) in enumerate(per_seq):
            if rows.numel() == 0:
                self.last_selection.append(None)
                continue
            out[b, rows] = self._attend_one(q_r[b:b + 1, rows], kb, vb, sb, bb)[0]
        return out

    def _attend_packed(self, q: Tensor, per_seq: list, out: Tensor) -> Tensor:
        """Fresh prompts of a batch as one packed (``cu_seqlens``) call of the Triton kernels."""
        keep = [(b, item) for b, item in enumerate(per_seq) if item[0].numel()]
        lens = [0] + [int(item[0].numel()) for _, item in keep]
        bounds = torch.tensor(lens).cumsum(0).tolist()
        cu = torch.tensor(bounds, device=q.device, dtype=torch.int32)
        qp = torch.cat([q[b, item[0]] for b, item in keep])[None]
        kp = torch.cat([item[1][0] for _, item in keep])[None]
        vp = torch.cat([item[2][0] for _, item in keep])[None]
        sp = None if keep[0][1][3] is None else torch.cat([item[3][0] for _, item in keep])[None]
        bp = None if keep[0][1][4] is None else torch.cat([item[4][0] for _, item in keep])[None]
        o = nosa_attention(qp, kp, vp, sp, self.cfg, cu_seqlens=cu, backend="triton", attn_bias=bp)[0]
        sel = {}
        for j, (b, item) in enumerate(keep):
            a, e = bounds[j], bounds[j + 1]
            out[b, item[0]] = o[a:e]
            if self.record_selection:
                from nosa_layers.selection import select_blocks_reference

                sel[b] = select_blocks_reference(qp[:, a:e], kp[:, a:e], None if sp is None else sp[:, a:e],
                                                 self.cfg)[0].cpu()
        if self.record_selection:
            self.last_selection = [sel.get(b) for b in range(len(per_seq))]
        return out

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, score, bias, valid: Tensor) -> Tensor:
        """Per sequence: drop padded slots, attend the valid new rows to the valid prefix."""
        B, T = q.shape[:2]
        L = k.shape[1]
        P = L - T
        out = q.new_zeros(q.shape)
        self.last_selection = []
        for b in range(B):
            idx = valid[b].nonzero().squeeze(-1)
            rows = valid[b, P:].nonzero().squeeze(-1)
            m, n = rows.numel(), idx.numel()
            if m == 0:
                self.last_selection.append(None)
                continue
            if not torch.equal(idx[n - m:], rows + P):
                raise ValueError("padding between new tokens and the cached prefix is not supported; "
                                 "pad on the left or on the right")
            qb, kb, vb = q[b:b + 1, rows], k[b:b + 1, idx], v[b:b + 1, idx]
            sb = None if score is None else score[b:b + 1, idx]
            bb = None if bias is None else bias[b:b + 1, idx]
            out[b, rows] = self._attend_one(qb, kb, vb, sb, bb)[0]
        return out

    def _attend_one(self, q: Tensor, k: Tensor, v: Tensor, score, bias) -> Tensor:
        """q ``[1, m, Hq, D]`` = the last m of n tokens, k/v ``[1, n, Hkv, D]``, score/bias ``[1, n, Hkv]``."""
        m, n = q.shape[1], k.shape[1]
        if self.cfg is None:  # dense layer
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
            return o.transpose(1, 2)
        cfg = self.cfg
        if m == 1:  # decode step (or a one-token prompt)
            step = nosa_decode_step(q, k, v, score, cfg, bias_cache=bias)
            if self.record_selection:
                self.last_selection.append(step.selected[0][:, None].cpu())
            return step.out
        if m == n and resolve_backend(self.backend, q.device, q.shape[-1], cfg.block_size) == "triton":  # GPU prefill
            if self.record_selection:
                from nosa_layers.selection import select_blocks_reference

                self.last_selection.append(select_blocks_reference(q, k, score, cfg)[0].cpu())
            return nosa_attention(q, k, v, score, cfg, backend="triton", attn_bias=bias)
        # PyTorch path: the reference selection and attention, rows in chunks to bound memory
        chunk = max(1, ROW_CHUNK_ELEMENTS // max(1, self.num_heads * n))
        outs, sels = [], []
        with torch.no_grad():
            sc = None if score is None else score.detach()
        for r0 in range(0, m, chunk):
            r1 = min(m, r0 + chunk)
            pos = torch.arange(n - m + r0, n - m + r1, device=q.device)
            kv_len = n - m + r1
            sel = select_rows(q[:, r0:r1].detach(), k[:, :kv_len].detach(),
                              None if sc is None else sc[:, :kv_len], pos, cfg)
            outs.append(block_sparse_attention(q[:, r0:r1], k[:, :kv_len], v[:, :kv_len], sel, cfg.block_size,
                                               bias=None if bias is None else bias[:, :kv_len],
                                               q_offset=n - m + r0))
            if self.record_selection:
                nb = cfg.num_blocks(n)
                full = torch.zeros(*sel.shape[:-1], nb, dtype=torch.bool)
                full[..., :sel.shape[-1]] = sel.cpu()
                sels.append(full[0])
        if self.record_selection:
            self.last_selection.append(torch.cat(sels, dim=1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
