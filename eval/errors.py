"""One-line errors of the eval commands. A bad input raises :class:`EvalError` whose message names
the fix; the CLIs run through ``runtime.cli.run_cli``, which prints
``<prog>: error: <message>`` and exits with status 2 (no traceback)."""

from __future__ import annotations


class EvalError(ValueError):
    """Missing checkpoint, wrong data path, tokenizer mismatch, length above the model's context,
    unknown variant or task: the message says what to change."""


def int_list(text: str, option: str) -> list[int]:
    """``"4096,8192"`` -> ``[4096, 8192]``; anything else is an :class:`EvalError` naming ``option``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"{option} {text!r}: give comma-separated whole numbers of tokens, like 4096,8192") from None
