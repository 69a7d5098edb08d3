"""SM clock, power and temperature of the GPUs while a benchmark runs (``nvidia-smi`` sampled in the
background), summarised over a time window: whether two runs compared in one table ran at the same
clocks. Two runs with the same matrix products at different speeds (e.g. a power-limited GPU
lowering its clock under a heavier kernel mix) show it here.

Only reads: it never changes a clock, power limit or any other setting of the GPU.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

FIELDS = ("index", "clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# active clock-event reasons that are not a slowdown: none (0x0), GPU idle (0x1), application clocks (0x2)
BENIGN_REASONS = 0x1 | 0x2


def smi_command(period_ms: int = 200) -> list[str] | None:
    """The ``nvidia-smi`` query that ``GpuSampler`` runs, or ``None`` where there is no nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    return [exe, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits", f"-lms={period_ms}"]


def parse_line(line: str) -> dict | None:
    """One CSV line of ``smi_command``'s output as ``{gpu, sm_mhz, power_w, temp_c, reasons}``;
    ``None`` for a line that is not one (a header, an error, a field the GPU reports as N/A)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return {"gpu": int(parts[0]), "sm_mhz": float(parts[1]), "power_w": float(parts[2]),
                "temp_c": float(parts[3]), "reasons": int(parts[4], 16)}
    except ValueError:
        return None


def summarize(samples: list[tuple[float, dict]], windows: list[tuple[float, float]]) -> dict | None:
    """Median SM clock (MHz) and power (W), the SM clock's 10th percentile, the highest temperature and
    the share of samples with a slowdown reason active (power or thermal cap, ...: any reason but
    idle / application clocks), over the samples taken inside the ``(start, end]`` windows (host
    ``time.time()``; e.g. one per measured step, so that pauses between them such as a profiler
    writing its trace, with the GPU idle at full clock and low power, stay out) on every GPU; ``None``
    if there is none."""
    rows = [r for t, r in samples if any(start < t <= end for start, end in windows)]
    if not rows:
        return None
    clocks = sorted(r["sm_mhz"] for r in rows)
    return {"samples": len(rows), "gpus": len({r["gpu"] for r in rows}),
            "sm_mhz_median": statistics.median(clocks), "sm_mhz_p10": clocks[len(clocks) // 10],
            "power_w_median": round(statistics.median(r["power_w"] for r in rows), 1),
            "temp_c_max": max(r["temp_c"] for r in rows),
            "slowdown_share": round(sum(bool(r["reasons"] & ~BENIGN_REASONS) for r in rows) / len(rows), 3),
            "slowdown_reasons_seen": hex(_or(r["reasons"] & ~BENIGN_REASONS for r in rows))}


def _or(values) -> int:
    out = 0
    for v in values:
        out |= v
    return out


class GpuSampler:
    """Context manager: runs ``cmd`` (default ``smi_command()``) and keeps every parsed line with the
    host time it arrived (``samples``: ``[(time.time(), row)]``). Without nvidia-smi it samples
    nothing; the benchmark goes on either way."""

    def __init__(self, cmd: list[str] | None = None):
        self.cmd = cmd if cmd is not None else smi_command()
        self.samples: list[tuple[float, dict]] = []
        self._proc = None
        self._thread = None

    def __enter__(self) -> GpuSampler:
        if self.cmd:
            self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            row = parse_line(line)
            if row is not None:
                self.samples.append((time.time(), row))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)
