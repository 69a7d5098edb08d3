"""runtime.heap_reuse: inside the block glibc serves large blocks from the heap and keeps freed memory; after
it, glibc's defaults are back and the kept memory is returned, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from runtime import heap_reuse


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_settings_inside_and_defaults_after(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(heap_reuse, "_glibc", lambda: libc)
    with pytest.raises(RuntimeError):
        with heap_reuse.reused_heap():
            assert libc.calls == [("mallopt", heap_reuse.M_MMAP_MAX, 0),
                                  ("mallopt", heap_reuse.M_TRIM_THRESHOLD, heap_reuse.KEEP_BYTES)]
            raise RuntimeError("the forward failed")
    assert libc.calls[2:] == [("mallopt", heap_reuse.M_MMAP_MAX, heap_reuse.DEFAULT_MMAP_MAX),
                              ("mallopt", heap_reuse.M_TRIM_THRESHOLD, heap_reuse.DEFAULT_TRIM_THRESHOLD),
                              ("malloc_trim", 0)]


def test_without_glibc_nothing_is_touched(monkeypatch):
    monkeypatch.setattr(heap_reuse, "_glibc", lambda: None)
    with heap_reuse.reused_heap():
        x = torch.ones(1 << 20)
    assert float(x.sum()) == 1 << 20

