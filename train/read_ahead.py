"""The train loader's batches one optimizer step at a time, with the next step's read ahead.

A training step ends with host reads of its results (loss, finiteness checks), which wait for the
GPU. Reading the next step's batches after them (dataset reads, packing, on the host) leaves the
GPU idle; reading them right after the step's work is queued overlaps that host work with the GPU.
A checkpoint must not count batches read ahead, so :meth:`StepBatches.state_dict` is the loader's
state from before them, and a resume reads them again. A read that fails ahead of time raises at
the step that needs its data, as it would without reading ahead.
"""

from __future__ import annotations


class StepBatches:
    """``per_step`` batches of ``loader`` per optimizer step (``loader``: an iterator of CPU batches
    with ``state_dict()``)."""

    def __init__(self, loader, per_step: int):
        self.loader, self.per_step = loader, per_step
        self._ahead = None  # (the next step's batches, or the error reading them; loader state before them)

    def take(self) -> list:
        """This step's batches: those read ahead during the previous step, if any, else read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return [next(self.loader) for _ in range(self.per_step)]
        if isinstance(ahead[0], BaseException):
            raise ahead[0]
        return ahead[0]

    def read_ahead(self) -> None:
        """Read the next step's batches now (call it once the step's GPU work is queued)."""
        if self._ahead is not None:
            raise RuntimeError("the next step's batches were already read ahead")
        state = self.loader.state_dict()
        try:
            batches = [next(self.loader) for _ in range(self.per_step)]
        except Exception as e:  # noqa: BLE001 - raised by take() at the step that needs the data
            batches = e
        self._ahead = (batches, state)

    def state_dict(self) -> dict:
        """The loader's state after the batches of the steps taken (none read ahead)."""
        return self._ahead[1] if self._ahead is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume the loader at ``state``; batches read ahead from the old position are dropped."""
        self._ahead = None
        self.loader.load_state_dict(state)
