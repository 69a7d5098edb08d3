"""Median device time of a GPU callable, whatever the installed triton's ``do_bench`` returns.

``triton.testing.do_bench`` returned a list for ``quantiles=[0.5]`` in older releases and a float in
triton 3.6; ``return_mode="median"`` is a float in every release that has it (3.0 and newer), and
:func:`median_ms` coerces a sequence too, so a benchmark never indexes a float.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def median_ms(fn: Callable[[], object], warmup_ms: int = 10, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn`` on the current CUDA device (``do_bench``: CUDA events, warm-up first)."""
    from triton.testing import do_bench

    return as_ms(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def as_ms(value: float | Sequence[float]) -> float:
    """``do_bench``'s result as one float (the first entry of a sequence)."""
    if isinstance(value, Sequence):
        if not value:
            raise ValueError("do_bench returned no timing")
        value = value[0]
    return float(value)
