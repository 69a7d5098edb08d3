"""Initial LongRoPE factors for a context extension, printed as the recipe's ``model.longrope`` block.

LongRoPE searches per-frequency rescale factors; its search starts from interpolation rules such
as YaRN's "NTK-by-parts" ramp, which is what this emits (short = long factors, as NOSA-8B ships):

    ratio_i = orig_len / wavelength_i,   wavelength_i = 2*pi * theta^(2i/D)
    gamma_i = clamp((ratio_i - alpha) / (beta - alpha), 0, 1)
    factor_i = 1 / ((1 - gamma_i) / s + gamma_i),   s = target_len / orig_len

so high frequencies (many periods inside the original context) keep factor 1 and low frequencies
are interpolated by s. ``attention_factor = sqrt(1 + ln(s) / ln(orig_len))`` is written explicitly.

    python -m train.longrope_init --head-dim 128 --theta 500000 --orig 4096 --target 16384
"""

from __future__ import annotations

import argparse
import math


def yarn_ramp_factors(head_dim: int, theta: float, orig_len: int, target_len: int,
                      alpha: float = 1.0, beta: float = 32.0) -> list[float]:
    """``head_dim // 2`` factors (one per rotary frequency, dividing ``inv_freq``)."""
    s = target_len / orig_len
    out = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / head_dim)
        gamma = min(1.0, max(0.0, (orig_len / wavelength - alpha) / (beta - alpha)))
        out.append(1.0 / ((1.0 - gamma) / s + gamma))
    return out


def attention_factor(orig_len: int, target_len: int) -> float:
    s = target_len / orig_len
    return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(orig_len))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--theta", type=float, required=True)
    p.add_argument("--orig", type=int, required=True, help="original (pretraining) context length")
    p.add_argument("--target", type=int, required=True, help="extended context length")
    a = p.parse_args(argv)
    f = [round(x, 6) for x in yarn_ramp_factors(a.head_dim, a.theta, a.orig, a.target)]
    print("model:\n  rope_type: longrope\n  longrope:")
    print(f"    short_factor: {f}\n    long_factor: {f}")
    print(f"    original_max_position_embeddings: {a.orig}")
    print(f"    attention_factor: {attention_factor(a.orig, a.target):.6f}")


if __name__ == "__main__":
    main()
