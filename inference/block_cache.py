"""Block-organised KV cache of the exported NOSA model (transformers' ``Cache`` API): batched decode steps,
optionally offloaded to pinned host memory.

Runs on PyTorch alone; with Triton on a GPU the decode attention and the offload transfers are kernels. The
cache holds one ``LayerState`` per layer (what it stores and how it grows: ``inference.storage``) and
orchestrates the calls of a forward: a prompt or chunk appends its valid tokens (:meth:`NOSABlockCache.extend`),
a decode step runs each layer's batched step (``inference.decode_step``), moving offloaded blocks through its
``HostTransfers`` (``inference.transfers``: one host synchronisation per layer on the host-copy path, none with
the direct-access kernels), optionally in batch parts on their own CUDA streams, counted in
``inference.stats``; ``inference.decode_graph`` captures a whole step as a CUDA graph.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from inference.decode_step import StepGrid, decode_layer
from inference.stats import fetched_block_bytes, fetched_blocks, memory_bytes, token_d2h_bytes
from inference.storage import CAPACITY_MARGIN, LayerSpec, LayerState, Layout, round_capacity
from inference.streams import shared_streams
from inference.transfers import HostTransfers
from nosa_layers.config import NOSAConfig
from nosa_layers.ops.decode_attention import available as attn_kernel_available
from nosa_layers.ops.decode_attention import define_kernels as define_attention_kernels
from nosa_layers.ops.decode_selection import define_kernels as define_selection_kernels
from nosa_layers.ops.offload_copy import define_kernels as define_offload_kernels
from nosa_layers.selection import block_window_index

# batch parts of an offloaded decode step by default: their host fetches take turns with the other
# parts' compute (1B shape, 16K, H200: 1.16-1.26x the tokens/s of one part; docs/BENCHMARKS.md)
OFFLOAD_DECODE_STREAMS = 4


class NOSABlockCache(Cache):
    """KV cache of ``NOSALlamaForCausalLM``: made by the model (``model.new_cache(...)``, or on the
    first forward with ``use_cache``) and passed back by ``generate``.

    ``reserve`` tokens per sequence are allocated up front (default: the prompt plus 1024; the
    cache doubles when full). ``offload=True`` keeps every block of the NOSA layers in pinned CPU
    memory and ``gpu_blocks`` (default: the selection budget ``topk``) block slots per (sequence,
    KV head) on the GPU (the per-token scores / bias go with the blocks: host store, and the bias rows
    of the slots' blocks); dense layers and the selection state stay on the GPU. With fewer
    slots than ``topk``, the selected blocks that find no free slot are read from the host store
    every step (more host-to-device traffic for a smaller device footprint). ``fetch``: how offloaded
    blocks move (``inference.transfers``). ``attention``: how a decode step's token attends to its
    selected blocks, ``triton`` = the kernel of ``nosa_layers.ops.decode_attention`` reading them in place
    (cache, slots, or the pinned host store for blocks without a slot), and the block selection in one launch
    (``nosa_layers.ops.decode_selection``, where it takes the shape), ``torch`` = gathered copies and
    ``attend``, ``auto`` = ``triton`` on a CUDA device when Triton is installed. ``decode_streams`` > 1 splits
    a decode step's batch into that many contiguous parts that run layer by layer on their own CUDA streams,
    so one part's host-to-device fetch can overlap another part's compute (:meth:`decode_parts`; results
    equal the unsplit step up to GEMM rounding; default ``OFFLOAD_DECODE_STREAMS`` = 4 for an offloaded
    cache, 1 otherwise: a GPU-resident step has nothing to fetch and runs faster whole).
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
        self.transfers = HostTransfers(fetch)  # offload transfers and their counters
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
        self.part_fetch_programs_per_sm = 2  # grid of a batch part's fetch, per SM (a tuning knob)
        self.reserve = reserve  # tokens per sequence to allocate up front (default: prompt + CAPACITY_MARGIN)
        self.batch = 0
        self.capacity = 0  # tokens per sequence
        self.seen = 0  # attention-mask columns consumed
        self.lens: Tensor | None = None  # [B] tokens stored per sequence (device)
        self.device = None
        self.dtype = None
        self.state_dtype = torch.float32  # scores, compressed keys, softmax: at least fp32
        # per-call state set by begin()
        self.decoding = False
        self.grid: StepGrid | None = None  # the decode step's positions and what derives from them
        self.valid_new: Tensor | None = None  # [B, T] bool
        self.rows: list = []  # per sequence: index of its valid new tokens (extend)
        self.start: list = []  # per sequence: tokens stored before this call (extend)
        self._window_index: dict = {}
        self.version = 0  # changes whenever buffers are reallocated (captured decode graphs depend on them)
        self.graph = None  # the decode step's CUDA graph (``inference.decode_graph.DecodeGraph``)

    # ------------------------------------------------------------------ transfers
    @property
    def fetch(self) -> str:
        """How offloaded blocks move: ``uva`` (kernels on the pinned host store) or ``copy`` (``auto`` until set up)."""
        return self.transfers.fetch

    @property
    def stats(self):
        """What the offloaded cache moved (``inference.stats.TransferStats``)."""
        return self.transfers.stats

    def fetched_blocks(self) -> int:
        """Blocks moved host -> device so far (all layers; reads the device counter of the direct-access path)."""
        return fetched_blocks(self.stats)

    def fetched_block_bytes(self) -> int:
        """Bytes one block fetch moves host -> device (``fetched_blocks() *`` this is the traffic)."""
        return fetched_block_bytes(self.states)

    def token_d2h_bytes(self) -> int:
        """Bytes one decode token of one sequence moves device -> host over all offloaded layers
        (``stats.d2h_bytes`` counts the same on eager steps; a replayed CUDA graph does not count)."""
        return token_d2h_bytes(self.states)

    def memory_bytes(self) -> dict:
        """Bytes held on the device and in host memory by this cache."""
        return memory_bytes(self.states)

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
            st.select(idx, cpu_idx, self.batch)
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
        if not self.decoding or not self.splits_decode():
            return []
        # a part's fetch takes a few programs per SM (``part_fetch_programs_per_sm``) and leaves the SMs'
        # other slots to the other parts' compute (CPU, interpreter: 3 programs, which exercises their
        # loop over rows)
        dev = torch.device(self.device)
        grid = (self.part_fetch_programs_per_sm * torch.cuda.get_device_properties(dev).multi_processor_count
                if dev.type == "cuda" else 3)
        chain = [None]  # the parts' host fetches run one after another, in issue order (HostTransfers.copy_rows)
        return [self._view(i * B // n, (i + 1) * B // n, grid, chain) for i in range(n)]

    def splits_decode(self) -> bool:
        """Whether a decode step runs in batch parts (:meth:`decode_parts`)."""
        return min(self.decode_streams, self.batch) >= 2 and not (self.offload and self.fetch != "uva")

    def gather_parts(self, parts: list["NOSABlockCache"]) -> None:
        """Add the parts' transfer counters to this cache's."""
        for p in parts:
            self.transfers.add(p.transfers)

    def part_streams(self, n: int) -> list:
        """``n`` CUDA streams for the parts of a decode step (shared with the thread's other caches)."""
        return shared_streams(self.device, "part", n)

    def _view(self, a: int, b: int, fetch_programs: int, fetch_chain: list) -> "NOSABlockCache":
        view = copy.copy(self)
        view.batch, view.part_range, view.graph = b - a, (a, b), None
        view.lens, view.valid_new = self.lens[a:b], self.valid_new[a:b]
        view.grid = StepGrid(self.grid.pos[a:b], b - a, self.block_size)
        view.transfers = self.transfers.part(fetch_programs, fetch_chain, self.lens.device)
        view.states = [st.rows(a, b, self.batch) for st in self.states]
        return view

    # ------------------------------------------------------------------ allocation
    def _layout(self) -> Layout:
        return Layout(batch=self.batch, capacity=self.capacity, block_size=self.block_size, slots=self.gpu_blocks,
                      offload=self.offload, dtype=self.dtype, state_dtype=self.state_dtype, device=self.device)

    def _setup(self, B: int, need: int, device, dtype) -> None:
        self.batch, self.device, self.dtype = B, device, dtype
        self.transfers.settle(device)
        on_gpu = torch.device(device).type == "cuda"
        if self.attention == "auto":
            self.attention = "triton" if on_gpu and attn_kernel_available() else "torch"
        elif self.attention == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention='triton' needs a CUDA device (or TRITON_INTERPRET=1 on a CPU, slow); "
                             "use attention='torch' or 'auto'")
        self.state_dtype = torch.promote_types(dtype, torch.float32)
        tokens = max(need, self.reserve) if self.reserve else need + CAPACITY_MARGIN
        self.capacity = round_capacity(tokens, self.block_size)
        self.lens = torch.zeros(B, dtype=torch.long, device=device)
        self.version += 1
        lay = self._layout()
        for st in self.states:
            st.allocate(lay)

    def _grow(self, need: int) -> None:
        """Reallocate every layer for at least ``need`` tokens per sequence (rare: doubling)."""
        old_capacity = self.capacity
        self.capacity = round_capacity(max(need, 2 * old_capacity), self.block_size)
        lay = self._layout()
        for st in self.states:
            st.grow(lay, old_capacity)
        self._window_index.clear()
        self.version += 1

    def window_index(self, cfg: NOSAConfig, NB: int, NW: int, device) -> Tensor:
        """``block_window_index(cfg, NB, NW)``, made once per capacity and geometry."""
        key = (cfg.block_size, cfg.kernel_size, cfg.kernel_stride, NB, NW)
        if key not in self._window_index:
            self._window_index[key] = block_window_index(cfg, NB, NW, device=device)
        return self._window_index[key]

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
            self.transfers.step_h2d = 0
            for st in self.states:  # made here, not inside a (compiled, captured) step: constant per capacity
                if st.spec.cfg is not None:
                    self.window_index(st.spec.cfg, st.num_blocks, st.kc.shape[2] - 1, self.device)
            return
        lens = self.lens.tolist()
        self.rows = [self.valid_new[b].nonzero().squeeze(-1) for b in range(B)]
        counts = [int(r.numel()) for r in self.rows]
        self.start = lens
        need = max(a + c for a, c in zip(lens, counts))
        if need > self.capacity:
            self._grow(need)

    def prepare_compiled_decode(self) -> None:
        """Before a ``torch.compile``-d decode step: the Triton kernels it calls defined (their definition
        cannot be traced)."""
        if self.attention == "triton":
            define_attention_kernels()
            define_selection_kernels()
        if self.offload and self.fetch == "uva":
            define_offload_kernels()

    def set_pos(self, pos: Tensor) -> None:
        """Positions of this step's new tokens; forgets what was derived from the previous ones."""
        self.grid = StepGrid(pos, self.batch, self.block_size)

    def end(self, lens_advanced: bool = False) -> None:
        """Finish the forward: advance the lengths (unless a captured decode step did)."""
        if self.decoding:
            if not lens_advanced:
                self.lens += self.valid_new[:, 0].long()
            self.stats.decode_steps += 1
            self.stats.per_step_h2d.append(self.transfers.step_h2d)
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
            st.set_bias_mode("none" if bias is None else ("score" if bias is score else "own"))
        out = []
        for b, rows in enumerate(self.rows):
            n0, m = self.start[b], int(rows.numel())
            kb, vb = k[b, rows].to(self.dtype), v[b, rows].to(self.dtype)  # [m, Hkv, D]
            if n0:
                kp, vp = st.read(b, n0, self.batch, self.device)
                kb, vb = torch.cat([kp, kb]), torch.cat([vp, vb])
            st.write(b, n0, kb[n0:].detach(), vb[n0:].detach(), self.batch)
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
                st.rebuild_selection_state(b, kb.detach(), None if sb is None else sb.detach(), self.state_dtype)
            out.append((rows, kb[None], vb[None], sb, bb))
        return out

    # ------------------------------------------------------------------ decode step
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, score: Tensor | None, bias: Tensor | None,
               softmax_scale: float | None = None, record: bool = False):
        """One token per sequence through ``layer`` (``inference.decode_step.decode_layer``): ``q [B, 1, Hq, D]``
        post-RoPE, ``k, v [B, 1, Hkv, D]``, ``score``/``bias [B, 1, Hkv]``. Returns ``(out [B, 1, Hq, D],
        selection)``; ``selection`` (only with ``record``) is a list of bool ``[Hkv, 1, nb]`` per sequence."""
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return decode_layer(self, self.states[layer], q, k, v, score, bias, scale, record)
