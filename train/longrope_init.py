"""Initial LongRoPE factors for a context extension, printed as the recipe's ``model.longrope`` block.

LongRoPE searches per-frequency rescale factors; its search starts from interpolation rules such
as YaRN's "NTK-by-parts" ramp, which is what this emits (short = long factors, as NOSA-8B ships):

    ratio_i = orig_len / wavelength_i,   wavelength_i = 2*pi * theta^(2i/D)
    gamma_i = clamp((ratio_i - alpha) / (beta - alpha), 0, 1)
    factor_i = 1 / ((1 - gamma_i) / s + gamma_i),   s = target_len / orig_len

so high frequencies (many periods inside the original context) keep factor 1 and low frequencies
are interpolated by s. ``attention_factor = sqrt(1 + ln(s) / ln(orig_len))`` is written explicitly,
and ``max_position_embeddings`` is the target length.

Short context. ``short_factor`` applies up to ``orig_len`` tokens and ``long_factor`` past it (this framework
and transformers switch by the length of the forward pass); the attention factor scales cos / sin at every
length. With ``--short ramp`` (default; short = long, as NOSA-8B ships) the factors change the model at
short context too, which the output says. ``--short original`` writes ``short_factor`` = 1 and
``attention_factor`` = 1, so the model up to ``orig_len`` tokens is the source model and only longer
passes run the ramp. The released NOSA code (``to_hf --format reference``) applies ``short_factor`` at
every length, so a model for that layout needs ``--short ramp``.

    python -m train.longrope_init --head-dim 128 --theta 500000 --orig 4096 --target 16384
"""

from __future__ import annotations

import argparse

from nosa_layers.rope.longrope import extension_attention_factor as attention_factor
from nosa_layers.rope.longrope import yarn_ramp_factors

__all__ = ["attention_factor", "yarn_ramp_factors", "block", "main"]  # the ramp itself: nosa_layers.rope.longrope


def block(head_dim: int, theta: float, orig: int, target: int, short: str = "ramp") -> str:
    """The recipe's ``model:`` block (YAML) with the notes on what changes at short context as comments."""
    ramp = [round(x, 6) for x in yarn_ramp_factors(head_dim, theta, orig, target)]
    original = short == "original"
    short_f = [1.0] * len(ramp) if original else ramp
    att = 1.0 if original else round(attention_factor(orig, target), 6)
    scaled = sum(f != 1.0 for f in ramp)
    if original:
        note = (f"# up to {orig} tokens these factors give the source model's RoPE (short_factor = 1, attention_factor "
                f"= 1); past {orig} tokens {scaled} of {len(ramp)} rotary frequencies are rescaled (long_factor). The "
                f"released NOSA code (to_hf --format reference) uses short_factor at every length: use --short ramp "
                f"for such a model")
    else:
        note = (f"# these factors change the model at short context too: {scaled} of {len(ramp)} rotary frequencies "
                f"are rescaled and cos / sin scaled by {att:g} at every length (the loss before any step is not the "
                f"source model's); --short original keeps the source model up to {orig} tokens")
    return "\n".join([note, "model:", f"  max_position_embeddings: {target}", "  rope_type: longrope", "  longrope:",
                      f"    short_factor: {short_f}", f"    long_factor: {ramp}",
                      f"    original_max_position_embeddings: {orig}", f"    attention_factor: {att:.6f}"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.longrope_init", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--theta", type=float, required=True, help="the model's rope_theta")
    p.add_argument("--orig", type=int, required=True, help="original (pretraining) context length")
    p.add_argument("--target", type=int, required=True, help="extended context length (max_position_embeddings)")
    p.add_argument("--short", default="ramp", choices=["ramp", "original"],
                   help="short_factor: the ramp at every length (default; changes the model at short context too) "
                        "or 1 with attention_factor 1 (the source model up to --orig tokens)")
    a = p.parse_args(argv)
    print(block(a.head_dim, a.theta, a.orig, a.target, a.short))


if __name__ == "__main__":
    main()
