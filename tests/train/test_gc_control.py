"""``train.gc_interval``: manual garbage collection of the training loop (``train/gc_control.py``)."""

import gc

import pytest

from train.gc_control import GarbageCollection


def test_manual_mode_disables_automatic_gc_and_collects_every_n_steps(monkeypatch):
    calls = []
    real_collect = gc.collect
    assert gc.isenabled()
    frozen = gc.get_freeze_count()  # the test runner itself may have frozen objects
    with GarbageCollection(3) as col:
        monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
        assert not gc.isenabled() and gc.get_freeze_count() > frozen
        for step in range(1, 8):
            col.after_step(step)
        monkeypatch.setattr(gc, "collect", real_collect)
    assert len(calls) == 2  # steps 3 and 6
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0 if frozen == 0 else gc.get_freeze_count() >= frozen


def test_interval_zero_leaves_python_gc_alone(monkeypatch):
    # every call into the collector is recorded (comparing freeze counts is racy: a frozen object
    # that is freed leaves the permanent generation at any time)
    calls = []
    for name in ("collect", "freeze", "unfreeze", "disable", "enable"):
        monkeypatch.setattr(gc, name, lambda *a, name=name: calls.append(name) or 0)
    with GarbageCollection(0) as col:
        for step in range(1, 5):
            col.after_step(step)
    assert calls == [] and gc.isenabled()


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match="gc interval"):
        GarbageCollection(-1)
