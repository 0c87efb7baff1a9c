"""How the host segment's ranks meet: arrivals, waits on the counters, and why it is safe.

Every road of ``ShmGroup`` (``host_segment.py``) is built from the same few steps, which this
module holds as ``SegmentRank``, the base of every part of the group: one rank's hold on the
segment (its control lines and slots, laid out as ``segment_layout.py`` says), ``_arrive``
(publish what this rank issued at a piece and its arrival, wait until every other rank has
arrived, check that all issued the same collective), ``_publish`` and ``_wait`` on one
counter, and the mark that a failed collective leaves. The roads differ only in what they copy
and fold between these steps (``host_segment.py``, ``segment_small.py``,
``segment_shared.py``).

Why two slots suffice. Every read of a parity-p buffer for piece k (another rank reading my
slot in step 2 or 3 of piece k: ``host_segment.py`` numbers the steps) happens before that
reader publishes arrived = k+1, because it publishes arrived k+1 only after finishing piece
k. I write my parity-p slot again only for piece k+2, and only after my arrival wait of piece
k+1 saw arrived >= k+1 from every rank: so every reader has finished with piece k. Meanwhile
piece k+1 uses the other slot, which is why a fast rank may copy in piece k+1 while a slow one
still copies out piece k. The same holds when broadcasts and barriers interleave with
allreduces: all of them arrive once per piece and read only after their arrival wait.

Why no locks. Each counter has one writer and each rank's counters sit on their own cache
line, written after the bytes they publish; a reader loads the counter, then the bytes. On
x86-64 (TSO) stores become visible in program order, loads happen in program order, and a
store is never moved ahead of an earlier load, which is what the two arguments above need
(``transport/shm.py`` spells out the assumptions; ``SegmentRank`` refuses to run elsewhere).

Every wait climbs the transport's one ladder (``transport/wait.py``, which holds the figures
and what they were measured from): it spins while the ranks it waits for can be close (each
has a core of its own: up to ``MAX_SPIN`` in the compiled wait, which releases the GIL, and
``PY_SPIN`` in the Python one, which holds it; ``MIN_SPIN`` otherwise), then yields the core
between looks (until ``YIELD_FOR`` from the wait's start in the compiled wait, and
``PY_YIELD_FOR`` in the Python one), then sleeps on the counter with a futex
(``transport/futex.py``: no lost wake-ups; the rank that publishes a counter wakes a rank that
announced it sleeps on it), or naps where futexes are missing.
Between sleeps (at most 50 ms each) it checks the deadline, calls ``on_idle``, and checks
that the ranks it waits for are alive (pid and start time registered in their counter line)
and have not left the group.
A group on which a collective failed is not used again: the failing rank marks itself gone,
so the others raise at once instead of waiting for their deadline.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Callable, Sequence

import numpy as np

from ..errors import CollectiveMismatchError, GradsyncError, GradsyncTimeoutError, PeerLostError
from .futex import Futex, fence
from .segment_layout import (_ARRIVED, _CLOSED, _ISSUED, _MAGIC, _MASK64, _PID, _SLEEPING,
                             _STARTED, _WORDS, _control_bytes, _describe)
from .shm import CACHE_LINE, process_start_time, require_tso
from .wait import CHECK_EVERY, MAX_NAP, MIN_SPIN, PY_SPIN, PY_YIELD_FOR, Nap, may_spin

__all__ = ["SegmentRank", "Reducer"]

Reducer = Callable[[np.ndarray, np.ndarray], None]
"""``reducer(dst, src)`` folds ``src`` into ``dst`` in place (``collectives/ops.py``'s)."""


class SegmentRank:
    """One local rank's hold on the host segment: what every road of ``ShmGroup`` stands on.

    Args:
        segment: the mapped segment (``create_group_segment`` or ``attach_segment``).
        local_rank: this process's index among the host's ranks.
        ranks: the global rank of each local rank, for error messages (default: local ranks).
        sleep: as for ``ShmGroup.open``.
    """

    # Slots for what a compiled prepared run (``_shmfast.c``'s Prepared) reads and writes per
    # call at their offsets, as ``allreduce_express`` does (``_fast_group``: ``SmallRoad``'s,
    # declared here so that the roads' classes add no slots of their own); the rest goes in
    # the instance's dict.
    __slots__ = ("_segment", "_seq", "moved", "_failed", "_fast_group", "__dict__",
                 "__weakref__")

    def __init__(self, segment: mmap.mmap, local_rank: int, ranks: "Sequence[int] | None",
                 sleep: str):
        require_tso()
        if sleep not in ("auto", "futex", "nap"):
            raise ValueError(f"sleep must be 'auto', 'futex' or 'nap', got {sleep!r}")
        header = memoryview(segment)[:CACHE_LINE].cast("Q")
        magic, size, slot_bytes = header[0], header[1], header[2]
        header.release()
        if magic != _MAGIC or len(segment) != _control_bytes(size) + 2 * size * slot_bytes:
            raise ValueError("not a gradsync shared-memory group segment (bad magic or size)")
        if not 0 <= local_rank < size:
            raise ValueError(f"local_rank {local_rank} outside the group's {size} ranks")
        self.rank, self.size, self.slot_bytes = local_rank, size, slot_bytes
        self.ranks = list(ranks) if ranks is not None else list(range(size))
        if len(self.ranks) != size:
            raise ValueError(f"ranks has {len(self.ranks)} entries for {size} local ranks")
        self._segment: mmap.mmap | None = segment  # None once closed
        self._ctl = memoryview(segment)[:_control_bytes(size)].cast("Q")
        self._mine = self._line(local_rank)
        self._lines = [self._line(r) for r in range(size)]
        self._others = [r for r in range(size) if r != local_rank]
        self._futex = Futex.open(segment) if sleep != "nap" else None
        if sleep == "futex" and self._futex is None:
            raise ValueError("futexes are not available here (Linux x86-64 with ctypes)")
        # Spinning pays only when every local rank can have a core of its own.
        self._may_spin = may_spin(size)
        base = _control_bytes(size)
        self._slots = [[np.frombuffer(segment, np.uint8, slot_bytes,
                                      base + (2 * r + parity) * slot_bytes)
                        for parity in (0, 1)] for r in range(size)]
        self._views: dict[np.dtype, list[list[np.ndarray]]] = {}
        self._seq = 0
        self.moved = 0
        """Bytes this rank put into and took out of the segment, counted by the payload of
        each collective (an allreduce's twice: in, then out); read by ``traffic.py``."""
        self._failed: "BaseException | None" = None
        self._ctl[self._mine + _STARTED] = max(process_start_time(os.getpid()) or 0, 0)
        self._ctl[self._mine + _PID] = os.getpid()

    # --- the synchronisation: arrive, publish, wait ------------------------------------------

    def _arrive(self, seq: int, kind: int, nbytes: int, signature: int, deadline: float,
                on_idle: Callable[[float], None]) -> None:
        """Publishes this rank's arrival at piece ``seq``, waits for all, checks they agree."""
        c, mine = self._ctl, self._mine
        at = _ISSUED + 3 * (seq & 1)
        c[mine + at], c[mine + at + 1], c[mine + at + 2] = kind, nbytes, signature & _MASK64
        self._publish(_ARRIVED, seq)  # last: publishes the slot's bytes and the words above
        self._wait(_ARRIVED, seq, deadline, on_idle, "arrive")
        self._check_issued(seq, kind, nbytes, signature)

    def _check_issued(self, seq: int, kind: int, nbytes: int, signature: int) -> None:
        """Raises CollectiveMismatchError unless every rank issued the same at piece ``seq``."""
        c, at = self._ctl, _ISSUED + 3 * (seq & 1)
        lines, signature = self._lines, signature & _MASK64
        for r in self._others:
            i = lines[r] + at
            if c[i] != kind or c[i + 1] != nbytes or c[i + 2] != signature:
                break
        else:
            return
        issued = [tuple(c[lines[r] + at:lines[r] + at + 3]) for r in range(self.size)]
        raise CollectiveMismatchError(
            f"local ranks issued different collectives at shared-memory piece #{seq}: " +
            "; ".join(f"local rank {r} (rank {self.ranks[r]}) {_describe(*issued[r])}"
                      for r in range(self.size)))

    def _publish(self, word: int, seq: int) -> None:
        """Raises this rank's counter ``word`` to ``seq``, waking a rank asleep on it."""
        c = self._ctl
        c[self._mine + word] = seq
        if self._futex is None:
            return
        fence()  # the store above is visible before the flags below are read
        asleep_on_me = 1 + (self.rank << 4 | word)
        lines = self._lines
        for r in self._others:
            if c[lines[r] + _SLEEPING] == asleep_on_me:
                self._futex.wake((self._mine + word) * 8)
                return

    def _wait(self, word: int, seq: int, deadline: float, on_idle: Callable[[float], None],
              phase: str, started: "float | None" = None) -> None:
        """Waits until counter ``word`` of every other local rank reaches ``seq``.

        Spins up to ``PY_SPIN`` when every local rank can have a core (only ``MIN_SPIN``
        when they outnumber the cores: spinning would delay the rank it waits for), yields
        the core between looks until ``PY_YIELD_FOR`` after the start, then sleeps on the
        counter of a rank still awaited until it moves. Closeness is judged by the cores,
        not by recent waits: a wait that slept is long because it slept, which would keep
        the next waits from spinning. ``started``
        (``time.perf_counter()``): when the wait began, if earlier than now (the compiled
        road's wait continues here).
        """
        c, lines = self._ctl, self._lines
        waiting = [r for r in self._others if c[lines[r] + word] < seq]
        if not waiting:
            return
        clock = time.perf_counter
        started = clock() if started is None else started
        spin_until = started + (PY_SPIN if self._may_spin else MIN_SPIN)
        while clock() < spin_until:
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
        yield_until = started + PY_YIELD_FOR
        while clock() < yield_until:
            os.sched_yield()
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
        nap = Nap()
        next_check = started + CHECK_EVERY
        while True:
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
            now = clock()
            if now >= next_check:
                self._check_alive(waiting)
                mono = time.monotonic()
                if mono >= deadline:
                    raise GradsyncTimeoutError(
                        f"local rank {self.rank} (rank {self.ranks[self.rank]}) timed out after "
                        f"{now - started:.1f}s at shared-memory piece #{seq} waiting for local "
                        f"rank(s) {waiting} (rank(s) {[self.ranks[r] for r in waiting]}) to "
                        f"{phase}; they are alive: are they in another collective?")
                on_idle(now - started)
                next_check = now + CHECK_EVERY
            if self._futex is not None:
                self._sleep_on(self._futex, waiting[0], word, seq, max(next_check - now, 1e-4))
            else:
                nap()

    def _sleep_on(self, futex: Futex, r: int, word: int, seq: int, timeout: float) -> None:
        """Sleeps until local rank ``r`` raises counter ``word`` (to ``seq`` or not), at most
        ``timeout`` seconds, announcing it in this rank's ``_SLEEPING`` word."""
        c, mine, at = self._ctl, self._mine, self._lines[r] + word
        c[mine + _SLEEPING] = 1 + (r << 4 | word)
        try:
            seen = c[at]
            if seen < seq and not futex.wait(at * 8, seen, timeout):
                time.sleep(min(timeout, MAX_NAP))  # the kernel refused: nap instead
        finally:
            c[mine + _SLEEPING] = 0

    def _check_alive(self, local_ranks: list[int]) -> None:
        c = self._ctl
        for r in local_ranks:
            line = self._line(r)
            why = None
            if c[line + _CLOSED]:
                why = "left the group (it closed it or failed a collective)"
            elif c[line + _PID]:
                started = process_start_time(c[line + _PID])
                if started is None or started not in (c[line + _STARTED], -1):
                    why = f"(pid {c[line + _PID]}) exited or was killed"
            if why:
                raise PeerLostError(f"local rank {self.rank} (rank {self.ranks[self.rank]}): "
                                    f"local rank {r} (rank {self.ranks[r]}) {why}",
                                    peer=self.ranks[r])

    # --- helpers -----------------------------------------------------------------------------

    def _line(self, local_rank: int) -> int:
        return (1 + 2 * local_rank) * _WORDS

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _split(self, count: int, align: int) -> list[int]:
        """Boundaries of the n sub-slices of ``count`` elements, on multiples of ``align``."""
        units = -(-count // align)
        return [min(count, (j * units // self.size) * align) for j in range(self.size + 1)]

    def _views_of(self, dtype: np.dtype) -> list[list[np.ndarray]]:
        views = self._views.get(dtype)
        if views is None:
            usable = self.slot_bytes - self.slot_bytes % dtype.itemsize
            views = [[s[:usable].view(dtype) for s in pair] for pair in self._slots]
            self._views[dtype] = views
        return views

    def _flat(self, data: np.ndarray, writable: bool) -> np.ndarray:
        if self._failed is not None:
            raise GradsyncError(f"this shared-memory group is unusable after an earlier "
                                f"failure: {self._failed}")
        if self._segment is None:
            raise ValueError("the shared-memory group is closed")
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            raise TypeError("shared-memory collectives take C-contiguous NumPy arrays")
        if writable and not data.flags.writeable:
            raise ValueError("the array is read-only but the collective writes into it")
        if data.itemsize > self.slot_bytes:
            raise ValueError(f"{data.dtype} elements do not fit a {self.slot_bytes}-byte slot")
        return data.reshape(-1)

    @contextlib.contextmanager
    def _guard(self):
        """Marks the group failed, and this rank gone, when a collective raises midway.

        The counters of a half-done collective cannot be reconciled, so the others must not
        wait for this rank until their deadline: seeing it gone they raise PeerLostError now.
        """
        try:
            yield
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._ctl[self._mine + _CLOSED] = 1
