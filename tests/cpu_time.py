"""CPU seconds per test phase, for finding what makes the suite slow on a small machine.

Wall-clock durations (``--durations``) mislead on 2 busy cores: a test's wall time is mostly the
other worker's load. CPU time is this process's plus that of every child it waited for (trainer
launches, torchrun ranks), so a test that starts 9 processes shows their cost.
"""

from __future__ import annotations

import resource


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its waited-for descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def summary_lines(rows: list[tuple[float, str, str]], top: int) -> list[str]:
    """``rows`` of (cpu_s, phase, nodeid): the total and the ``top`` largest, one line each."""
    total = sum(r[0] for r in rows)
    lines = [f"CPU time of all test phases: {total:.0f} s ({total / 60:.1f} min); largest {top}:"]
    lines += [f"{cpu:8.1f}s {phase:8s} {nodeid}" for cpu, phase, nodeid in sorted(rows, reverse=True)[:top]]
    return lines
