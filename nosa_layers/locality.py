"""Decode-time locality of a NOSA selection: how many blocks an offloaded KV cache must fetch.

Walking a sequence token by token, step ``t`` selects the block set ``S_t`` (per KV head). The
GPU holds ``S_{t-1}`` plus the block being written (the query's own block). Reported per head:

* ``gamma(t) = |S_t ∩ S_{t-1}| / |S_t|`` (the paper's locality), for ``t >= 1``;
* cache-hit rate ``= sum_t |S_t ∩ (S_{t-1} ∪ {own block})| / sum_t |S_t|``;
* blocks fetched per step ``= |S_t \\ (S_{t-1} ∪ {own block})|`` (host-to-device copies).

Locality bound (proved in nosa_layers/README.md): with ``E_t`` the top ``k_e`` non-forced causal
blocks by query-agnostic score, ``k_e = topk - (init + local + select)``, every ``E_t ⊆ S_t ∩ S_{t-1}``
(consistent tie-breaking), so ``gamma(t) >= k_e / topk`` once a sequence has ``k_e`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from nosa_layers.config import NOSAConfig
from nosa_layers.decode import select_decode
from nosa_layers.selection import select_blocks_reference


@dataclass
class LocalityStats:
    """Per-step statistics of one layer; tensors are ``[B, Hkv, T]`` (step 0 has gamma = nan)."""

    gamma: Tensor
    selected: Tensor  # |S_t|
    fetched: Tensor  # blocks copied host -> device at step t
    hits: Tensor  # |S_t ∩ resident|
    extra: dict = field(default_factory=dict)

    def _stats(self, sl: slice, from_step: int) -> dict:
        g = self.gamma[sl][..., max(1, from_step):]
        return {
            "gamma_mean": float(g.nanmean()),
            "gamma_min": float(g.nan_to_num(2.0).min()),
            "hit_rate": float(self.hits[sl][..., from_step:].sum() / self.selected[sl][..., from_step:].sum()),
            "fetched_per_step": float(self.fetched[sl][..., from_step:].float().mean()),
            "selected_per_step": float(self.selected[sl][..., from_step:].float().mean()),
        }

    def per_head(self, from_step: int = 1) -> list[dict]:
        """One dict per KV head over steps ``>= from_step`` (gamma needs ``t >= 1``)."""
        return [{"head": h, **self._stats((slice(None), h), from_step)} for h in range(self.gamma.shape[1])]

    def summary(self, from_step: int = 1) -> dict:
        """All heads together over steps ``>= from_step``."""
        return self._stats((slice(None),), from_step)


def step_selections(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                    walk: str = "decode") -> Tensor:
    """``S_t`` for every step, bool ``[B, Hkv, T, nb]``.

    ``walk="decode"`` runs the decode-step selection on each prefix (token by token, as an
    inference engine would); ``"parallel"`` takes the rows of the training-path selection
    (identical by construction and by test, much faster).
    """
    if walk == "parallel":
        return select_blocks_reference(q, k, evict_score, cfg)
    if walk != "decode":
        raise ValueError(f"walk must be 'decode' or 'parallel', got {walk!r}")
    B, T, _, _ = q.shape
    out = torch.zeros(B, k.shape[2], T, cfg.num_blocks(T), dtype=torch.bool, device=q.device)
    for t in range(T):
        score = None if evict_score is None else evict_score[:, :t + 1]
        sel = select_decode(q[:, t:t + 1], k[:, :t + 1], score, cfg)
        out[:, :, t, :sel.shape[-1]] = sel
    return out


def locality_from_selections(selected: Tensor, block_size: int, positions: Tensor | None = None) -> LocalityStats:
    """Locality statistics from per-step selections ``[B, Hkv, T, nb]`` of one sequence.

    ``positions``: ``[T]`` or ``[B, T]`` position of each row inside its document, for packed
    sequences whose block indices restart at every document (``select_blocks(..., cu_seqlens)``);
    default ``0..T-1``. The first row of a document compares with the previous document's last
    row; callers drop those rows (position 0)."""
    B, H, T, nb = selected.shape
    prev = torch.zeros_like(selected)
    prev[:, :, 1:] = selected[:, :, :-1]
    pos = torch.arange(T, device=selected.device) if positions is None else positions.to(selected.device)
    own_block = (pos.reshape(-1, 1, T, 1) // block_size).expand(B, H, T, 1)
    if own_block.numel() and int(own_block.max()) >= nb:
        raise ValueError(f"positions reach block {int(own_block.max())} but the selection has {nb} blocks "
                         "(packed sequence? pass positions inside each document)")
    own = torch.zeros_like(selected).scatter_(-1, own_block, True)
    resident = prev | own
    size = selected.sum(-1)
    kept = (selected & prev).sum(-1)
    hits = (selected & resident).sum(-1)
    gamma = kept.double() / size.double()
    gamma[:, :, 0] = float("nan")
    return LocalityStats(gamma=gamma, selected=size, fetched=size - hits, hits=hits)


def packed_locality_summary(selections: list[tuple[Tensor, int]], positions: Tensor) -> dict:
    """Training-time summary over layers: ``selections`` = ``(selected [b, Hkv, s, nb], block_size)``
    per layer, ``positions`` ``[b, s]`` (restarting at every packed document). Rows that start a
    document are left out (no predecessor). Computed on the selections' device; returns floats
    ``nosa_gamma_mean``, ``nosa_gamma_min``, ``nosa_fetched_per_step`` (empty dict: no selection)."""
    gammas, fetched = [], []
    for sel, block_size in selections:
        pos = positions.to(sel.device)
        keep = pos > 0
        st = locality_from_selections(sel, block_size, positions=pos)
        gammas.append(st.gamma.transpose(1, 2)[keep].flatten())  # [b, s, Hkv] rows with a predecessor
        fetched.append(st.fetched.transpose(1, 2)[keep].float().flatten())
    if not gammas:
        return {}
    g, f = torch.cat(gammas), torch.cat(fetched)
    return {"nosa_gamma_mean": float(g.nanmean()), "nosa_gamma_min": float(g.nan_to_num(2.0).min()),
            "nosa_fetched_per_step": float(f.mean())}


def measure_locality(q: Tensor, k: Tensor, evict_score: Tensor | None, cfg: NOSAConfig,
                     walk: str = "decode") -> LocalityStats:
    """Walk one layer's sequence token by token and report gamma, cache hits and fetches.

    q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]`` post-RoPE, evict_score ``[B, T, Hkv]`` or None.
    """
    return locality_from_selections(step_selections(q, k, evict_score, cfg, walk), cfg.block_size)


def format_locality_table(per_layer: dict[str, LocalityStats], from_step: int = 1) -> str:
    """Plain-text table: one row per (layer, KV head), steps ``>= from_step``."""
    lines = [f"{'layer':>10} {'head':>4} {'gamma_mean':>10} {'gamma_min':>9} {'hit_rate':>8} "
             f"{'fetch/step':>10} {'blocks/step':>11}"]
    for name, stats in per_layer.items():
        for row in stats.per_head(from_step):
            lines.append(f"{name:>10} {row['head']:>4} {row['gamma_mean']:>10.4f} {row['gamma_min']:>9.4f} "
                         f"{row['hit_rate']:>8.4f} {row['fetched_per_step']:>10.3f} "
                         f"{row['selected_per_step']:>11.2f}")
    return "\n".join(lines)
