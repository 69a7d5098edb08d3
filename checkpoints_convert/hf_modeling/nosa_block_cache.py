"""Block-organised KV cache of the exported NOSA model: batched decode steps, optionally offloaded.

Shipped next to ``modeling_nosa.py`` in every sparse export (runs on PyTorch alone; with Triton on a
GPU the decode attention and the offload transfers are kernels: ``nosa_decode_attn.py``, ``nosa_uva.py``).

Layout per layer (``B`` sequences, ``Hkv`` KV heads, ``NB`` blocks of ``bs`` tokens, capacity
``cap = NB * bs`` tokens per sequence; sequences are stored compactly, padding never enters):

* keys / values ``[B, Hkv, NB, bs, D]`` (cache dtype) on the GPU, or, with ``offload=True``, in
  pinned CPU memory plus a GPU cache of ``C`` block slots per (sequence, KV head) that holds the
  blocks the current step selected;
* eviction score / bias ``[B, Hkv, cap]`` (fp32), by token: on the GPU, or, offloaded, in the pinned
  host store with their blocks, the slots holding the bias rows ``[bs]`` of their blocks (the bias
  travels with its keys and values);
* the selection's running state, on the GPU in both modes: compressed keys ``kc [B, Hkv, NW + 1, D]``
  (1/``kernel_stride`` of the keys; cache dtype: window means taken in fp32 and rounded once, as the
  training kernels store them, so a bf16 cache can select differently from the fp32 reference decode
  path where two block scores are within that rounding), window means of the score
  ``wsc [B, Hkv, NW + 1]`` (fp32; the last column is a write sink) and a ring of the last
  ``kernel_size`` keys and scores.

A decode step (one token per sequence) is a fixed number of batched tensor operations per layer,
independent of the context length and with no host synchronisation in the GPU-resident mode: the
new key/value/score are written at each sequence's own length, a window that the token completes is
added to ``kc``/``wsc``, the selection of the reference (``nosa_selection.select_rows`` for one row)
is recomputed from ``kc``/``wsc`` for all sequences at once, and the token attends to the selected
blocks (that math: ``nosa_decode_select.py``; read in place by ``nosa_decode_attn.py`` or gathered;
the step's CUDA graph: ``nosa_decode_graph.py``).
The offloaded mode adds one host synchronisation per layer: the blocks the step selects that are not
resident are copied host -> device (one gathered, non-blocking copy), and the new token is copied
device -> host.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .nosa_config import NOSAConfig
from .nosa_decode_attn import available as attn_kernel_available
from .nosa_decode_attn import decode_attention
from .nosa_decode_attn import supported as attn_kernel_supported
from .nosa_decode_select import attend, decode_masks, select_decode_batched
from .nosa_selection import block_window_index, compressed_keys, window_scores
from .nosa_uva import available as uva_available
from .nosa_uva import fetch_rows as uva_fetch_rows
from .nosa_uva import store_tokens as uva_store_tokens
from .nosa_uva import store_values as uva_store_values

if TYPE_CHECKING:  # the graph module imports this one
    from .nosa_decode_graph import DecodeGraph

CAPACITY_MARGIN = 1024  # tokens allocated past the prompt before the cache grows (doubling)
# batch parts of an offloaded decode step by default: their host fetches take turns with the other
# parts' compute (1B shape, 16K, H200: 1.16-1.26x the tokens/s of one part; docs/BENCHMARKS.md)
OFFLOAD_DECODE_STREAMS = 4


@dataclass
class LayerSpec:
    """What one layer stores: ``cfg`` (None: dense layer), KV heads, head dim, eviction score or not."""

    cfg: NOSAConfig | None
    num_kv_heads: int
    head_dim: int
    has_score: bool


@dataclass
class LayerState:
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


# LayerState tensors by their first axis: one entry per sequence (``bias`` follows ``score`` or is its
# own), or ``rows per sequence`` entries per sequence (host store and slots: ``[B * rows, ...]``)
PER_SEQUENCE = ("k", "v", "score", "kc", "wsc", "ring_k", "ring_s", "slot_of", "slot_block")
PER_ROW = ("cpu_k", "cpu_v", "gpu_k", "gpu_v", "gpu_b")


_STREAMS: dict = {}  # (device index, purpose, thread) -> [torch.cuda.Stream], see shared_streams


def shared_streams(device, purpose: str, n: int) -> list:
    """``n`` CUDA streams of ``device`` for ``purpose`` ("graph": decode-graph capture, "part": batch
    parts of a step), shared by every cache of this thread. A stream that has run a matmul keeps a
    cuBLAS workspace (32 MiB on Hopper) for the rest of the process, so streams made per cache
    would each add one, up to the size of PyTorch's stream pool (32 streams, about 1 GiB)."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    pool = _STREAMS.setdefault((index, purpose, threading.get_ident()), [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device=index))
    return pool[:n]


