"""The suite's CPU accounting (tests/cpu_time.py) counts waited-for child processes and lists the largest."""

import subprocess
import sys

from tests.cpu_time import cpu_seconds, summary_lines


def test_cpu_seconds_include_a_waited_for_child():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
    before = cpu_seconds()
    subprocess.run([sys.executable, "-c", busy], check=True)
    assert cpu_seconds() - before >= 0.5


def test_summary_lists_the_total_and_the_largest_first():
    rows = [(2.0, "call", "a"), (30.0, "setup", "b"), (8.0, "call", "c")]
    lines = summary_lines(rows, top=2)
    assert "40 s" in lines[0]
    assert [ln.split()[-1] for ln in lines[1:]] == ["b", "c"]
