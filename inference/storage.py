"""What one layer of the block KV cache stores, and how it is allocated, grown, reordered, read and written.

Per layer (``B`` sequences, ``Hkv`` KV heads, ``NB`` blocks of ``bs`` tokens, capacity ``cap = NB * bs``
tokens per sequence; sequences are stored compactly, padding never enters):

* keys / values ``[B, Hkv, NB, bs, D]`` (cache dtype) on the GPU, or, offloaded, in pinned host memory
  (``cpu_k / cpu_v [B * Hkv * NB, bs, D]``: one block of one KV head per row) plus ``C`` GPU block slots per
  (sequence, KV head) (``gpu_k / gpu_v [B * Hkv * C, bs, D]``) that hold the blocks a step selected;
* eviction score / bias ``[B, Hkv, cap]`` (fp32), by token: on the GPU, or, offloaded, in the pinned host store
  with their blocks, the slots holding the bias rows ``[bs]`` of their blocks (``gpu_b``);
* the selection's running state, on the GPU in both modes: compressed keys ``kc [B, Hkv, NW + 1, D]`` (window
  means taken in fp32 and rounded once to the cache dtype, as the training kernels store them; the last column
  is a write sink), window means of the score ``wsc [B, Hkv, NW + 1]`` (fp32) and a ring of the last
  ``kernel_size`` keys and scores.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.selection import compressed_keys, window_scores

CAPACITY_MARGIN = 1024  # tokens allocated past the prompt before the cache grows (doubling)

# LayerState tensors by their first axis: one entry per sequence (``bias`` follows ``score`` or is its own),
# or ``rows per sequence`` entries per sequence (host store and slots: ``[B * rows, ...]``)
PER_SEQUENCE = ("k", "v", "score", "kc", "wsc", "ring_k", "ring_s", "slot_of", "slot_block")
PER_ROW = ("cpu_k", "cpu_v", "gpu_k", "gpu_v", "gpu_b")


def pin(t: Tensor) -> Tensor:
    """``t`` in pinned host memory where a GPU can read it (a plain CPU tensor without CUDA)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def rows_of(t: Tensor, idx: Tensor, cpu_idx: Tensor) -> Tensor:
    """``t.index_select(0, ...)`` on the tensor's own side: device tensors with ``idx``, host-store tensors
    (pinned, CPU) with ``cpu_idx`` straight into new pinned memory (no second copy)."""
    if t.device == idx.device:
        return t.index_select(0, idx)
    out = torch.empty(int(cpu_idx.numel()), *t.shape[1:], dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return torch.index_select(t, 0, cpu_idx, out=out)


def round_capacity(tokens: int, block_size: int) -> int:
    """Tokens per sequence to allocate for ``tokens``: whole steps of 16 blocks (keeps the window count
    integral for any ``kernel_stride`` dividing ``block_size``)."""
    step = block_size * 16
    return max(step, math.ceil(tokens / step) * step)


@dataclass(frozen=True)
class Layout:
    """Sizes that every layer of one cache shares: ``batch`` sequences of ``capacity`` tokens in blocks of
    ``block_size``; ``slots`` GPU block slots per (sequence, KV head) where ``offload``; the cache ``dtype`` and
    the ``state_dtype`` of scores and softmax (at least fp32); the ``device``."""

    batch: int
    capacity: int
    block_size: int
    slots: int
    offload: bool
    dtype: torch.dtype
    state_dtype: torch.dtype
    device: torch.device | str


@dataclass
class LayerSpec:
    """What one layer stores: ``cfg`` (None: dense layer), KV heads, head dim, eviction score or not."""

    cfg: NOSAConfig | None
    num_kv_heads: int
    head_dim: int
    has_score: bool


@dataclass
class LayerState:
    """The tensors of one layer (shapes: the module docstring)."""

    spec: LayerSpec
    k: Tensor | None = None  # [B, Hkv, NB, bs, D] on the GPU (full mode, and dense layers)
    v: Tensor | None = None
    score: Tensor | None = None  # [B, Hkv, cap] fp32 (offloaded layers: in the pinned host store)
    bias: Tensor | None = None  # [B, Hkv, cap] fp32 (the score tensor itself for ED-DMA; host as the score)
    bias_mode: str = "unset"  # "score" | "own" | "none"
    kc: Tensor | None = None  # [B, Hkv, NW + 1, D] cache dtype (fp32 means, rounded once)
    wsc: Tensor | None = None  # [B, Hkv, NW + 1] fp32
    ring_k: Tensor | None = None  # [B, Hkv, kernel_size, D] cache dtype
    ring_s: Tensor | None = None  # [B, Hkv, kernel_size] fp32
    # offload mode (NOSA layers only)
    cpu_k: Tensor | None = None  # [B * Hkv * NB, bs, D] pinned
    cpu_v: Tensor | None = None
    gpu_k: Tensor | None = None  # [B * Hkv * C, bs, D] slots
    gpu_v: Tensor | None = None
    gpu_b: Tensor | None = None  # [B * Hkv * C, bs] fp32: the bias rows of the slots' blocks
    slot_of: Tensor | None = None  # [B, Hkv, NB + 1] slot of a block or -1 (column NB: write sink)
    slot_block: Tensor | None = None  # [B, Hkv, C + 1] block held by a slot or NB (column C: write sink)

    @property
    def offloaded(self) -> bool:
        return self.cpu_k is not None

    @property
    def num_blocks(self) -> int:
        """Blocks of capacity per (sequence, KV head): ``NB``."""
        return self.slot_of.shape[-1] - 1 if self.offloaded else self.k.shape[2]

    @property
    def num_slots(self) -> int:
        """GPU block slots per (sequence, KV head) of an offloaded layer: ``C``."""
        return self.slot_block.shape[-1] - 1

    # ------------------------------------------------------------------ allocation and growth
    def allocate(self, lay: Layout) -> None:
        """Zeroed tensors for ``lay`` (the bias follows in :meth:`set_bias_mode`)."""
        s, cap, dev, B = self.spec, lay.capacity, lay.device, lay.batch
        NB, bs, Hkv, D = cap // lay.block_size, lay.block_size, s.num_kv_heads, s.head_dim
        f32 = lay.state_dtype
        if s.cfg is None or not lay.offload:
            self.k = torch.zeros(B, Hkv, NB, bs, D, dtype=lay.dtype, device=dev)
            self.v = torch.zeros_like(self.k)
        else:
            C = lay.slots
            self.cpu_k = pin(torch.zeros(B * Hkv * NB, bs, D, dtype=lay.dtype))
            self.cpu_v = pin(torch.zeros(B * Hkv * NB, bs, D, dtype=lay.dtype))
            self.gpu_k = torch.zeros(B * Hkv * C, bs, D, dtype=lay.dtype, device=dev)
            self.gpu_v = torch.zeros_like(self.gpu_k)
            self.slot_of = torch.full((B, Hkv, NB + 1), -1, dtype=torch.long, device=dev)
            self.slot_block = torch.full((B, Hkv, C + 1), NB, dtype=torch.long, device=dev)
        if s.cfg is None:
            return
        NW = s.cfg.num_windows(cap)
        self.kc = torch.zeros(B, Hkv, NW + 1, D, dtype=lay.dtype, device=dev)  # fp32: 20% of an offloaded cache
        self.ring_k = torch.zeros(B, Hkv, s.cfg.kernel_size, D, dtype=lay.dtype, device=dev)
        if s.has_score:
            if self.offloaded:  # per-token scores / bias live with their blocks: host store, slot rows
                self.score = pin(torch.zeros(B, Hkv, cap, dtype=f32))
                self.gpu_b = torch.zeros(B * Hkv * C, bs, dtype=f32, device=dev)
            else:
                self.score = torch.zeros(B, Hkv, cap, dtype=f32, device=dev)
            self.wsc = torch.zeros(B, Hkv, NW + 1, dtype=f32, device=dev)
            self.ring_s = torch.zeros(B, Hkv, s.cfg.kernel_size, dtype=f32, device=dev)

    def set_bias_mode(self, mode: str) -> None:
        """The head's bias, seen at the first call: ``score`` (the score itself, ED-DMA), ``own`` (stored
        apart, where the score lives) or ``none`` (the slots then hold no bias rows)."""
        self.bias_mode = mode
        if mode == "own":
            self.bias = self.zeros_like_score()
        elif mode == "score":
            self.bias = self.score
        else:
            self.gpu_b = None

    def zeros_like_score(self) -> Tensor:
        """A zero tensor where the layer keeps its per-token scores (pinned host memory when offloaded)."""
        z = torch.zeros_like(self.score)
        return pin(z) if self.offloaded else z

    def grow(self, lay: Layout, old_capacity: int) -> None:
        """Reallocate for ``lay.capacity`` tokens per sequence, keeping the first ``old_capacity``."""
        old = dataclasses.replace(self)
        B, bs = lay.batch, lay.block_size
        oNB, NB = old_capacity // bs, lay.capacity // bs
        self.allocate(lay)
        if old.k is not None:
            self.k[:, :, :oNB] = old.k
            self.v[:, :, :oNB] = old.v
        if old.cpu_k is not None:
            Hkv = self.spec.num_kv_heads
            self.cpu_k.view(B, Hkv, NB, *old.cpu_k.shape[1:])[:, :, :oNB] = old.cpu_k.view(
                B, Hkv, oNB, *old.cpu_k.shape[1:])
            self.cpu_v.view(B, Hkv, NB, *old.cpu_v.shape[1:])[:, :, :oNB] = old.cpu_v.view(
                B, Hkv, oNB, *old.cpu_v.shape[1:])
            self.gpu_k, self.gpu_v, self.gpu_b = old.gpu_k, old.gpu_v, old.gpu_b
            self.slot_of[..., :oNB] = old.slot_of[..., :oNB]
            self.slot_block = torch.where(old.slot_block == oNB, NB, old.slot_block)
        if self.spec.cfg is None:
            return
        oNW = old.kc.shape[2] - 1
        self.kc[:, :, :oNW] = old.kc[:, :, :oNW]
        self.ring_k.copy_(old.ring_k)
        if old.score is not None:
            self.score[..., :old_capacity] = old.score
            self.wsc[..., :oNW] = old.wsc[..., :oNW]
            self.ring_s.copy_(old.ring_s)
        if old.bias_mode == "score":
            self.bias = self.score
        elif old.bias_mode == "own":
            self.bias = self.zeros_like_score()
            self.bias[..., :old_capacity] = old.bias

    # ------------------------------------------------------------------ sequences
    def select(self, idx: Tensor, cpu_idx: Tensor, batch: int) -> None:
        """Keep / reorder / repeat sequences: ``idx [B']`` into the current ``batch`` (``cpu_idx``: on the host)."""
        for name in PER_SEQUENCE:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, rows_of(t, idx, cpu_idx))
        self.bias = self.score if self.bias_mode == "score" else (
            None if self.bias is None else rows_of(self.bias, idx, cpu_idx))
        for name in PER_ROW:
            t = getattr(self, name)
            if t is not None:
                per_seq = t.view(batch, t.shape[0] // batch, *t.shape[1:])
                setattr(self, name, rows_of(per_seq, idx, cpu_idx).view(-1, *t.shape[1:]))

    def rows(self, a: int, b: int, batch: int) -> "LayerState":
        """This layer restricted to sequences ``a .. b - 1`` of ``batch`` (views of the same storage)."""
        out = dataclasses.replace(self)
        for name in PER_SEQUENCE:
            t = getattr(self, name)
            if t is not None:
                setattr(out, name, t[a:b])
        out.bias = out.score if self.bias is not None and self.bias is self.score else (
            None if self.bias is None else self.bias[a:b])
        for name in PER_ROW:
            t = getattr(self, name)
            if t is not None:
                per = t.shape[0] // batch
                setattr(out, name, t[a * per:b * per])
        return out

    # ------------------------------------------------------------------ tokens
    def read(self, b: int, n: int, batch: int, device) -> tuple[Tensor, Tensor]:
        """First ``n`` cached keys / values of sequence ``b`` as ``[n, Hkv, D]`` on ``device``."""
        Hkv, D = self.spec.num_kv_heads, self.spec.head_dim
        if self.k is not None:
            k, v = self.k[b].view(Hkv, -1, D), self.v[b].view(Hkv, -1, D)
        else:
            k = self.cpu_k.view(batch, Hkv, -1, D)[b].to(device)
            v = self.cpu_v.view(batch, Hkv, -1, D)[b].to(device)
        return k[:, :n].transpose(0, 1), v[:, :n].transpose(0, 1)

    def write(self, b: int, n0: int, k: Tensor, v: Tensor, batch: int) -> None:
        """Keys / values ``[m, Hkv, D]`` of sequence ``b`` at tokens ``n0 .. n0 + m - 1``."""
        Hkv, D, m = self.spec.num_kv_heads, self.spec.head_dim, k.shape[0]
        if self.k is not None:
            self.k[b].view(Hkv, -1, D)[:, n0:n0 + m] = k.transpose(0, 1)
            self.v[b].view(Hkv, -1, D)[:, n0:n0 + m] = v.transpose(0, 1)
            return
        self.cpu_k.view(batch, Hkv, -1, D)[b, :, n0:n0 + m] = k.transpose(0, 1).cpu()
        self.cpu_v.view(batch, Hkv, -1, D)[b, :, n0:n0 + m] = v.transpose(0, 1).cpu()
        self.slot_of[b] = -1  # resident copies of this sequence may be stale: fetch again
        self.slot_block[b] = self.slot_of.shape[-1] - 1

    def rebuild_selection_state(self, b: int, k: Tensor, score: Tensor | None, state_dtype: torch.dtype) -> None:
        """Compressed keys, window score means and the key/score ring of sequence ``b`` from its whole
        context ``k [n, Hkv, D]``, ``score [1, n, Hkv]``."""
        cfg, n = self.spec.cfg, k.shape[0]
        nw = cfg.num_windows(n)
        if nw:
            self.kc[b, :, :nw] = compressed_keys(k[None].to(state_dtype), cfg)[0].transpose(0, 1)
            if score is not None:
                self.wsc[b, :, :nw] = window_scores(score.to(self.wsc.dtype), cfg)[0]
        p = torch.arange(max(0, n - cfg.kernel_size), n, device=k.device)
        self.ring_k[b][:, p % cfg.kernel_size] = k[p].transpose(0, 1).to(self.ring_k.dtype)
        if score is not None:
            self.ring_s[b][:, p % cfg.kernel_size] = score[0, p].T

    def host_bias_rows(self) -> Tensor:
        """Offloaded layer: its bias in the host store as rows ``[B * Hkv * NB, bs]`` (the rows of ``cpu_k``)."""
        return self.bias.view(-1, self.cpu_k.shape[1])
