"""``bench.gpu_clocks``: nvidia-smi lines parsed, samples summarised over a window, the sampler run
on a stand-in command; and ``bench.train_throughput``'s step arrival times that set the window."""

import subprocess
import sys
import time

from bench import gpu_clocks, train_throughput


def test_lines_are_parsed_and_others_skipped():
    parse = gpu_clocks.parse_line
    assert parse("0, 1980, 612.35, 61, 0x0000000000000004\n") == {
        "gpu": 0, "sm_mhz": 1980.0, "power_w": 612.35, "temp_c": 61.0, "reasons": 4}
    assert parse("index, clocks.current.sm [MHz], power.draw [W], temperature.gpu, reasons") is None
    assert parse("0, 1980, [N/A], 61, 0x0") is None
    assert parse("Failed to initialize NVML") is None


def test_summary_takes_the_step_windows_and_counts_slowdowns_but_not_idle():
    summarize = gpu_clocks.summarize
    row = lambda mhz, w, reasons, gpu=0: {"gpu": gpu, "sm_mhz": mhz, "power_w": w, "temp_c": 50.0 + w / 100,  # noqa: E731
                                          "reasons": reasons}
    samples = [(0.5, row(345, 80, 0x1)),  # idle, before the window
               (1.0, row(1980, 600, 0x0)), (2.0, row(1900, 700, 0x4)), (3.0, row(1800, 700, 0x4, gpu=1)),
               (4.0, row(1980, 650, 0x1 | 0x2)), (9.0, row(345, 80, 0x1))]
    s = summarize(samples, [(0.9, 2.0), (2.0, 3.0), (3.5, 4.0)])  # three steps; (3.0, 3.5] is no step's
    assert s["samples"] == 4 and s["gpus"] == 2
    assert s["sm_mhz_median"] == 1940.0 and s["sm_mhz_p10"] == 1800.0
    assert s["power_w_median"] == 675.0 and s["temp_c_max"] == 57.0
    assert s["slowdown_share"] == 0.5 and s["slowdown_reasons_seen"] == "0x4"
    assert summarize(samples, [(4.0, 8.0)]) is None and summarize(samples, []) is None
    paused = samples + [(3.2, row(1980, 90, 0x1))]  # the GPU idle between steps (a trace being written)
    assert summarize(paused, [(0.9, 2.0), (2.0, 3.0), (3.5, 4.0)]) == s


def test_the_sampler_keeps_stamped_rows_of_a_stand_in_command():
    script = "import time\nfor i in range(3):\n    print(f'0, {1900 + i}, 500, 60, 0x0', flush=True)\n" \
             "print('garbage', flush=True)\ntime.sleep(30)"
    t0 = time.time()
    with gpu_clocks.GpuSampler([sys.executable, "-c", script]) as gpu:
        deadline = time.time() + 20
        while len(gpu.samples) < 3 and time.time() < deadline:
            time.sleep(0.05)
    assert time.time() - t0 < 25  # leaving the block stopped the command
    assert [r["sm_mhz"] for _, r in gpu.samples] == [1900.0, 1901.0, 1902.0]
    assert all(t0 <= t <= time.time() for t, _ in gpu.samples)
    assert gpu_clocks.GpuSampler([]).__enter__().samples == []  # no nvidia-smi: nothing sampled


def test_step_arrivals_note_when_each_row_appears(tmp_path):
    arrivals = train_throughput.step_arrivals
    metrics = tmp_path / "metrics.jsonl"
    writer = "import json, sys, time\nfor s in (1, 2, 3):\n    time.sleep(0.4)\n" \
             "    open(sys.argv[1], 'a').write(json.dumps({'step': s}) + '\\n')\n" \
             "open(sys.argv[1], 'a').write('{\"step\": 4')\ntime.sleep(0.4)\nopen(sys.argv[1], 'a').write('}\\n')\n"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", writer, str(metrics)])
    got = arrivals(proc, metrics, timeout=60, poll_s=0.05)
    assert sorted(got) == [1, 2, 3, 4] and proc.returncode == 0
    assert t0 < got[1] < got[2] < got[3] < got[4] - 0.3  # a row counts once it is whole
    assert got[3] - got[1] > 0.5  # two sleeps of 0.4 s apart, seen as they came
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert arrivals(slow, tmp_path / "none.jsonl", timeout=0.5, poll_s=0.05) == {}
    assert slow.returncode is not None  # killed at the timeout