@dataclass
class TransferStats:
    """Bytes moved by the offloaded cache (all layers) and how many decode steps moved them."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    fetched_blocks: int = 0  # host-copy path (exact, host int)
    fetched_dev: Tensor | None = None  # direct-access path: device counter (read with fetched_blocks())
    decode_steps: int = 0
    per_step_h2d: list = field(default_factory=list)


def _pin(t: Tensor) -> Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


def _select_rows(t: Tensor, idx: Tensor, cpu_idx: Tensor) -> Tensor:
    """``t.index_select(0, ...)`` on the tensor's own side: device tensors with ``idx``, host-store tensors
    (pinned, CPU) with ``cpu_idx`` straight into new pinned memory (no second copy)."""
    if t.device == idx.device:
        return t.index_select(0, idx)
    out = torch.empty(int(cpu_idx.numel()), *t.shape[1:], dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return torch.index_select(t, 0, cpu_idx, out=out)


class NOSABlockCache(Cache):
    """KV cache of ``NOSALlamaForCausalLM``: made by the model (``model.new_cache(...)``, or on the
    first forward with ``use_cache``) and passed back by ``generate``.

    ``reserve`` tokens per sequence are allocated up front (default: the prompt plus 1024; the
    cache doubles when full). ``offload=True`` keeps every block of the NOSA layers in pinned CPU
    memory and ``gpu_blocks`` (default: the selection budget ``topk``) block slots per (sequence,
    KV head) on the GPU (the per-token scores / bias go with the blocks: host store, and the bias rows
    of the slots' blocks); dense layers and the selection state stay on the GPU. With fewer
    slots than ``topk``, the selected blocks that find no free slot are read from the host store
    every step (more host-to-device traffic for a smaller device footprint). ``attention``: how a
    decode step's token attends to its selected blocks, ``triton`` = the kernel of
    ``nosa_decode_attn.py`` reading them in place (cache, slots, or the pinned host store for blocks
    without a slot), ``torch`` = gathered copies and ``attend``, ``auto`` = ``triton`` on a CUDA
    device when Triton is installed. ``decode_streams`` > 1 splits a decode step's batch into that
    many contiguous parts that run layer by layer on their own CUDA streams, so one part's
    host-to-device fetch can overlap another part's compute (:meth:`decode_parts`; results equal the
    unsplit step up to GEMM rounding; default ``OFFLOAD_DECODE_STREAMS`` = 4 for an offloaded cache,
    1 otherwise: a GPU-resident step has nothing to fetch and runs faster whole).
    ``get_seq_length()`` is the number of attention-mask columns seen (padding included), as for
    transformers' own caches.
    """

    is_compileable = False

    def __init__(self, specs: list[LayerSpec], offload: bool = False, gpu_blocks: int | None = None,
                 reserve: int | None = None, fetch: str = "auto", attention: str = "auto",
                 decode_streams: int | None = None) -> None:
        super().__init__(layers=[])
        self.specs = specs
        self.offload = offload
        nosa = [s.cfg for s in specs if s.cfg is not None]
        self.block_size = nosa[0].block_size if nosa else 64
        if any(c.block_size != self.block_size for c in nosa):
            raise ValueError("all NOSA layers of one model must share block_size")
        self.gpu_blocks = gpu_blocks if gpu_blocks is not None else max((c.topk for c in nosa), default=0)
        if offload and nosa and self.gpu_blocks < 1:
            raise ValueError(f"gpu_blocks must be >= 1, got {self.gpu_blocks}")
        self.states: list[LayerState] = [LayerState(s) for s in specs]
        if fetch not in ("auto", "uva", "copy"):
            raise ValueError(f"fetch must be auto, uva or copy, got {fetch!r}")
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be auto, triton or torch, got {attention!r}")
        if attention == "triton" and not attn_kernel_available():
            raise ValueError("attention='triton' needs triton installed")
        self.attention = attention  # decode attention over the selected blocks: Triton kernel or torch
        if decode_streams is None:
            decode_streams = OFFLOAD_DECODE_STREAMS if offload else 1
        if decode_streams < 1:
            raise ValueError(f"decode_streams must be >= 1, got {decode_streams}")
        self.decode_streams = decode_streams
        self.part_range: tuple[int, int] | None = None  # a view of decode_parts(): its sequences here
        self.fetch_programs: int | None = None  # grid of the direct-access fetch (None: one program per row)
        self.part_fetch_programs_per_sm = 2  # grid of a batch part's fetch, per SM (a tuning knob)
        self._fetch_chain: list | None = None  # parts of a step: [event of the last host fetch issued]
        self.fetch = fetch  # offload transfers: "uva" kernels on pinned memory, or "copy" through the host
        self.reserve = reserve  # tokens per sequence to allocate up front (default: prompt + CAPACITY_MARGIN)
        self.batch = 0
        self.capacity = 0  # tokens per sequence
        self.seen = 0  # attention-mask columns consumed
        self.lens: Tensor | None = None  # [B] tokens stored per sequence (device)
        self.device = None
        self.dtype = None
        self.state_dtype = torch.float32  # scores, compressed keys, softmax: at least fp32
        self.stats = TransferStats()
        # per-call state set by begin()
        self.decoding = False
        self.pos: Tensor | None = None  # [B] position of the new token (decode)
        self.valid_new: Tensor | None = None  # [B, T] bool
        self.rows: list = []  # per sequence: index of its valid new tokens (extend)
        self.start: list = []  # per sequence: tokens stored before this call (extend)
        self._index_cache: dict = {}
        self._derived: dict = {}
        self._step_h2d = 0
        self.version = 0  # changes whenever buffers are reallocated (captured decode graphs depend on them)
        self.graph: DecodeGraph | None = None

    # ------------------------------------------------------------------ transformers Cache API
    def __len__(self) -> int:
        return len(self.specs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int | None:
        return None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("NOSABlockCache does not support crop (assisted decoding); use a DynamicCache")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.lens is None:
            return
        self.batch_select_indices(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep / reorder / repeat sequences: ``indices [B']`` into the current batch."""
        if self.lens is None:
            return
        idx = indices.to(self.device).long()
        cpu_idx = idx.cpu()
        for st in self.states:
            for name in PER_SEQUENCE:
                t = getattr(st, name)
                if t is not None:
                    setattr(st, name, _select_rows(t, idx, cpu_idx))
            st.bias = st.score if st.bias_mode == "score" else (
                None if st.bias is None else _select_rows(st.bias, idx, cpu_idx))
            for name in PER_ROW:
                t = getattr(st, name)
                if t is not None:
                    per_seq = t.view(self.batch, t.shape[0] // self.batch, *t.shape[1:])
                    setattr(st, name, _select_rows(per_seq, idx, cpu_idx).view(-1, *t.shape[1:]))
        self.lens = self.lens.index_select(0, idx)
        self.batch = int(idx.numel())
        self.version += 1

    # ------------------------------------------------------------------ batch parts of a decode step
    def decode_parts(self) -> list["NOSABlockCache"]:
        """This decode step as ``decode_streams`` views over contiguous ranges of the batch (empty when
        not split: one stream, fewer sequences, not decoding, or offloaded with host copies, whose
        synchronisations would serialise the parts). A view shares every buffer with this cache
        (writes land here) and has its own positions, per-step values and transfer counters; its
        ``part_range`` is its sequences' range. Hand the views back to :meth:`gather_parts`."""
        B, n = self.batch, min(self.decode_streams, self.batch)
        if n < 2 or not self.decoding or (self.offload and self.fetch != "uva"):
            return []
        # a part's fetch takes a few programs per SM (``part_fetch_programs_per_sm``) and leaves the SMs'
        # other slots to the other parts' compute (CPU, interpreter: 3 programs, which exercises their
        # loop over rows)
        dev = torch.device(self.device)
        grid = (self.part_fetch_programs_per_sm * torch.cuda.get_device_properties(dev).multi_processor_count
                if dev.type == "cuda" else 3)
        chain = [None]  # the parts' host fetches run one after another, in issue order (see _copy_rows)
        return [self._view(i * B // n, (i + 1) * B // n, grid, chain) for i in range(n)]

    def gather_parts(self, parts: list["NOSABlockCache"]) -> None:
        """Add the parts' transfer counters to this cache's."""
        for p in parts:
            self.stats.fetched_dev += p.stats.fetched_dev
            self.stats.h2d_bytes += p.stats.h2d_bytes
            self.stats.d2h_bytes += p.stats.d2h_bytes
            self.stats.fetched_blocks += p.stats.fetched_blocks
            self._step_h2d += p._step_h2d

    def part_streams(self, n: int) -> list:
        """``n`` CUDA streams for the parts of a decode step (shared with the thread's other caches)."""
        return shared_streams(self.device, "part", n)

    def _view(self, a: int, b: int, fetch_programs: int, fetch_chain: list) -> "NOSABlockCache":
        view = copy.copy(self)
        view.batch, view.part_range, view.graph = b - a, (a, b), None
        view.fetch_programs, view._fetch_chain = fetch_programs, fetch_chain
        view.lens, view.pos, view.valid_new = self.lens[a:b], self.pos[a:b], self.valid_new[a:b]
        view._derived, view._step_h2d = {}, 0
        view.stats = TransferStats(fetched_dev=torch.zeros((), dtype=torch.long, device=self.lens.device))
        view.states = [self._state_rows(st, a, b) for st in self.states]
        return view

    def _state_rows(self, st: LayerState, a: int, b: int) -> LayerState:
        """``st`` restricted to sequences ``a .. b - 1`` (views of the same storage)."""
        out = dataclasses.replace(st)
        for name in PER_SEQUENCE:
            t = getattr(st, name)
            if t is not None:
                setattr(out, name, t[a:b])
        out.bias = out.score if st.bias is not None and st.bias is st.score else (
            None if st.bias is None else st.bias[a:b])
        for name in PER_ROW:
            t = getattr(st, name)
            if t is not None:
                per = t.shape[0] // self.batch
                setattr(out, name, t[a * per:b * per])
        return out

    # ------------------------------------------------------------------ allocation
    def _num_windows(self, cfg: NOSAConfig) -> int:
        return cfg.num_windows(self.capacity)

    def _allocate(self, st: LayerState, B: int) -> None:
        s, cap, dev = st.spec, self.capacity, self.device
        NB, bs, Hkv, D = cap // self.block_size, self.block_size, s.num_kv_heads, s.head_dim
        f32 = self.state_dtype
        if s.cfg is None or not self.offload:
            st.k = torch.zeros(B, Hkv, NB, bs, D, dtype=self.dtype, device=dev)
            st.v = torch.zeros_like(st.k)
        else:
            C = self.gpu_blocks
            st.cpu_k = _pin(torch.zeros(B * Hkv * NB, bs, D, dtype=self.dtype))
            st.cpu_v = _pin(torch.zeros(B * Hkv * NB, bs, D, dtype=self.dtype))
            st.gpu_k = torch.zeros(B * Hkv * C, bs, D, dtype=self.dtype, device=dev)
            st.gpu_v = torch.zeros_like(st.gpu_k)
            st.slot_of = torch.full((B, Hkv, NB + 1), -1, dtype=torch.long, device=dev)
            st.slot_block = torch.full((B, Hkv, C + 1), NB, dtype=torch.long, device=dev)
        if s.cfg is None:
            return
        NW = self._num_windows(s.cfg)
        st.kc = torch.zeros(B, Hkv, NW + 1, D, dtype=self.dtype, device=dev)  # fp32 would be 20% of an offloaded cache
        st.ring_k = torch.zeros(B, Hkv, s.cfg.kernel_size, D, dtype=self.dtype, device=dev)
        if s.has_score:
            if st.offloaded:  # per-token scores / bias live with their blocks: host store, slot rows
                st.score = _pin(torch.zeros(B, Hkv, cap, dtype=f32))
                st.gpu_b = torch.zeros(B * Hkv * self.gpu_blocks, self.block_size, dtype=f32, device=dev)
            else:
                st.score = torch.zeros(B, Hkv, cap, dtype=f32, device=dev)
            st.wsc = torch.zeros(B, Hkv, NW + 1, dtype=f32, device=dev)
            st.ring_s = torch.zeros(B, Hkv, s.cfg.kernel_size, dtype=f32, device=dev)

    def _setup(self, B: int, need: int, device, dtype) -> None:
        self.batch, self.device, self.dtype = B, device, dtype
        if self.fetch == "auto":
            self.fetch = "uva" if torch.device(device).type == "cuda" and uva_available() else "copy"
        on_gpu = torch.device(device).type == "cuda"
        if self.attention == "auto":
            self.attention = "triton" if on_gpu and attn_kernel_available() else "torch"
        elif self.attention == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention='triton' needs a CUDA device (or TRITON_INTERPRET=1 on a CPU, slow); "
                             "use attention='torch' or 'auto'")
        self.stats.fetched_dev = torch.zeros((), dtype=torch.long, device=device)
        self.state_dtype = torch.promote_types(dtype, torch.float32)
        self.capacity = self._round(max(need, self.reserve) if self.reserve else need + CAPACITY_MARGIN)
        self.lens = torch.zeros(B, dtype=torch.long, device=device)
        self.version += 1
        for st in self.states:
            self._allocate(st, B)

    def _round(self, tokens: int) -> int:
        step = self.block_size * 16  # keeps NW integral for any kernel_stride dividing block_size
        return max(step, math.ceil(tokens / step) * step)

    def _grow(self, need: int) -> None:
        """Reallocate every layer for at least ``need`` tokens per sequence (rare: doubling)."""
        old_cap = self.capacity
        self.capacity = self._round(max(need, 2 * old_cap))
        B, oNB, NB = self.batch, old_cap // self.block_size, self.capacity // self.block_size
        for st in self.states:
            old = dataclasses.replace(st)
            mode = st.bias_mode
            self._allocate(st, B)
            st.bias_mode = mode
            if old.k is not None:
                st.k[:, :, :oNB] = old.k
                st.v[:, :, :oNB] = old.v
            if old.cpu_k is not None:
                Hkv = st.spec.num_kv_heads
                st.cpu_k.view(B, Hkv, NB, *old.cpu_k.shape[1:])[:, :, :oNB] = old.cpu_k.view(
                    B, Hkv, oNB, *old.cpu_k.shape[1:])
                st.cpu_v.view(B, Hkv, NB, *old.cpu_v.shape[1:])[:, :, :oNB] = old.cpu_v.view(
                    B, Hkv, oNB, *old.cpu_v.shape[1:])
                st.gpu_k, st.gpu_v, st.gpu_b = old.gpu_k, old.gpu_v, old.gpu_b
                st.slot_of[..., :oNB] = old.slot_of[..., :oNB]
                st.slot_block = torch.where(old.slot_block == oNB, NB, old.slot_block)
            if st.spec.cfg is None:
                continue
            oNW = old.kc.shape[2] - 1
            st.kc[:, :, :oNW] = old.kc[:, :, :oNW]
            st.ring_k.copy_(old.ring_k)
            if old.score is not None:
                st.score[..., :old_cap] = old.score
                st.wsc[..., :oNW] = old.wsc[..., :oNW]
                st.ring_s.copy_(old.ring_s)
            if mode == "score":
                st.bias = st.score
            elif mode == "own":
                st.bias = self._zeros_like_score(st)
                st.bias[..., :old_cap] = old.bias
        self._index_cache.clear()
        self.version += 1

    # ------------------------------------------------------------------ per forward call
    def begin(self, valid: Tensor, T: int, device, dtype) -> None:
        """Start a forward of ``T`` new columns; ``valid [B, seen + T]`` bool (1 = token)."""
        B = valid.shape[0]
        if self.lens is not None and self.seen == 0 and B != self.batch:
            self.lens = None  # an empty cache may be reused with another batch size
        if self.lens is None:
            self._setup(B, T, device, dtype)
        elif B != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {B} with the same cache")
        self.valid_new = valid[:, valid.shape[1] - T:]  # ``valid`` may hold only the new columns
        self.decoding = T == 1 and self.seen > 0
        if self.decoding:
            if self.seen + 1 > self.capacity:
                self._grow(self.seen + 1)
            self.set_pos(self.lens.clone())
            self._step_h2d = 0
            return
        lens = self.lens.tolist()
        self.rows = [self.valid_new[b].nonzero().squeeze(-1) for b in range(B)]
        counts = [int(r.numel()) for r in self.rows]
        self.start = lens
        need = max(a + c for a, c in zip(lens, counts))
        if need > self.capacity:
            self._grow(need)

    def end(self, lens_advanced: bool = False) -> None:
        """Finish the forward: advance the lengths (unless a captured decode step did)."""
        if self.decoding:
            if not lens_advanced:
                self.lens += self.valid_new[:, 0].long()
            self.stats.decode_steps += 1
            self.stats.per_step_h2d.append(self._step_h2d)
        else:
            self.lens += torch.tensor([int(r.numel()) for r in self.rows], device=self.device)
        self.seen += self.valid_new.shape[1]

    # ------------------------------------------------------------------ multi-token calls (prefill)
    def extend(self, layer: int, k: Tensor, v: Tensor, score: Tensor | None, bias: Tensor | None) -> list:
        """Append the valid new tokens of every sequence (``k, v [B, T, Hkv, D]`` post-RoPE keys and
        values, ``score``/``bias [B, T, Hkv]``) and return, per sequence, its whole cached context
        ``(rows, k [1, n, Hkv, D], v, score [1, n, Hkv] | None, bias | None)`` for the attention."""
        st = self.states[layer]
        if st.bias_mode == "unset":
            st.bias_mode = "none" if bias is None else ("score" if bias is score else "own")
            if st.bias_mode == "own":
                st.bias = self._zeros_like_score(st)
            elif st.bias_mode == "score":
                st.bias = st.score
            else:
                st.gpu_b = None
        out = []
        for b, rows in enumerate(self.rows):
            n0, m = self.start[b], int(rows.numel())
            kb, vb = k[b, rows].to(self.dtype), v[b, rows].to(self.dtype)  # [m, Hkv, D]
            if n0:
                kp, vp = self._read(st, b, n0)
                kb, vb = torch.cat([kp, kb]), torch.cat([vp, vb])
            self._write_tokens(st, b, n0, kb[n0:].detach(), vb[n0:].detach())
            sb = bb = None
            if st.score is not None:  # cached prefix + the new tokens' own (differentiable) scores
                new_s = score[b, rows].to(st.score.dtype)
                sb = torch.cat([st.score[b, :, :n0].T.to(new_s.device), new_s])[None]
                st.score[b, :, n0:n0 + m] = new_s.detach().T.to(st.score.device)
                if st.bias_mode == "score":
                    bb = sb
                elif st.bias_mode == "own":
                    new_b = bias[b, rows].to(st.bias.dtype)
                    bb = torch.cat([st.bias[b, :, :n0].T.to(new_b.device), new_b])[None]
                    st.bias[b, :, n0:n0 + m] = new_b.detach().T.to(st.bias.device)
            if st.spec.cfg is not None:
                self._rebuild_selection_state(st, b, kb.detach(), None if sb is None else sb.detach())
            out.append((rows, kb[None], vb[None], sb, bb))
        return out

    def _read(self, st: LayerState, b: int, n: int) -> tuple[Tensor, Tensor]:
        """First ``n`` cached keys / values of sequence ``b`` as ``[n, Hkv, D]``."""
        Hkv, D = st.spec.num_kv_heads, st.spec.head_dim
        if st.k is not None:
            k, v = st.k[b].view(Hkv, -1, D), st.v[b].view(Hkv, -1, D)
        else:
            k = st.cpu_k.view(self.batch, Hkv, -1, D)[b].to(self.device)
            v = st.cpu_v.view(self.batch, Hkv, -1, D)[b].to(self.device)
        return k[:, :n].transpose(0, 1), v[:, :n].transpose(0, 1)

    def _write_tokens(self, st: LayerState, b: int, n0: int, k: Tensor, v: Tensor) -> None:
        Hkv, D, m = st.spec.num_kv_heads, st.spec.head_dim, k.shape[0]
        if st.k is not None:
            st.k[b].view(Hkv, -1, D)[:, n0:n0 + m] = k.transpose(0, 1)
            st.v[b].view(Hkv, -1, D)[:, n0:n0 + m] = v.transpose(0, 1)
            return
        st.cpu_k.view(self.batch, Hkv, -1, D)[b, :, n0:n0 + m] = k.transpose(0, 1).cpu()
        st.cpu_v.view(self.batch, Hkv, -1, D)[b, :, n0:n0 + m] = v.transpose(0, 1).cpu()
        st.slot_of[b] = -1  # resident copies of this sequence may be stale: fetch again
        st.slot_block[b] = st.slot_of.shape[-1] - 1

    def _rebuild_selection_state(self, st: LayerState, b: int, k: Tensor, score: Tensor | None) -> None:
        """Compressed keys, window score means and the key/score ring of sequence ``b`` from its
        whole context ``k [n, Hkv, D]``, ``score [1, n, Hkv]``."""
        cfg, n = st.spec.cfg, k.shape[0]
        nw = cfg.num_windows(n)
        if nw:
            st.kc[b, :, :nw] = compressed_keys(k[None].to(self.state_dtype), cfg)[0].transpose(0, 1)
            if score is not None:
                st.wsc[b, :, :nw] = window_scores(score.to(st.wsc.dtype), cfg)[0]
        p = torch.arange(max(0, n - cfg.kernel_size), n, device=k.device)
        st.ring_k[b][:, p % cfg.kernel_size] = k[p].transpose(0, 1).to(st.ring_k.dtype)
        if score is not None:
            st.ring_s[b][:, p % cfg.kernel_size] = score[0, p].T

    # ------------------------------------------------------------------ decode step
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, score: Tensor | None, bias: Tensor | None,
               softmax_scale: float | None = None, record: bool = False):
        """One token per sequence: ``q [B, 1, Hq, D]`` post-RoPE, ``k, v [B, 1, Hkv, D]``, ``score``/``bias``
        ``[B, 1, Hkv]``. Returns ``(out [B, 1, Hq, D], selection)``; ``selection`` (only with ``record``) is a
        list of bool ``[Hkv, 1, nb]`` per sequence, ``nb`` = its blocks."""
        st = self.states[layer]
        B, _, Hq, D = q.shape
        Hkv = st.spec.num_kv_heads
        G = Hq // Hkv
        scale = softmax_scale if softmax_scale is not None else D ** -0.5
        pos, bs = self.pos, self.block_size
        blk, off = self._per_step("blk_off", lambda: (pos // bs, pos % bs))
        bi, hi = self._batch_head(Hkv, q.device)
        k1, v1 = k[:, 0].to(self.dtype), v[:, 0].to(self.dtype)  # [B, Hkv, D]
        qg = q[:, 0].view(B, Hkv, G, D)
        if st.spec.cfg is None:  # dense layer: every cached token
            self._store_token(st, k1, v1, blk, off)
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
        self._update_windows(st, cfg, k1, s1)
        NW = st.kc.shape[2] - 1
        index = self._pool_index(cfg, st.slot_of.shape[-1] - 1 if st.offloaded else st.k.shape[2], NW, q.device)
        masks = self._per_step(("masks", id(cfg), index.shape[0], NW),
                               lambda: decode_masks(pos, cfg, index.shape[0], NW))
        sel, sel_ok = select_decode_batched(qg, st.kc[:, :, :NW], None if st.score is None else st.wsc[:, :, :NW],
                                            pos, cfg, index, scale, masks)
        tok = (k1, v1, s1, b1)
        if self._kernel_applies(st, qg, sel):
            out = self._attend_in_place(st, qg, sel, sel_ok, tok, blk, off, scale)
        else:
            out = self._attend_gathered(st, qg, sel, sel_ok, tok, blk, off, scale)
        out = out.reshape(B, 1, Hq, D).to(q.dtype)
        recorded = None
        if record:
            NB = index.shape[0]
            mask = torch.zeros(B, Hkv, NB + 1, dtype=torch.bool, device=q.device)
            mask.scatter_(-1, torch.where(sel_ok, sel, NB), True)
            recorded = [mask[b, :, None, :int(pos[b]) // bs + 1].cpu() for b in range(B)]
        return out, recorded

    def _kernel_applies(self, st: LayerState, q: Tensor, sel: Tensor) -> bool:
        """The Triton decode attention: chosen, a shape it takes, and every selected block readable by
        a kernel (resident, or a slot-less block in pinned host memory that kernels address: ``uva``)."""
        if self.attention != "triton" or not attn_kernel_supported(q, self.block_size):
            return False
        short = st.offloaded and st.slot_block.shape[-1] - 1 < sel.shape[-1]
        return not short or self.fetch == "uva" or q.device.type == "cpu"

    def _attend_in_place(self, st: LayerState, qg: Tensor, sel: Tensor, sel_ok: Tensor, tok: tuple, blk: Tensor,
                         off: Tensor, scale: float) -> Tensor:
        """Store the new token ``tok = (k1, v1, s1, b1)``, then attend over the selected blocks where they
        lie (no gathered copies)."""
        B, Hkv, K = sel.shape
        qg = qg.to(self.dtype)
        row = self._head_rows(Hkv, sel.device)
        has_bias = tok[3] is not None
        if st.offloaded:
            slots, src = self._make_resident(st, sel, sel_ok, tok, blk, off)
            C = st.slot_block.shape[-1] - 1
            rows = torch.where(slots >= 0, row * C + slots, -1)
            host = {}
            if C < K:  # the kernel reads the slot-less blocks from the host store: count them as moved
                host = {"host_k": st.cpu_k, "host_v": st.cpu_v, "host_rows": src,
                        "host_bias": self._host_bias_rows(st) if has_bias else None}
                self.stats.fetched_dev += (sel_ok & (slots < 0)).sum()
            return decode_attention(qg, st.gpu_k, st.gpu_v, rows, sel, sel_ok, self.pos, scale,
                                    st.gpu_b if has_bias else None, **host)
        self._store_token(st, tok[0], tok[1], blk, off)
        NB = st.k.shape[2]
        pool_k, pool_v = st.k.view(B * Hkv * NB, *st.k.shape[3:]), st.v.view(B * Hkv * NB, *st.v.shape[3:])
        pool_b = st.bias.view(B * Hkv * NB, self.block_size) if has_bias else None
        return decode_attention(qg, pool_k, pool_v, row * NB + sel, sel, sel_ok, self.pos, scale, pool_b)

    def _store_token(self, st: LayerState, k1: Tensor, v1: Tensor, blk: Tensor, off: Tensor) -> None:
        """GPU-resident mode: the new token's ``k1, v1 [B, Hkv, D]`` at block ``blk``, offset ``off`` ``[B]``."""
        bi, hi = self._batch_head(k1.shape[1], k1.device)
        st.k[bi, hi, blk[:, None], off[:, None]] = k1
        st.v[bi, hi, blk[:, None], off[:, None]] = v1

    def _attend_gathered(self, st: LayerState, qg: Tensor, sel: Tensor, sel_ok: Tensor, tok: tuple, blk: Tensor,
                         off: Tensor, scale: float) -> Tensor:
        """Store the new token ``tok = (k1, v1, s1, b1)``, gather the selected blocks into new tensors and
        ``attend`` (PyTorch)."""
        B, Hkv, K = sel.shape
        bs, D, pos = self.block_size, qg.shape[-1], self.pos
        bi, hi = self._batch_head(Hkv, sel.device)
        has_bias = tok[3] is not None
        bb = None
        if st.offloaded:
            kb, vb, bb = self._fetch(st, sel, sel_ok, tok, blk, off)
        else:
            self._store_token(st, tok[0], tok[1], blk, off)
            kb, vb = st.k[bi[..., None], hi[..., None], sel], st.v[bi[..., None], hi[..., None], sel]
            if has_bias:
                bb = st.bias.view(B, Hkv, -1, bs)[bi[..., None], hi[..., None], sel]
        kb, vb = kb.view(B, Hkv, K * bs, D), vb.view(B, Hkv, K * bs, D)
        tok_pos = (sel[..., None] * bs + torch.arange(bs, device=sel.device)).view(B, Hkv, K * bs)
        ok = sel_ok[..., None].expand(B, Hkv, K, bs).reshape(B, Hkv, K * bs) & (tok_pos <= pos[:, None, None])
        return attend(qg, kb, vb, bb.reshape(B, Hkv, K * bs) if has_bias else None, ok, scale)

    def _pool_index(self, cfg: NOSAConfig, NB: int, NW: int, device) -> Tensor:
        key = (id(cfg), NB, NW)
        if key not in self._index_cache:
            self._index_cache[key] = block_window_index(cfg, NB, NW, device=device)
        return self._index_cache[key]

    def set_pos(self, pos: Tensor) -> None:
        """Positions of this step's new tokens; forgets what was derived from the previous ones."""
        self.pos = pos
        self._derived: dict = {}

    def _batch_arange(self, device) -> Tensor:
        """``arange(B)``, made once per step."""
        return self._per_step("arange_b", lambda: torch.arange(self.batch, device=device))

    def _batch_head(self, Hkv: int, device) -> tuple[Tensor, Tensor]:
        """``arange(B)[:, None]`` and ``arange(Hkv)[None, :]``: the index grids of a step's tensors."""
        return self._per_step(("bi_hi", Hkv), lambda: (self._batch_arange(device)[:, None],
                                                       torch.arange(Hkv, device=device)[None, :]))

    def _head_rows(self, Hkv: int, device) -> Tensor:
        """``[B, Hkv, 1]`` row ``b * Hkv + h`` of each (sequence, KV head): with ``* NB + block`` (or
        ``* C + slot``) a row of the block pools, host store and slots."""
        return self._per_step(("rows", Hkv), lambda: torch.arange(self.batch * Hkv, device=device).view(-1, Hkv, 1))

    def _per_step(self, key, make):
        """``make()`` once per decode step (values that depend only on the positions, shared by layers)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def _window_targets(self, cfg: NOSAConfig, sink: int) -> tuple[Tensor, Tensor]:
        """Ring slot of the new token and the window it completes (``sink`` if none), ``[B]`` each."""
        n = self.pos + 1  # length after this token
        done = (n >= cfg.kernel_size) & ((n - cfg.kernel_size) % cfg.kernel_stride == 0)
        w = torch.where(done, torch.div(n - cfg.kernel_size, cfg.kernel_stride, rounding_mode="floor"), sink)
        return self.pos % cfg.kernel_size, w.clamp(max=sink)

    def _update_windows(self, st: LayerState, cfg: NOSAConfig, k1: Tensor, s1: Tensor | None) -> None:
        """Ring write of the new key / score; a completed window goes into ``kc`` / ``wsc``."""
        sink = st.kc.shape[2] - 1
        bi = self._batch_arange(k1.device)
        slot, w = self._per_step(("win", cfg.kernel_size, cfg.kernel_stride, sink),
                                 lambda: self._window_targets(cfg, sink))
        st.ring_k[bi, :, slot] = k1.to(st.ring_k.dtype)
        if s1 is not None:
            st.ring_s[bi, :, slot] = s1
        st.kc[bi, :, w] = st.ring_k.to(self.state_dtype).mean(dim=2).to(st.kc.dtype)
        if s1 is not None:
            st.wsc[bi, :, w] = st.ring_s.mean(dim=2)

    def _fetch(self, st: LayerState, sel: Tensor, sel_ok: Tensor, tok: tuple, blk: Tensor,
               off: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Offloaded mode, PyTorch attention: :meth:`_make_resident`, then the selected blocks gathered
        into ``[B, Hkv, K, bs, D]`` (and their bias rows ``[B, Hkv, K, bs]``, None without a bias);
        blocks without a slot (fewer slots ``C`` than selected blocks ``K``) are read from the host store
        straight into the gathered tensors."""
        B, Hkv, K = sel.shape
        C = st.slot_block.shape[-1] - 1
        slots, src = self._make_resident(st, sel, sel_ok, tok, blk, off)
        bi, hi = self._batch_head(Hkv, sel.device)
        at = (bi[..., None], hi[..., None], slots.clamp(min=0))
        kb = st.gpu_k.view(B, Hkv, C, *st.gpu_k.shape[1:])[at]
        vb = st.gpu_v.view(B, Hkv, C, *st.gpu_v.shape[1:])[at]
        bb = st.gpu_b.view(B, Hkv, C, -1)[at] if tok[3] is not None else None
        if C < K:  # selected blocks without a slot: from the host store into this step's copies
            row = self._head_rows(Hkv, sel.device)
            spill = torch.where(sel_ok & (slots < 0), (row * K + torch.arange(K, device=sel.device)), -1)
            self._copy_rows(st, src, spill, kb.view(-1, *kb.shape[3:]), vb.view(-1, *vb.shape[3:]),
                            None if bb is None else bb.view(-1, bb.shape[-1]))
        return kb, vb, bb

    def _make_resident(self, st: LayerState, sel: Tensor, sel_ok: Tensor, tok: tuple, blk: Tensor,
                       off: Tensor) -> tuple[Tensor, Tensor]:
        """Offloaded mode: bring the selected blocks (keys, values, bias rows) into GPU slots (moving only
        those not resident) and write the new token ``tok = (k1, v1, s1, b1)`` (GPU slot and host store).
        Returns ``(slots, src)`` ``[B, Hkv, K]``: the slot
        of each selected block (-1: none; with fewer slots ``C`` than selected blocks ``K``, the missing
        blocks beyond the free slots, in selection order) and its row in the host store."""
        B, Hkv, K = sel.shape
        NB = st.slot_of.shape[-1] - 1
        C = st.slot_block.shape[-1] - 1
        dev = sel.device
        k1, v1, _, b1 = tok
        bi, hi = self._batch_head(Hkv, dev)
        # slot bookkeeping on the device: the j-th missing block of a row takes its j-th free slot
        cur = st.slot_of.gather(-1, sel)
        missing = sel_ok & (cur < 0)
        in_sel = torch.zeros(B, Hkv, NB + 1, dtype=torch.bool, device=dev)
        in_sel.scatter_(-1, torch.where(sel_ok, sel, NB), True)
        in_sel[..., NB] = False
        keep = in_sel.gather(-1, st.slot_block[..., :C])
        free_first = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices
        rank = missing.long().cumsum(-1) - 1
        if C < K:  # only as many missing blocks as there are free slots get one
            missing = missing & (rank < (~keep).sum(-1, keepdim=True))
        target = free_first.gather(-1, rank.clamp(min=0, max=C - 1))
        old = st.slot_block.gather(-1, target)
        st.slot_of.scatter_(-1, torch.where(missing, old, NB), -1)
        st.slot_of.scatter_(-1, torch.where(missing, sel, NB), target)
        st.slot_of[..., NB] = -1
        st.slot_block.scatter_(-1, torch.where(missing, target, C), sel)
        row = self._head_rows(Hkv, dev)
        src = row * NB + sel
        dst = torch.where(missing, row * C + target, -1)
        if self.fetch == "uva":
            try:
                self._move_uva(st, src, dst, tok)
            except Exception as e:  # noqa: BLE001 (pointer not addressable, no Triton: copy through the host)
                import warnings

                warnings.warn(f"NOSA offload: direct host-memory access failed ({type(e).__name__}: {e}); "
                              "copying through the host", stacklevel=2)
                self.fetch = "copy"
        if self.fetch != "uva":
            self._move_copy(st, src, dst, tok)
        self.stats.d2h_bytes += self.batch * self._layer_token_d2h_bytes(st)
        # the new token into its block's slot (resident unless it overflowed: then the host store has it)
        own = st.slot_of[bi, hi, blk[:, None]]
        gk = st.gpu_k.view(B, Hkv, C, *st.gpu_k.shape[1:])
        gv = st.gpu_v.view(B, Hkv, C, *st.gpu_v.shape[1:])
        gb = st.gpu_b.view(B, Hkv, C, -1) if b1 is not None else None
        if C < K:
            resident = own >= 0
            own = own.clamp(min=0)
            k1 = torch.where(resident[..., None], k1, gk[bi, hi, own, off[:, None]])
            v1 = torch.where(resident[..., None], v1, gv[bi, hi, own, off[:, None]])
            if gb is not None:
                b1 = torch.where(resident, b1, gb[bi, hi, own, off[:, None]])
        gk[bi, hi, own, off[:, None]] = k1
        gv[bi, hi, own, off[:, None]] = v1
        if gb is not None:
            gb[bi, hi, own, off[:, None]] = b1
        return st.slot_of.gather(-1, sel), src

    def _host_bias_rows(self, st: LayerState) -> Tensor:
        """Offloaded layer: its bias in the host store as rows ``[B * Hkv * NB, bs]`` (the rows of ``cpu_k``)."""
        return st.bias.view(-1, self.block_size)

    def _zeros_like_score(self, st: LayerState) -> Tensor:
        """A zero tensor where the layer keeps its per-token scores (pinned host memory when offloaded)."""
        z = torch.zeros_like(st.score)
        return _pin(z) if st.offloaded else z

    def _token_offsets(self, st: LayerState, pos: Tensor) -> Tensor:
        """Element offset ``[B * Hkv]`` of each sequence's new token in the host store."""
        Hkv, D, bs = st.spec.num_kv_heads, st.spec.head_dim, self.block_size
        NB = st.slot_of.shape[-1] - 1
        row = self._head_rows(Hkv, pos.device)[..., 0]
        return (((row * NB + (pos // bs)[:, None]) * bs + (pos % bs)[:, None]) * D).reshape(-1)

    def _move_uva(self, st: LayerState, src: Tensor, dst: Tensor, tok: tuple) -> None:
        """Kernels read / write the pinned host store directly: no host synchronisation."""
        if not uva_available():
            raise RuntimeError("triton is not installed")
        k1, v1, s1, b1 = tok
        D = st.spec.head_dim
        elem = self._token_offsets(st, self.pos)
        uva_store_tokens(k1.reshape(-1, D).contiguous(), v1.reshape(-1, D).contiguous(), st.cpu_k, st.cpu_v, elem)
        if s1 is not None:  # the token's score (and own bias) at its position: element offset / D
            uva_store_values(s1.reshape(-1).contiguous(), st.score, elem // D)
            if st.bias_mode == "own":
                uva_store_values(b1.reshape(-1).contiguous(), st.bias, elem // D)
        self._copy_rows(st, src, dst, st.gpu_k, st.gpu_v, st.gpu_b if b1 is not None else None)

    def _move_copy(self, st: LayerState, src: Tensor, dst: Tensor, tok: tuple) -> None:
        """Host path: the new token goes device -> host, the missing blocks are gathered on the host
        into pinned staging and copied host -> device (one synchronisation per layer)."""
        pin = torch.cuda.is_available()
        k1, v1, s1, b1 = tok
        D = st.spec.head_dim

        def staged(x: Tensor) -> Tensor:  # device -> pinned host, queued
            return torch.empty(x.shape, dtype=x.dtype, pin_memory=pin).copy_(x, non_blocking=True)

        off_host = staged(self._token_offsets(st, self.pos))
        # (host store, the token's values for it): keys / values [N, D], the score and an own bias [N]
        writes = [(st.cpu_k, staged(k1.reshape(-1, D))), (st.cpu_v, staged(v1.reshape(-1, D)))]
        if s1 is not None:
            writes.append((st.score, staged(s1.reshape(-1))))
            if st.bias_mode == "own":
                writes.append((st.bias, staged(b1.reshape(-1))))
        moving = dst >= 0
        src, dst = src[moving], dst[moving]
        src_host = src.cpu()  # host sync: the copy list, and the token copies above have landed
        token_elems, token_cells = off_host[:, None] + torch.arange(D), off_host // D
        for store, values in writes:
            store.view(-1)[token_elems if values.dim() == 2 else token_cells] = values
        self._host_gather(st, src_host, dst, st.gpu_k, st.gpu_v, st.gpu_b if b1 is not None else None)

    def _copy_rows(self, st: LayerState, src: Tensor, dst: Tensor, out_k: Tensor, out_v: Tensor,
                   out_b: Tensor | None = None) -> None:
        """Host-store rows ``src`` into rows ``dst`` of ``out_k / out_v [R, bs, D]`` (device) where
        ``dst >= 0``, and the rows' bias into ``out_b [R, bs]`` when given: Triton kernels on the pinned
        store (``fetch=uva``) or a host gather + copy."""
        if self.fetch == "uva":
            chained = self._fetch_chain is not None and out_k.is_cuda
            stream = torch.cuda.current_stream(out_k.device) if chained else None
            if stream is not None and self._fetch_chain[0] is not None:
                # parts of a step: wait for the previous part's fetch, so the fetches take the host link
                # one at a time (part 1 fetches layer l while part 0 computes it) instead of all parts
                # fetching at once and then all computing at once
                stream.wait_event(self._fetch_chain[0])
            uva_fetch_rows(st.cpu_k, st.cpu_v, out_k, out_v, src.reshape(-1), dst.reshape(-1),
                           programs=self.fetch_programs,
                           host_b=None if out_b is None else self._host_bias_rows(st), slot_b=out_b)
            if stream is not None:
                self._fetch_chain[0] = torch.cuda.Event()
                self._fetch_chain[0].record(stream)
            self.stats.fetched_dev += (dst >= 0).sum()  # in place: also counts in captured graph replays
            return
        moving = dst >= 0
        self._host_gather(st, src[moving].cpu(), dst[moving], out_k, out_v, out_b)  # host sync: the copy list

    def _host_gather(self, st: LayerState, src_host: Tensor, dst: Tensor, out_k: Tensor, out_v: Tensor,
                     out_b: Tensor | None = None) -> None:
        """Host path of :meth:`_copy_rows`: rows ``src_host`` (CPU) gathered into pinned staging and
        copied to rows ``dst`` of ``out_k / out_v`` (and their bias rows to ``out_b``)."""
        pin = torch.cuda.is_available()
        n = int(src_host.numel())
        if n:
            pairs = [(st.cpu_k, out_k), (st.cpu_v, out_v)]
            if out_b is not None:
                pairs.append((self._host_bias_rows(st), out_b))
            moved = 0
            for host, out in pairs:
                stage = torch.empty(n, *host.shape[1:], dtype=host.dtype, pin_memory=pin)
                torch.index_select(host, 0, src_host, out=stage)
                out.index_copy_(0, dst, stage.to(dst.device, non_blocking=True))
                moved += stage.numel() * stage.element_size()
            self.stats.h2d_bytes += moved
            self._step_h2d += moved
            self.stats.fetched_blocks += n

    def fetched_blocks(self) -> int:
        """Blocks moved host -> device so far (all layers; reads the device counter of the UVA path)."""
        dev = 0 if self.stats.fetched_dev is None else int(self.stats.fetched_dev)
        return self.stats.fetched_blocks + dev

    def fetched_block_bytes(self) -> int:
        """Bytes one block fetch moves host -> device: the block's keys and values (cache dtype) and,
        where its layer's slots hold bias rows, its fp32 bias row (``fetched_blocks() *`` this is the
        traffic). 0 without offloaded layers."""
        sizes = {2 * st.cpu_k[0].nbytes + (0 if st.gpu_b is None else st.gpu_b[0].nbytes)
                 for st in self.states if st.offloaded}
        if len(sizes) > 1:  # one fetch counter serves every layer
            raise ValueError(f"offloaded layers move blocks of different sizes: {sorted(sizes)} bytes")
        return sizes.pop() if sizes else 0

    def token_d2h_bytes(self) -> int:
        """Bytes one decode token of one sequence moves device -> host over all offloaded layers
        (``stats.d2h_bytes`` counts the same on eager steps; a replayed CUDA graph does not count)."""
        return sum(self._layer_token_d2h_bytes(st) for st in self.states if st.offloaded)

    def _layer_token_d2h_bytes(self, st: LayerState) -> int:
        """Offloaded layer: bytes one sequence's new token writes to the host store, per KV head its key
        and value (cache dtype), its fp32 score and, for a separate bias, that too."""
        per_head = 2 * st.cpu_k.shape[-1] * st.cpu_k.element_size()
        if st.score is not None:
            per_head += st.score.element_size() * (2 if st.bias_mode == "own" else 1)
        return st.spec.num_kv_heads * per_head

    # ------------------------------------------------------------------ reporting
    def memory_bytes(self) -> dict:
        """Bytes held on the device and in host memory by this cache."""
        dev = host = 0
        for st in self.states:
            held = {name: getattr(st, name) for name in PER_SEQUENCE + PER_ROW}
            if st.bias_mode == "own":
                held["bias"] = st.bias
            for name, t in held.items():
                if t is None:
                    continue
                in_host_store = name.startswith("cpu_") or (st.offloaded and name in ("score", "bias"))
                if in_host_store:
                    host += t.numel() * t.element_size()
                else:
                    dev += t.numel() * t.element_size()
        return {"device": dev, "host": host}
