"""What the block KV cache holds and moves: memory by side, host <-> device traffic per block and per token."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from inference.storage import PER_ROW, PER_SEQUENCE, LayerState


@dataclass
class TransferStats:
    """Bytes moved by the offloaded cache (all layers) and how many decode steps moved them."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    fetched_blocks: int = 0  # host-copy path (exact, host int)
    fetched_dev: Tensor | None = None  # direct-access path: a device counter (read with ``fetched_blocks``)
    decode_steps: int = 0
    per_step_h2d: list = field(default_factory=list)

    def add(self, other: "TransferStats") -> None:
        """Count ``other``'s transfers (a batch part's) here too."""
        self.fetched_dev += other.fetched_dev
        self.h2d_bytes += other.h2d_bytes
        self.d2h_bytes += other.d2h_bytes
        self.fetched_blocks += other.fetched_blocks


def fetched_blocks(stats: TransferStats) -> int:
    """Blocks moved host -> device so far (all layers; reads the device counter of the direct-access path)."""
    dev = 0 if stats.fetched_dev is None else int(stats.fetched_dev)
    return stats.fetched_blocks + dev


def fetched_block_bytes(states: list[LayerState]) -> int:
    """Bytes one block fetch moves host -> device: the block's keys and values (cache dtype) and, where its
    layer's slots hold bias rows, its fp32 bias row. 0 without offloaded layers."""
    sizes = {2 * st.cpu_k[0].nbytes + (0 if st.gpu_b is None else st.gpu_b[0].nbytes)
             for st in states if st.offloaded}
    if len(sizes) > 1:  # one fetch counter serves every layer
        raise ValueError(f"offloaded layers move blocks of different sizes: {sorted(sizes)} bytes")
    return sizes.pop() if sizes else 0


def layer_token_d2h_bytes(st: LayerState) -> int:
    """Offloaded layer: bytes one sequence's new token writes to the host store, per KV head its key and
    value (cache dtype), its fp32 score and, for a separate bias, that too."""
    per_head = 2 * st.cpu_k.shape[-1] * st.cpu_k.element_size()
    if st.score is not None:
        per_head += st.score.element_size() * (2 if st.bias_mode == "own" else 1)
    return st.spec.num_kv_heads * per_head


def token_d2h_bytes(states: list[LayerState]) -> int:
    """Bytes one decode token of one sequence moves device -> host over all offloaded layers."""
    return sum(layer_token_d2h_bytes(st) for st in states if st.offloaded)


def memory_bytes(states: list[LayerState]) -> dict:
    """Bytes held on the device and in host memory by the layers' tensors."""
    dev = host = 0
    for st in states:
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
