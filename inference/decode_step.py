"""One decode step of one layer of the block KV cache: a new token per sequence, for all sequences at once.

A fixed number of batched tensor operations per layer, independent of the context length and with no host
synchronisation in the GPU-resident mode: the new key / value / score are written at each sequence's own
length, a window that the token completes is added to the compressed keys and window score means, the
reference selection of that row (``nosa_layers.selection.select_rows``) is recomputed from them for all
sequences (``inference.decode_select.select_decode_fast``, tested against the plain batched reference
``select_decode_batched``; with the Triton attention, one kernel launch: ``nosa_layers.ops.decode_selection``),
and the token attends to the selected blocks: read in place by the
Triton kernel (``nosa_layers.ops.decode_attention``) or gathered and ``attend``-ed. An offloaded layer first
brings the selected blocks into its GPU slots (``inference.transfers``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.decode_select import attend, decode_masks, select_decode_fast
from inference.storage import LayerState
from nosa_layers.config import NOSAConfig
from nosa_layers.ops.decode_attention import decode_attention
from nosa_layers.ops.decode_attention import supported as attn_kernel_supported
from nosa_layers.ops.decode_selection import select_decode_kernel
from nosa_layers.ops.decode_selection import supported as select_kernel_supported


class StepGrid:
    """What a decode step derives from its positions ``pos [B]`` (each new token's), made once per step and
    shared by the layers: block and offset of the token, index grids, window targets, selection masks."""

    def __init__(self, pos: Tensor, batch: int, block_size: int) -> None:
        self.pos, self.batch, self.block_size = pos, batch, block_size
        self._derived: dict = {}

    def _once(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def block_offset(self) -> tuple[Tensor, Tensor]:
        """Block and offset in it of each new token, ``[B]`` each."""
        return self._once("blk_off", lambda: (self.pos // self.block_size, self.pos % self.block_size))

    def batch_arange(self, device) -> Tensor:
        return self._once("arange_b", lambda: torch.arange(self.batch, device=device))

    def batch_head(self, Hkv: int, device) -> tuple[Tensor, Tensor]:
        """``arange(B)[:, None]`` and ``arange(Hkv)[None, :]``: the index grids of a step's tensors."""
        return self._once(("bi_hi", Hkv), lambda: (self.batch_arange(device)[:, None],
                                                   torch.arange(Hkv, device=device)[None, :]))

    def head_rows(self, Hkv: int, device) -> Tensor:
        """``[B, Hkv, 1]`` row ``b * Hkv + h`` of each (sequence, KV head): with ``* NB + block`` (or
        ``* C + slot``) a row of the block pools, host store and slots."""
        return self._once(("rows", Hkv), lambda: torch.arange(self.batch * Hkv, device=device).view(-1, Hkv, 1))

    def window_targets(self, cfg: NOSAConfig, sink: int) -> tuple[Tensor, Tensor]:
        """Ring slot of the new token and the window it completes (``sink`` if none), ``[B]`` each."""
        def make():
            n = self.pos + 1  # length after this token
            done = (n >= cfg.kernel_size) & ((n - cfg.kernel_size) % cfg.kernel_stride == 0)
            w = torch.where(done, torch.div(n - cfg.kernel_size, cfg.kernel_stride, rounding_mode="floor"), sink)
            return self.pos % cfg.kernel_size, w.clamp(max=sink)

        return self._once(("win", cfg.kernel_size, cfg.kernel_stride, sink), make)

    def masks(self, cfg: NOSAConfig, NB: int, NW: int) -> dict:
        """``decode_masks``, once per step for all layers of one geometry (each layer has its own config)."""
        key = ("masks", cfg.block_size, cfg.kernel_size, cfg.kernel_stride, cfg.init_blocks, cfg.local_blocks, NB, NW)
        return self._once(key, lambda: decode_masks(self.pos, cfg, NB, NW))


def decode_layer(cache, st: LayerState, q: Tensor, k: Tensor, v: Tensor, score: Tensor | None, bias: Tensor | None,
                 scale: float, record: bool = False):
    """One token per sequence through layer ``st`` of ``cache`` (an ``inference.block_cache.NOSABlockCache``
    in a decode step): ``q [B, 1, Hq, D]`` post-RoPE, ``k, v [B, 1, Hkv, D]``, ``score``/``bias [B, 1, Hkv]``.
    Returns ``(out [B, 1, Hq, D], selection)``; ``selection`` (only with ``record``) is a list of bool
    ``[Hkv, 1, nb]`` per sequence, ``nb`` = its blocks."""
    grid = cache.grid
    B, _, Hq, D = q.shape
    Hkv = st.spec.num_kv_heads
    G = Hq // Hkv
    pos, bs = grid.pos, cache.block_size
    bi, hi = grid.batch_head(Hkv, q.device)
    k1, v1 = k[:, 0].to(cache.dtype), v[:, 0].to(cache.dtype)  # [B, Hkv, D]
    qg = q[:, 0].view(B, Hkv, G, D)
    if st.spec.cfg is None:  # dense layer: every cached token
        _store_token(st, grid, k1, v1)
        kk, vv = st.k.view(B, Hkv, -1, D), st.v.view(B, Hkv, -1, D)
        ok = (torch.arange(kk.shape[2], device=q.device)[None, :] <= pos[:, None])[:, None, :]
        out = attend(qg, kk, vv, None, ok.expand(B, Hkv, -1), scale)
        return out.reshape(B, 1, Hq, D).to(q.dtype), None
    cfg = st.spec.cfg
    s1 = b1 = None  # the new token's score and bias [B, Hkv]
    if st.score is not None:
        s1 = score[:, 0].to(st.score.dtype)
        b1 = s1 if st.bias_mode == "score" else (bias[:, 0].to(st.bias.dtype) if st.bias_mode == "own" else None)
        if not st.offloaded:  # offloaded: written to the host store with the token's key / value
            st.score[bi, hi, pos[:, None]] = s1
            if st.bias_mode == "own":
                st.bias[bi, hi, pos[:, None]] = b1
    _update_windows(st, grid, cfg, k1, s1, cache.state_dtype)
    NW = st.kc.shape[2] - 1  # windows; column NW is the sink of windows not complete yet
    index = cache.window_index(cfg, st.num_blocks, NW, q.device)
    wsc = None if st.score is None else st.wsc
    if cache.attention == "triton" and select_kernel_supported(qg, st.kc, wsc, index):  # one launch
        sel, sel_ok = select_decode_kernel(qg, st.kc, wsc, pos, cfg, index, scale)
    else:
        masks = grid.masks(cfg, index.shape[0], NW + 1)
        sel, sel_ok = select_decode_fast(qg, st.kc, wsc, cfg, index, scale, masks)
    tok = (k1, v1, s1, b1)
    if _kernel_applies(cache, st, qg, sel):
        out = _attend_in_place(cache, st, qg, sel, sel_ok, tok, scale)
    else:
        out = _attend_gathered(cache, st, qg, sel, sel_ok, tok, scale)
    out = out.reshape(B, 1, Hq, D).to(q.dtype)
    recorded = None
    if record:
        NB = index.shape[0]
        mask = torch.zeros(B, Hkv, NB + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(-1, torch.where(sel_ok, sel, NB), True)
        recorded = [mask[b, :, None, :int(pos[b]) // bs + 1].cpu() for b in range(B)]
    return out, recorded


def _update_windows(st: LayerState, grid: StepGrid, cfg: NOSAConfig, k1: Tensor, s1: Tensor | None,
                    state_dtype: torch.dtype) -> None:
    """Ring write of the new key / score; a completed window goes into ``kc`` / ``wsc``."""
    sink = st.kc.shape[2] - 1
    bi = grid.batch_arange(k1.device)
    slot, w = grid.window_targets(cfg, sink)
    st.ring_k[bi, :, slot] = k1.to(st.ring_k.dtype)
    if s1 is not None:
        st.ring_s[bi, :, slot] = s1
    st.kc[bi, :, w] = st.ring_k.to(state_dtype).mean(dim=2).to(st.kc.dtype)
    if s1 is not None:
        st.wsc[bi, :, w] = st.ring_s.mean(dim=2)


def _kernel_applies(cache, st: LayerState, q: Tensor, sel: Tensor) -> bool:
    """The Triton decode attention: chosen, a shape it takes, and every selected block readable by a kernel
    (resident, or a slot-less block in pinned host memory that kernels address: ``uva``)."""
    if cache.attention != "triton" or not attn_kernel_supported(q, cache.block_size):
        return False
    short = st.offloaded and st.num_slots < sel.shape[-1]
    return not short or cache.transfers.fetch == "uva" or q.device.type == "cpu"


def _attend_in_place(cache, st: LayerState, qg: Tensor, sel: Tensor, sel_ok: Tensor, tok: tuple,
                     scale: float) -> Tensor:
    """Store the new token ``tok = (k1, v1, s1, b1)``, then attend over the selected blocks where they lie
    (no gathered copies)."""
    grid = cache.grid
    B, Hkv, K = sel.shape
    qg = qg.to(cache.dtype)
    row = grid.head_rows(Hkv, sel.device)
    has_bias = tok[3] is not None
    if st.offloaded:
        slots, src = cache.transfers.make_resident(st, grid, sel, sel_ok, tok)
        C = st.num_slots
        rows = torch.where(slots >= 0, row * C + slots, -1)
        host = {}
        if C < K:  # the kernel reads the slot-less blocks from the host store: count them as moved
            host = {"host_k": st.cpu_k, "host_v": st.cpu_v, "host_rows": src,
                    "host_bias": st.host_bias_rows() if has_bias else None}
            cache.transfers.stats.fetched_dev += (sel_ok & (slots < 0)).sum()
        return decode_attention(qg, st.gpu_k, st.gpu_v, rows, sel, sel_ok, grid.pos, scale,
                                st.gpu_b if has_bias else None, **host)
    _store_token(st, grid, tok[0], tok[1])
    NB = st.k.shape[2]
    pool_k, pool_v = st.k.view(B * Hkv * NB, *st.k.shape[3:]), st.v.view(B * Hkv * NB, *st.v.shape[3:])
    pool_b = st.bias.view(B * Hkv * NB, cache.block_size) if has_bias else None
    return decode_attention(qg, pool_k, pool_v, row * NB + sel, sel, sel_ok, grid.pos, scale, pool_b)


def _store_token(st: LayerState, grid: StepGrid, k1: Tensor, v1: Tensor) -> None:
    """GPU-resident mode: the new token's ``k1, v1 [B, Hkv, D]`` at its block and offset."""
    blk, off = grid.block_offset()
    bi, hi = grid.batch_head(k1.shape[1], k1.device)
    st.k[bi, hi, blk[:, None], off[:, None]] = k1
    st.v[bi, hi, blk[:, None], off[:, None]] = v1


def _attend_gathered(cache, st: LayerState, qg: Tensor, sel: Tensor, sel_ok: Tensor, tok: tuple,
                     scale: float) -> Tensor:
    """Store the new token ``tok = (k1, v1, s1, b1)``, gather the selected blocks into new tensors and
    ``attend`` (PyTorch)."""
    grid = cache.grid
    B, Hkv, K = sel.shape
    bs, D, pos = cache.block_size, qg.shape[-1], grid.pos
    bi, hi = grid.batch_head(Hkv, sel.device)
    has_bias = tok[3] is not None
    bb = None
    if st.offloaded:
        kb, vb, bb = cache.transfers.gather_selected(st, grid, sel, sel_ok, tok)
    else:
        _store_token(st, grid, tok[0], tok[1])
        kb, vb = st.k[bi[..., None], hi[..., None], sel], st.v[bi[..., None], hi[..., None], sel]
        if has_bias:
            bb = st.bias.view(B, Hkv, -1, bs)[bi[..., None], hi[..., None], sel]
    kb, vb = kb.view(B, Hkv, K * bs, D), vb.view(B, Hkv, K * bs, D)
    tok_pos = (sel[..., None] * bs + torch.arange(bs, device=sel.device)).view(B, Hkv, K * bs)
    ok = sel_ok[..., None].expand(B, Hkv, K, bs).reshape(B, Hkv, K * bs) & (tok_pos <= pos[:, None, None])
    return attend(qg, kb, vb, bb.reshape(B, Hkv, K * bs) if has_bias else None, ok, scale)
