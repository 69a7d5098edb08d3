"""LongRoPE (Phi-3 / MiniCPM4 style) rotary frequencies, matching Hugging Face's ``longrope`` type.

Math (``transformers.modeling_rope_utils._compute_longrope_parameters``)::

    inv_freq_i = 1 / (factor_i * theta ** (2i / dim))         i = 0 .. dim/2 - 1
    factor     = long_factor  if seq_len > original_max_position_embeddings else short_factor
    cos, sin   = cos(pos * inv_freq) * attention_factor, sin(pos * inv_freq) * attention_factor

``seq_len`` is the largest position + 1 of the forward pass (HF: ``max(position_ids) + 1``), so
packed documents whose positions restart use the longest document. The default
``attention_factor`` is ``sqrt(1 + ln(f) / ln(original))`` with
``f = max_position_embeddings / original_max_position_embeddings`` (1.0 when ``f <= 1``).
Pure PyTorch; no megatron-core import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LongRoPEConfig:
    """The ``rope_scaling`` block of a ``longrope`` checkpoint (one factor per rotary frequency)."""

    short_factor: list[float]
    long_factor: list[float]
    original_max_position_embeddings: int
    attention_factor: float | None = None  # None: derived from the max/original ratio (HF default)
    factor: float | None = None  # None: max_position_embeddings / original_max_position_embeddings

    def validate(self, rotary_dim: int, max_position_embeddings: int, theta: float | None = None) -> "LongRoPEConfig":
        """Raise ``ValueError`` (one line, naming the fix) on inconsistent fields."""
        half = rotary_dim // 2
        orig = self.original_max_position_embeddings
        make = (f"python -m train.longrope_init --head-dim {rotary_dim} --theta {'<model.rope_theta>' if theta is None
                else f'{theta:g}'} --orig {orig if orig > 0 else '<pretraining length>'} --target "
                f"{max_position_embeddings} writes the block")
        for name in ("short_factor", "long_factor"):
            n = len(getattr(self, name))
            if n != half:
                raise ValueError(f"model.longrope.{name} has {n} entries; it needs head_dim/2 = {half} "
                                 f"(one per rotary frequency): {make}")
        if orig <= 0:
            raise ValueError(f"model.longrope.original_max_position_embeddings must be positive (the pretraining "
                             f"length): {make}")
        if max_position_embeddings <= 0:
            raise ValueError("max_position_embeddings must be positive")
        return self

    def resolved_attention_factor(self, max_position_embeddings: int) -> float:
        """The cos/sin multiplier (HF's ``attention_scaling``)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        factor = self.factor
        if factor is None:
            factor = max_position_embeddings / self.original_max_position_embeddings
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))

    def to_hf_rope_scaling(self, rope_theta: float) -> dict:
        """The ``rope_parameters`` / ``rope_scaling`` dict a HF config expects."""
        out = {"rope_type": "longrope", "rope_theta": rope_theta,
               "short_factor": list(self.short_factor), "long_factor": list(self.long_factor),
               "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        if self.factor is not None:
            out["factor"] = self.factor
        return out


def longrope_inv_freq(cfg: LongRoPEConfig, rotary_dim: int, theta: float, seq_len: int | None,
                      device=None) -> Tensor:
    """``[rotary_dim/2]`` fp32 inverse frequencies for a forward whose largest position is
    ``seq_len - 1`` (``None``: short factors, as HF's init path)."""
    long = seq_len is not None and seq_len > cfg.original_max_position_embeddings
    ext = torch.tensor(cfg.long_factor if long else cfg.short_factor, dtype=torch.float32, device=device)
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (ext * theta ** exponent)


def longrope_cos_sin(cfg: LongRoPEConfig, positions: Tensor, rotary_dim: int, theta: float,
                     max_position_embeddings: int, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """``cos, sin [T, rotary_dim]`` (rotate-half layout) for integer ``positions [T]``, scaled by the
    attention factor. ``seq_len`` defaults to ``max(positions) + 1``."""
    if seq_len is None:
        seq_len = int(positions.max().item()) + 1 if positions.numel() else 0
    inv_freq = longrope_inv_freq(cfg, rotary_dim, theta, seq_len, device=positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = cfg.resolved_attention_factor(max_position_embeddings)
    return emb.cos() * scale, emb.sin() * scale


def yarn_ramp_factors(head_dim: int, theta: float, orig_len: int, target_len: int,
                      alpha: float = 1.0, beta: float = 32.0) -> list[float]:
    """Initial LongRoPE factors of a context extension ``orig_len -> target_len``: YaRN's "NTK-by-parts"
    ramp, where LongRoPE's search starts. ``head_dim // 2`` factors (one per rotary frequency, dividing its
    inverse frequency)::

        ratio_i = orig_len / wavelength_i,   wavelength_i = 2 pi theta^(2i / head_dim)
        gamma_i = clamp((ratio_i - alpha) / (beta - alpha), 0, 1)
        factor_i = 1 / ((1 - gamma_i) / s + gamma_i),   s = target_len / orig_len

    so high frequencies (many periods inside the original context) keep factor 1 and low ones are
    interpolated by ``s``."""
    s = target_len / orig_len
    out = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / head_dim)
        gamma = min(1.0, max(0.0, (orig_len / wavelength - alpha) / (beta - alpha)))
        out.append(1.0 / ((1.0 - gamma) / s + gamma))
    return out


def extension_attention_factor(orig_len: int, target_len: int) -> float:
    """``sqrt(1 + ln(s) / ln(orig_len))`` for ``s = target_len / orig_len`` (1 when ``s <= 1``)."""
    s = target_len / orig_len
    return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(orig_len))


def initial_longrope(head_dim: int, theta: float, orig_len: int, target_len: int) -> LongRoPEConfig:
    """The LongRoPE block of a context extension (``yarn_ramp_factors``, rounded to 6 decimals; short =
    long factors, as NOSA-8B ships, so the model is the same function at every length; the explicit
    ``attention_factor``)."""
    if target_len <= orig_len:
        raise ValueError(f"a LongRoPE extension needs a target length above the original context {orig_len}, "
                         f"got {target_len}")
    f = [round(x, 6) for x in yarn_ramp_factors(head_dim, theta, orig_len, target_len)]
    return LongRoPEConfig(short_factor=f, long_factor=list(f), original_max_position_embeddings=orig_len,
                          attention_factor=round(extension_attention_factor(orig_len, target_len), 6))
