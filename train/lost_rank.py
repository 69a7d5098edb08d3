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


class Peers:
    """Host and pid of every rank (a collective: every rank builds it once, after the process group)."""

    def __init__(self):
        self.rank, self.host = dist.get_rank(), socket.gethostname()
        self.table: list = [None] * dist.get_world_size()
        dist.all_gather_object(self.table, (self.host, os.getpid()))

    def lost(self, wait_s: float = ROLL_CALL_S) -> dict[int, str]:
        """``{rank: how it is known lost}`` after a failed collective (no collective: the peers may be gone)."""
        out, remote = {}, []
        for r, (host, pid) in enumerate(self.table):
            if r != self.rank and host == self.host and not _alive(pid):
                out[r] = f"pid {pid} on {host} exited"
            elif r != self.rank and host != self.host:
                remote.append(r)
        if remote:
            out.update(self._roll_call(remote, wait_s))
        return out

    def _roll_call(self, ranks: list[int], wait_s: float) -> dict[int, str]:
        key = "nosa_roll_call/{}".format
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(key(self.rank), "here")
            deadline = time.monotonic() + wait_s
            missing = list(ranks)
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([key(r)])]
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store lived with a lost rank: nothing more to learn
            return {r: f"on {self.table[r][0]}, unknown (the rendezvous store is gone too)" for r in ranks}
        return {r: f"on {self.table[r][0]}, no answer within {wait_s:.0f}s" for r in missing}

    def reporter(self, lost: dict[int, str]) -> bool:
        """Whether this rank is the one that reports (the lowest rank not lost)."""
        return self.rank == min(r for r in range(len(self.table)) if r not in lost)


def lost_rank_line(lost: dict[int, str], step: int, exc: BaseException, newest_verified: str) -> str:
    """The one line a survivor prints: who was lost, at which step, where the run can resume from."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = first.split("] ", 1)[-1].split(". ")[0][:160]  # gloo prefixes its source location, appends advice
    who = "; ".join(f"rank {r} ({how})" for r, how in sorted(lost.items()))
    what = f"lost {who}" if lost else f"a collective failed and no rank is known lost ({first})"
    return (f"{what} during step {step}; {newest_verified}; launch again with the same run.dir to resume "
            f"(torchrun --max-restarts does so by itself)" + (f" [{first}]" if lost else ""))
