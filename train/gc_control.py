"""Python garbage-collection policy of the training loop (``train.gc_interval``).

Python's automatic collector runs a full (generation-2) pass whenever enough container objects
have survived; on a large model that pass can take ~1 s, and it lands on whatever host code runs
then, so the GPU waits for kernel launches (and with several ranks, the other ranks wait at the
next collective). Manual mode, as Megatron-LM's ``--manual-gc``: freeze the objects built during
setup (model, optimizer, data) out of the collector, disable automatic collection, and run one
full collection every ``interval`` steps, at the same step on every rank.
"""

from __future__ import annotations

import gc
from typing import Self


class GarbageCollection:
    """``interval`` 0: Python's automatic GC (nothing changes); N > 0: manual, every N steps."""

    def __init__(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"gc interval must be >= 0, got {interval}")
        self.interval = interval
        self._was_enabled = gc.isenabled()
        self._frozen_before = gc.get_freeze_count()

    def __enter__(self) -> Self:
        if self.interval:
            gc.collect()
            gc.freeze()  # setup objects: never scanned again
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Call after optimizer step ``step`` (1-based): a full collection every ``interval`` steps."""
        if self.interval and step % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.interval:
            if not self._frozen_before:  # unfreeze only what this object froze (freezing is global)
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()
