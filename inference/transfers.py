"""Offload transfers of the block KV cache: the blocks a decode step selects, host store -> GPU slots, and the
new token, device -> host store.

Two paths (``fetch``): ``uva``, Triton kernels that read and write the pinned host store directly
(``nosa_layers.ops.offload_copy``: no host synchronisation, so a step that fetches can be captured in a CUDA
graph), and ``copy``, the rows gathered on the host into pinned staging and copied (one host synchronisation
per layer). Shapes as in ``inference.storage``; ``grid`` is the step's ``inference.decode_step.StepGrid``
(positions and index grids); ``tok = (k1, v1, s1, b1)`` the new token's key, value ``[B, Hkv, D]``, score and
bias ``[B, Hkv]`` (None without).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from inference.stats import TransferStats, layer_token_d2h_bytes
from inference.storage import LayerState
from nosa_layers.ops.offload_copy import available as uva_available
from nosa_layers.ops.offload_copy import fetch_rows as uva_fetch_rows
from nosa_layers.ops.offload_copy import store_tokens as uva_store_tokens
from nosa_layers.ops.offload_copy import store_values as uva_store_values


class HostTransfers:
    """How one cache (or one batch part of its decode step) moves blocks, and what it moved (``stats``).

    ``fetch``: ``auto`` (``uva`` on CUDA with Triton, else ``copy``; settled by :meth:`settle`), ``uva`` or
    ``copy``; ``programs``: the grid of the direct-access fetch (None: one program per row); ``chain``: shared
    by the parts of one step, the event of the last host fetch issued (the parts' fetches take the host link
    one after another)."""

    def __init__(self, fetch: str = "auto") -> None:
        if fetch not in ("auto", "uva", "copy"):
            raise ValueError(f"fetch must be auto, uva or copy, got {fetch!r}")
        self.fetch = fetch
        self.programs: int | None = None
        self.chain: list | None = None
        self.stats = TransferStats()
        self.step_h2d = 0  # host -> device bytes of the current decode step (copy path)

    def settle(self, device) -> None:
        """Choose ``auto``'s path for ``device`` and start the device counter of fetched blocks there."""
        if self.fetch == "auto":
            self.fetch = "uva" if torch.device(device).type == "cuda" and uva_available() else "copy"
        self.stats.fetched_dev = torch.zeros((), dtype=torch.long, device=device)

    def part(self, programs: int, chain: list, device) -> "HostTransfers":
        """The transfers of one batch part of a step: this path, its own counters, ``programs`` per fetch."""
        out = HostTransfers(self.fetch)
        out.programs, out.chain = programs, chain
        out.stats.fetched_dev = torch.zeros((), dtype=torch.long, device=device)
        return out

    def add(self, part: "HostTransfers") -> None:
        """Count a batch part's transfers here too."""
        self.stats.add(part.stats)
        self.step_h2d += part.step_h2d

    # ------------------------------------------------------------------ the step's moves
    def gather_selected(self, st: LayerState, grid, sel: Tensor, sel_ok: Tensor,
                        tok: tuple) -> tuple[Tensor, Tensor, Tensor | None]:
        """PyTorch attention: :meth:`make_resident`, then the selected blocks gathered into ``[B, Hkv, K, bs, D]``
        (and their bias rows ``[B, Hkv, K, bs]``, None without a bias); blocks without a slot (fewer slots ``C``
        than selected blocks ``K``) are read from the host store straight into the gathered tensors."""
        B, Hkv, K = sel.shape
        C = st.num_slots
        slots, src = self.make_resident(st, grid, sel, sel_ok, tok)
        bi, hi = grid.batch_head(Hkv, sel.device)
        at = (bi[..., None], hi[..., None], slots.clamp(min=0))
        kb = st.gpu_k.view(B, Hkv, C, *st.gpu_k.shape[1:])[at]
        vb = st.gpu_v.view(B, Hkv, C, *st.gpu_v.shape[1:])[at]
        bb = st.gpu_b.view(B, Hkv, C, -1)[at] if tok[3] is not None else None
        if C < K:  # selected blocks without a slot: from the host store into this step's copies
            row = grid.head_rows(Hkv, sel.device)
            spill = torch.where(sel_ok & (slots < 0), (row * K + torch.arange(K, device=sel.device)), -1)
            self.copy_rows(st, src, spill, kb.view(-1, *kb.shape[3:]), vb.view(-1, *vb.shape[3:]),
                           None if bb is None else bb.view(-1, bb.shape[-1]))
        return kb, vb, bb

    def make_resident(self, st: LayerState, grid, sel: Tensor, sel_ok: Tensor, tok: tuple) -> tuple[Tensor, Tensor]:
        """Bring the selected blocks ``sel [B, Hkv, K]`` (keys, values, bias rows) into GPU slots, moving only
        those not resident, and write the new token ``tok`` (GPU slot and host store). Returns ``(slots, src)``
        ``[B, Hkv, K]``: the slot of each selected block (-1: none; with fewer slots ``C`` than selected blocks
        ``K``, the missing blocks beyond the free slots, in selection order) and its row in the host store."""
        B, Hkv, K = sel.shape
        NB, C = st.num_blocks, st.num_slots
        dev = sel.device
        k1, v1, _, b1 = tok
        blk, off = grid.block_offset()
        bi, hi = grid.batch_head(Hkv, dev)
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
        row = grid.head_rows(Hkv, dev)
        src = row * NB + sel
        dst = torch.where(missing, row * C + target, -1)
        if self.fetch == "uva":
            try:
                self._move_uva(st, grid, src, dst, tok)
            except Exception as e:  # noqa: BLE001 (pointer not addressable, no Triton: copy through the host)
                warnings.warn(f"NOSA offload: direct host-memory access failed ({type(e).__name__}: {e}); "
                              "copying through the host", stacklevel=2)
                self.fetch = "copy"
        if self.fetch != "uva":
            self._move_copy(st, grid, src, dst, tok)
        self.stats.d2h_bytes += grid.batch * layer_token_d2h_bytes(st)
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

    def copy_rows(self, st: LayerState, src: Tensor, dst: Tensor, out_k: Tensor, out_v: Tensor,
                  out_b: Tensor | None = None) -> None:
        """Host-store rows ``src`` into rows ``dst`` of ``out_k / out_v [R, bs, D]`` (device) where ``dst >= 0``,
        and the rows' bias into ``out_b [R, bs]`` when given: kernels on the pinned store (``uva``) or a host
        gather + copy."""
        if self.fetch == "uva":
            chained = self.chain is not None and out_k.is_cuda
            stream = torch.cuda.current_stream(out_k.device) if chained else None
            if stream is not None and self.chain[0] is not None:
                # parts of a step: wait for the previous part's fetch, so the fetches take the host link
                # one at a time (part 1 fetches layer l while part 0 computes it) instead of all parts
                # fetching at once and then all computing at once
                stream.wait_event(self.chain[0])
            uva_fetch_rows(st.cpu_k, st.cpu_v, out_k, out_v, src.reshape(-1), dst.reshape(-1),
                           programs=self.programs, host_b=None if out_b is None else st.host_bias_rows(), slot_b=out_b)
            if stream is not None:
                self.chain[0] = torch.cuda.Event()
                self.chain[0].record(stream)
            self.stats.fetched_dev += (dst >= 0).sum()  # in place: also counts in captured graph replays
            return
        moving = dst >= 0
        self._host_gather(st, src[moving].cpu(), dst[moving], out_k, out_v, out_b)  # host sync: the copy list

    # ------------------------------------------------------------------ the two paths
    def _move_uva(self, st: LayerState, grid, src: Tensor, dst: Tensor, tok: tuple) -> None:
        """Kernels read / write the pinned host store directly: no host synchronisation."""
        if not uva_available():
            raise RuntimeError("triton is not installed")
        k1, v1, s1, b1 = tok
        D = st.spec.head_dim
        elem = token_offsets(st, grid)
        uva_store_tokens(k1.reshape(-1, D).contiguous(), v1.reshape(-1, D).contiguous(), st.cpu_k, st.cpu_v, elem)
        if s1 is not None:  # the token's score (and own bias) at its position: element offset / D
            uva_store_values(s1.reshape(-1).contiguous(), st.score, elem // D)
            if st.bias_mode == "own":
                uva_store_values(b1.reshape(-1).contiguous(), st.bias, elem // D)
        self.copy_rows(st, src, dst, st.gpu_k, st.gpu_v, st.gpu_b if b1 is not None else None)

    def _move_copy(self, st: LayerState, grid, src: Tensor, dst: Tensor, tok: tuple) -> None:
        """Host path: the new token goes device -> host, the missing blocks are gathered on the host into
        pinned staging and copied host -> device (one synchronisation per layer)."""
        pin = torch.cuda.is_available()
        k1, v1, s1, b1 = tok
        D = st.spec.head_dim

        def staged(x: Tensor) -> Tensor:  # device -> pinned host, queued
            return torch.empty(x.shape, dtype=x.dtype, pin_memory=pin).copy_(x, non_blocking=True)

        off_host = staged(token_offsets(st, grid))
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

    def _host_gather(self, st: LayerState, src_host: Tensor, dst: Tensor, out_k: Tensor, out_v: Tensor,
                     out_b: Tensor | None = None) -> None:
        """Host path of :meth:`copy_rows`: rows ``src_host`` (CPU) gathered into pinned staging and copied to
        rows ``dst`` of ``out_k / out_v`` (and their bias rows to ``out_b``)."""
        pin = torch.cuda.is_available()
        n = int(src_host.numel())
        if n:
            pairs = [(st.cpu_k, out_k), (st.cpu_v, out_v)]
            if out_b is not None:
                pairs.append((st.host_bias_rows(), out_b))
            moved = 0
            for host, out in pairs:
                stage = torch.empty(n, *host.shape[1:], dtype=host.dtype, pin_memory=pin)
                torch.index_select(host, 0, src_host, out=stage)
                out.index_copy_(0, dst, stage.to(dst.device, non_blocking=True))
                moved += stage.numel() * stage.element_size()
            self.stats.h2d_bytes += moved
            self.step_h2d += moved
            self.stats.fetched_blocks += n


def token_offsets(st: LayerState, grid) -> Tensor:
    """Element offset ``[B * Hkv]`` of each sequence's new token in the host store."""
    Hkv, D = st.spec.num_kv_heads, st.spec.head_dim
    bs, NB = st.cpu_k.shape[1], st.num_blocks
    pos = grid.pos
    row = grid.head_rows(Hkv, pos.device)[..., 0]
    return (((row * NB + (pos // bs)[:, None]) * bs + (pos % bs)[:, None]) * D).reshape(-1)
