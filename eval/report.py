"""Eval outputs: markdown tables and PNG plots (files through ``runtime.outputs``: whole or not at all).

Nothing is written before the results exist; files the eval did not write are never touched. Plots need
matplotlib; without it they are skipped with a note (the JSON and markdown are always written).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from runtime.outputs import atomic_path


def fmt(x, digits: int = 3) -> str:
    """A table cell: floats rounded, None as ``-``."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        if abs(x) >= 1e5:
            return f"{x:.3g}"
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_plot(path: Path, draw: Callable, figsize=(7.5, 4.2)) -> Optional[Path]:
    """Call ``draw(fig)`` on a new figure (it adds its own axes) and save it atomically as a PNG;
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: {Path(path).name} skipped)")
        return None
    fig = plt.figure(figsize=figsize)
    draw(fig)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return Path(path)
