"""A rank lost in the middle of a run (killed, crashed, its node gone): told apart from other errors and named.

A collective whose peer died fails: at once with gloo ("Connection reset by peer"), after
``cluster.dist_timeout_minutes`` with NCCL or a hung peer. :class:`Peers` records every rank's host
and pid when the run starts; when a collective fails, :meth:`Peers.lost` names the ranks that are
gone: on this host the processes that exited; on other hosts those that do not answer a roll call
through the process group's store within a few seconds (the survivors all answer it, each as it
meets the failure). The lowest surviving rank reports it in one line; ``torchrun --max-restarts=N``
then restarts the job, which resumes from the newest verified checkpoint.
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

# text of the errors of a collective whose peer is gone (gloo, NCCL, torch's store / watchdog)
_MARKERS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "Broken pipe",
            "Timed out waiting", "NCCL error", "NCCL communicator", "DistNetworkError", "DistBackendError")
ROLL_CALL_S = 5.0  # how long the survivors wait for each other's answer


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a failed collective rather than a bug or bad input."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, getattr(dist, "DistError", ())) or any(m in str(e) for m in _MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (an exited child not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _answered(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 - a store that went away meanwhile: no answer
        return False


class Peers:
    """Host and pid of every rank (a collective: every rank builds it once, after the process group)."""

    def __init__(self):
        self.rank, self.host = dist.get_rank(), socket.gethostname()
        self.table: list = [None] * dist.get_world_size()
        dist.all_gather_object(self.table, (self.host, os.getpid()))

    def lost(self, wait_s: float = ROLL_CALL_S) -> dict[int, str]:
        """``{rank: how it is known lost}`` after a failed collective (no collective: the peers may be gone).

        Polls until a rank of this host has exited (a killed process closes its sockets before it is gone)
        and every rank of another host has answered the roll call, or ``wait_s`` passes."""
        local = {r: pid for r, (host, pid) in enumerate(self.table) if r != self.rank and host == self.host}
        remote = [r for r, (host, _) in enumerate(self.table) if host != self.host]
        store, key = None, "nosa_roll_call/{}".format
        if remote:
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(key(self.rank), "here")
            except Exception:  # noqa: BLE001 - the store lived with a lost rank: nothing to learn from it
                store = None
        deadline = time.monotonic() + wait_s
        while True:
            gone = {r: f"pid {pid} on {self.host} exited" for r, pid in local.items() if not _alive(pid)}
            silent = list(remote) if store is None else [r for r in remote if not _answered(store, key(r))]
            if (gone and not silent) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        how = f"no answer within {wait_s:.0f}s" if store is not None else "unknown (the rendezvous store is gone too)"
        return {**gone, **{r: f"on {self.table[r][0]}, {how}" for r in silent}}

    def reporter(self, lost: dict[int, str]) -> bool:
        """Whether this rank is the one that reports (the lowest rank not lost)."""
        return self.rank == min(r for r in range(len(self.table)) if r not in lost)


def lost_rank_line(lost: dict[int, str], step: int, exc: BaseException, newest_verified: str) -> str:
    """The one line a survivor prints: who was lost after which completed ``step``, where the run can resume from."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = first.split("] ", 1)[-1].split(". ")[0][:160]  # gloo prefixes its source location, appends advice
    who = "; ".join(f"rank {r} ({how})" for r, how in sorted(lost.items()))
    what = f"lost {who}" if lost else f"a collective failed and no rank is known lost ({first})"
    return (f"{what} after step {step}; {newest_verified}; launch again with the same run.dir to resume "
            f"(torchrun --max-restarts does so by itself)" + (f" [{first}]" if lost else ""))
