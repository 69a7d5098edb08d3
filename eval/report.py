"""Writing eval outputs: atomic files (temp name, then rename), markdown tables, PNG plots.

Nothing is written before the results exist, and every file appears whole or not at all; files
the eval did not write are never touched. Plots need matplotlib; without it they are skipped
with a note (the JSON and markdown are always written).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through ``<path>.tmp-<pid>`` and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: Path, obj) -> Path:
    """JSON with non-finite floats as ``null``."""
    return write_atomic(path, json.dumps(_finite(obj), indent=2) + "\n")


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
    tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}.png")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return Path(path)
