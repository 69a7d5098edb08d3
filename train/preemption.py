"""Save-and-exit on a signal (preemption, SLURM's time limit), agreed by all ranks at a step boundary.

The handler only records which signal arrived; the trainer asks :meth:`StopSignal.agreed` after
every optimizer step. That call all-reduces (MAX) the flag over the whole world, so every rank
sees the signal at the same step even when it reached one rank only (e.g. SLURM signalling one
node), and all of them save the same checkpoint and stop. The same idea as megatron-LM's
``DistributedSignalHandler`` (``megatron.training``), which all-gathers the flags; this one
handles several signals and costs one scalar all-reduce per step.
"""

from __future__ import annotations

import signal

import torch

from train.metrics import max_over_ranks


class StoppedWhileStarting(KeyboardInterrupt):
    """A save signal arrived before the training steps began (nothing to save): the start is abandoned."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interruption(e: KeyboardInterrupt) -> str:
    """``interrupted`` (Ctrl-C) or ``SIGTERM received`` (a save signal before the steps began)."""
    return f"{e} received" if isinstance(e, StoppedWhileStarting) else "interrupted"


class StopSignal:
    """Record ``signals`` (names such as ``"SIGTERM"``) instead of dying; restore on :meth:`release`.

    Until :meth:`arm` (``armed=False``: the trainer arms it when its steps begin) such a signal raises
    :class:`StoppedWhileStarting` at once instead: whatever the start waits on (a build, a load, a lock,
    data that never fills a sample), there is nothing to save yet."""

    def __init__(self, signals: list[str], device: torch.device, armed: bool = True):
        self.device = device
        self.armed = armed
        self.received: str | None = None  # the first signal this process got
        self._previous = {}
        for name in signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._record)

    def arm(self) -> None:
        """From now on a signal is recorded and acted on at a step boundary (:meth:`agreed`)."""
        self.armed = True

    def _record(self, signum, frame) -> None:
        if not self.armed:
            raise StoppedWhileStarting(signum)
        if self.received is None:
            self.received = signal.Signals(signum).name

    def agreed(self) -> str | None:
        """The signal name if any rank got one (collective: every rank calls this at the same step)."""
        if not self._previous:
            return None
        if max_over_ranks(0.0 if self.received is None else 1.0, self.device) == 0.0:
            return None
        return self.received or "a signal on another rank"

    def release(self) -> None:
        """Put the previous handlers back (a signal after the run ends acts as usual)."""
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous = {}

    def __enter__(self) -> StopSignal:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.release()
