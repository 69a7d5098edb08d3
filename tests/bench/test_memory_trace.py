"""``bench.memory_trace``: the peak of a replayed allocator trace and its attribution to lines."""

from __future__ import annotations

import random

import pytest

from bench import memory_trace as m


def _frames(line: int) -> list[dict]:
    return [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/repo/model.py", "line": line, "name": f"f{line}"}]


def test_peak_and_live_blocks_of_a_known_trace():
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames(20)},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet back in the pool
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": _frames(30)},  # peak: 50 + 120
        {"action": "free_completed", "addr": 99, "size": 1000},  # allocated before the trace: ignored
        {"action": "free_completed", "addr": 3, "size": 120},
        {"action": "alloc", "addr": 1, "size": 10, "frames": _frames(10)},  # address reused
    ]
    peak, live = m.peak_allocations(ev)
    assert peak == 170
    assert sorted(b["addr"] for b in live) == [2, 3]
    sites = m.top_sites(live)
    assert [s["site"] for s in sites] == ["model.py:30 f30", "model.py:20 f20"]
    assert sites[0]["blocks"] == 1 and sites[0]["mib"] == round(120 / 2**20, 3)


def test_peak_equals_brute_force_on_random_traces():
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    for _ in range(20):
        ev, live, addr = [], {}, 0
        for _ in range(rng.randrange(1, 200)):
            if live and rng.random() < 0.45:
                a = rng.choice(sorted(live))
                ev.append({"action": "free_completed", "addr": a, "size": live.pop(a)})
            else:
                addr += 1
                size = rng.randrange(1, 1000)
                live[addr] = size
                ev.append({"action": "alloc", "addr": addr, "size": size, "frames": _frames(addr % 7)})
        start = rng.choice([0, rng.randrange(len(ev) + 1)])
        # brute force: live bytes after every prefix of at least ``start`` events
        best, best_live, cur = None, set(), {}
        for n in range(len(ev) + 1):
            if n:
                e = ev[n - 1]
                if e["action"] == "alloc":
                    cur[e["addr"]] = e["size"]
                else:
                    cur.pop(e["addr"])
            if n >= start and (best is None or sum(cur.values()) > best):
                best, best_live = sum(cur.values()), set(cur)
        peak, blocks = m.peak_allocations(ev, start=start)
        assert peak == best, (seed, start)
        assert {b["addr"] for b in blocks} == best_live, (seed, start)


def test_peak_after_a_mark_counts_what_was_built_before_it():
    ev = [
        {"action": "alloc", "addr": 1, "size": 1000, "frames": _frames(1)},  # set-up transient
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames(2)},  # kept (a cache)
        {"action": "free_completed", "addr": 1, "size": 1000},
        # mark: the measured stretch starts here
        {"action": "alloc", "addr": 3, "size": 40, "frames": _frames(3)},
        {"action": "free_completed", "addr": 3, "size": 40},
    ]
    assert m.peak_allocations(ev)[0] == 1300
    peak, live = m.peak_allocations(ev, start=3)
    assert peak == 340 and sorted(b["addr"] for b in live) == [2, 3]
    peak, live = m.peak_allocations(ev, start=len(ev))
    assert peak == 300 and [b["addr"] for b in live] == [2]


def test_site_skips_torch_frames_and_record_needs_cuda():
    assert m.site(_frames(5)) == "model.py:5 f5"
    assert m.site(_frames(5)[:1]) == "(no Python frame outside torch)"
    with pytest.raises(RuntimeError, match="CUDA"):
        m.record(lambda: None, device="cpu")
