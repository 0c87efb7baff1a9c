"""When a server applies a worker's gradient, and when the worker may go on: the four modes.

A server keeps one *version* (updates applied so far). A worker computes a gradient on the
parameters of some version, the gradient's *tag*, writes it into its gradient slot on the
server and calls ``push``; the call returns when the worker may pull and compute again, with
the version it will then see. What happens in between is the consistency mode:

``sync``    Rounds: the gradients of every live worker for version v are averaged and applied
            together, making version v+1; every ``push`` returns when its round is applied.
            A worker that dies ends the job with an error (a round could never complete).
``backup``  Project Adam's and Chen et al.'s backup workers: a round closes as soon as the
            first ``k`` gradients for version v arrived (``k`` of N workers); those are
            averaged and applied; a gradient that arrives for a closed round is *dropped*
            (counted, never applied) and its worker simply pulls the newest parameters.
``async``   Downpour/Hogwild: each gradient is applied on arrival, whatever version it was
            computed on; nobody waits. *Staleness* = versions applied since the gradient's tag.
``ssp``     Stale-synchronous parallel (Ho et al., 2013) with bound ``s``: applied on arrival
            as in ``async``, but a worker's ``push`` returns only when its clock (gradients it
            pushed) is at most ``s`` ahead of the slowest live worker's. ``s = 0`` is lockstep.

Worked example, ``backup`` with N = 4, k = 3, version 7: workers 2, 0 and 3 push tag 7; on
worker 3's push the round closes, (g2 + g0 + g3) / 3 is applied and version 8 is published;
workers 2, 0, 3 get ``{"version": 8, "applied": True}``. Worker 1, three times slower, then
pushes tag 7: dropped, ``{"version": 8, "applied": False}`` at once, and it pulls version 8.

In ``async`` and ``backup`` (and ``ssp``, whose bound is over *live* workers) a worker that
dies is dropped and training goes on; a worker that leaves cleanly (``bye``) is dropped in
every mode. ``Clock`` holds this state; the server calls it from its serving threads with the
function that really applies an update, and reads its counters.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from ..errors import GradsyncTimeoutError, PeerLostError

__all__ = ["MODES", "Clock"]

MODES = ("sync", "backup", "async", "ssp")


class Clock:
    """The consistency state of one server.

    Args:
        mode: one of ``MODES``.
        workers: number of workers N.
        backup: ``backup`` mode's k (gradients per round), 1 <= k <= N.
        staleness: ``ssp`` mode's bound s >= 0.
        apply: ``apply(workers, average)`` applies the gradients in the slots of ``workers``
            (their average when ``average``); called with the state lock held, so updates
            never overlap.
        timeout: seconds a push may wait for the others before GradsyncTimeoutError.
    """

    def __init__(self, mode: str, workers: int, apply: Callable[[Sequence[int], bool], None],
                 backup: int | None = None, staleness: int | None = None,
                 timeout: float = 300.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        if mode == "backup" and not (backup is not None and 1 <= backup <= workers):
            raise ValueError(f"backup mode needs 1 <= backup <= {workers} workers, got {backup}")
        if mode == "ssp" and not (staleness is not None and staleness >= 0):
            raise ValueError(f"ssp mode needs a staleness bound >= 0, got {staleness}")
        self.mode, self.workers = mode, workers
        # Only backup mode reads k, only ssp reads s: both checked above for their mode.
        self.k: int = backup if backup is not None else workers
        self.s: int = staleness if staleness is not None else 0
        self._apply, self.timeout = apply, timeout
        self._cv = threading.Condition()
        self.version = 0
        self.live = set(range(workers))
        self.clocks = [0] * workers
        self._arrived: list[int] = []
        self.failure: Exception | None = None
        self.applied = 0          # gradients applied (a round of k counts k)
        self.dropped = 0          # gradients that arrived too late (backup)
        self.max_staleness = 0    # most versions between a gradient's tag and its application
        self.max_clock_gap = 0    # ssp: most clocks a released worker was ahead of the slowest
        self.lost: list[int] = []  # workers that died
        self.done = [0] * workers  # per worker: the seq of its last applied push

    # ------------------------------------------------------------------ pushes
    @property
    def lock(self) -> threading.Condition:
        """The state lock: held while an update is applied (a checkpoint or a copy taken
        under it sees no update half-done)."""
        return self._cv

    def push(self, worker: int, tag: int, seq: int | None = None) -> dict:
        """Worker ``worker``'s gradient, computed on version ``tag``, is in its slot.

        ``seq`` numbers the worker's pushes from 1: a push sent again to a new primary after
        a failover (replication.py) that this copy has already applied is answered, not
        applied twice.

        Returns ``{"version": v, "applied": bool}`` once the worker may pull version ``v``.
        Raises PeerLostError when the job cannot go on (``sync`` lost a worker).
        """
        with self._cv:
            self._check(worker)
            if seq is not None and seq <= self.done[worker]:
                if self.mode == "ssp":
                    self._wait(lambda: self._gap(worker) <= self.s)
                return {"version": self.version, "applied": True}
            if tag > self.version or tag < 0:
                raise ValueError(f"worker {worker} pushed a gradient of version {tag}, but this "
                                 f"server is at version {self.version}")
            self.clocks[worker] = seq if seq is not None else self.clocks[worker] + 1
            if self.mode in ("async", "ssp"):
                self._update([worker], tag, average=False)
                if self.mode == "ssp":
                    self._wait(lambda: self._gap(worker) <= self.s)
                    self.max_clock_gap = max(self.max_clock_gap, self._gap(worker))
                return {"version": self.version, "applied": True}
            if tag < self.version:  # backup: its round closed without it
                self.dropped += 1
                return {"version": self.version, "applied": False}
            self._arrived.append(worker)
            self._maybe_close()
            self._wait(lambda: self.version > tag)
            return {"version": self.version, "applied": True}

    def _needed(self) -> int:
        return len(self.live) if self.mode == "sync" else min(self.k, len(self.live))

    def _maybe_close(self) -> None:
        """Applies the open round if enough of its gradients are in (sync, backup)."""
        arrived = [w for w in self._arrived if w in self.live]
        if arrived and len(arrived) >= self._needed():
            self._arrived = []
            self._update(arrived, self.version, average=True)

    def _update(self, workers: list[int], tag: int, average: bool) -> None:
        self.max_staleness = max(self.max_staleness, self.version - tag)
        self._apply(workers, average)
        self.applied += len(workers)
        self.version += 1
        for w in workers:
            self.done[w] = self.clocks[w]
        self._cv.notify_all()

    def follow(self, version: int, workers: list[int], state: dict, apply) -> None:
        """A backup's copy of its primary's update: ``apply()`` runs it, and this clock takes
        the primary's state after it (``state``: ``clocks``, ``done``, counters).

        Raises:
            ValueError: ``version`` is not this copy's (an update missed or repeated).
        """
        with self._cv:
            if version != self.version:
                raise ValueError(f"an update of version {version} reached a copy at version "
                                 f"{self.version}")
            apply()
            self.version += 1
            self.applied += len(workers)
            self.clocks = [int(c) for c in state["clocks"]]
            self.done = [int(d) for d in state["done"]]
            self.dropped = int(state["dropped"])
            self.max_staleness = int(state["max_staleness"])
            self.max_clock_gap = int(state["max_clock_gap"])
            self._cv.notify_all()

    _COPIED = ("version", "clocks", "done", "applied", "dropped", "max_staleness",
               "max_clock_gap", "lost")

    def snapshot(self) -> dict:
        """Everything a replacement copy needs to continue as this one (under the lock)."""
        with self._cv:
            out = {k: getattr(self, k) for k in self._COPIED}
            return {**out, "live": sorted(self.live)}

    def install(self, snap: dict) -> None:
        """Continues from another copy's ``snapshot``."""
        with self._cv:
            for k in self._COPIED:
                setattr(self, k, snap[k])
            self.live = set(snap["live"])
            self._cv.notify_all()

    def replica_state(self) -> dict:
        """What ``follow`` needs from the primary (called under the lock, in an update)."""
        return {"clocks": list(self.clocks), "done": list(self.done), "dropped": self.dropped,
                "max_staleness": self.max_staleness, "max_clock_gap": self.max_clock_gap}

    def _gap(self, worker: int) -> int:
        return self.clocks[worker] - min(self.clocks[w] for w in self.live | {worker})

    def _wait(self, ready: Callable[[], bool]) -> None:
        end = time.monotonic() + self.timeout
        while not ready():
            self._check()
            left = end - time.monotonic()
            if left <= 0:
                raise GradsyncTimeoutError(
                    f"a {self.mode} push waited {self.timeout:.0f}s for the other workers "
                    f"(live: {sorted(self.live)}, clocks: {self.clocks})")
            self._cv.wait(min(left, 1.0))
        self._check()

    def _check(self, worker: int | None = None) -> None:
        if self.failure is not None:
            raise self.failure
        if worker is not None and worker not in self.live:
            raise ValueError(f"worker {worker} has left this server")

    # ------------------------------------------------------------------ leaving
    def leave(self, worker: int, died: bool) -> None:
        """Worker ``worker`` is gone: ``died`` (connection lost) or said goodbye."""
        with self._cv:
            if worker not in self.live:
                return
            self.live.discard(worker)
            if died:
                self.lost.append(worker)
                if self.mode == "sync" and self.live:
                    self.failure = PeerLostError(
                        f"worker {worker} was lost; sync mode needs every worker in every round "
                        f"(backup, async and ssp modes go on without it)", peer=worker)
            if self.failure is None and self.mode in ("sync", "backup"):
                self._maybe_close()
            self._cv.notify_all()

    def counters(self) -> dict:
        with self._cv:
            return {"mode": self.mode, "version": self.version, "applied": self.applied,
                    "dropped": self.dropped, "max_staleness": self.max_staleness,
                    "max_clock_gap": self.max_clock_gap, "clocks": list(self.clocks),
                    "live": sorted(self.live), "lost": list(self.lost)}

    def state(self) -> dict:
        """What a checkpoint keeps (the version and the clocks)."""
        with self._cv:
            return {"version": self.version, "clocks": list(self.clocks)}

    def restore(self, state: dict) -> None:
        with self._cv:
            if len(state["clocks"]) != self.workers:
                raise ValueError(f"the checkpoint has clocks of {len(state['clocks'])} workers, "
                                 f"this job has {self.workers}")
            self.version, self.clocks = int(state["version"]), [int(c) for c in state["clocks"]]
            self.done = list(self.clocks)  # every push before a checkpoint was decided
