"""How the pieces road writes a rank's slot: through the cache, or streamed past it (measured).

Every piece of a large allreduce on the host's segment (``host_segment.py``) hands bytes from
one core to another: a rank writes its slot, the others read it (and the rank then writes
the lines the others read two pieces before). Written the ordinary way, a line stays in the
writer's cache and the reader takes it from there; written by the streaming copy of
``_shmfast.c`` (non-temporal stores), it goes towards memory and the reader takes it from
there. Which is faster is a property of the machine at the moment, not of the code:

- On the 2-vCPU AMD EPYC virtual machines of this project's sessions, the 64 MiB allreduce of
  2 ranks ran at 7-11 ms for a while, then at 34-45 ms, then fast again, flipping every few
  seconds within one run (docs/benchmarks.md, "The 64 MiB row's two states"). Two processes
  on the two CPUs, in the same seconds: copying within their own memory, 50 us per MiB in
  both states; handing 1 MiB over (one writes, the other reads), 60-90 us in the fast state
  and 440-750 us in the slow one. The same handover written with streaming stores took
  105-210 us in both states: about twice as slow as the ordinary way in the fast state, four
  times as fast in the slow one.
- glibc's ``memcpy`` streams above a fraction of the cache's size, for the same reason
  (its own lines would only evict others); a slot is smaller than that, so it never does
  here.

So the ranks measure. ``Stores`` counts the full pieces of large allreduces (a call's first
piece is left out: its time includes the ranks' skew on entering the call) and, in each
period of ``PERIOD`` pieces, times ``WINDOW`` pieces the way in force, then ``WINDOW``
pieces the other way; where the other way's median piece is faster by more than
``MARGIN``, it becomes the way in force. A piece's time runs from the end of the previous
piece to its own end: the copy-in, the reduction and the copy-out of every rank, the
handovers between them included, on every rank alike (each piece ends with a wait for all).

The ranks decide each for itself, on the same pieces (every rank processes the same
pieces, so the counts agree) and nearly the same times. Either way the bytes are the same:
a rank that decided otherwise than another costs time, never a result, and the next trial
decides again. ``shm_stream`` (``GRADSYNC_SHM_STREAM``) overrides the measurement: ``never``
or ``always``.
"""

from __future__ import annotations

import statistics
from typing import Callable

__all__ = ["Stores", "WINDOW", "PERIOD", "MARGIN", "MODES"]

MODES = ("auto", "never", "always")

WINDOW = 16
"""Full pieces timed each way per trial (a 64 MiB allreduce is 64 pieces of 1 MiB)."""

PERIOD = 512
"""Full pieces between the starts of two trials: in the fast state the other way's window
costs about a piece's time per piece (16 x 0.1 ms), 3% of a period; a change of state is
seen within a period (8 allreduces of 64 MiB, 0.1-0.4 s)."""

MARGIN = 0.1
"""How much faster (as a share of the way in force's median piece) the other way must be."""


class Stores:
    """One rank's choice for its group: ``streaming`` (the way in force) and, for each piece,
    ``stream_now()``; ``record(seconds)`` after each full piece measured.

    Args:
        stream: the streaming copy (``_shmfast.stream``), or None where it is not built.
        mode: ``auto`` (measured), ``never`` or ``always`` (``Config.shm_stream``).
    """

    __slots__ = ("copy", "streaming", "measuring", "trials", "_count", "_base", "_other")

    def __init__(self, stream: "Callable[[object, object], None] | None", mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"shm_stream must be one of {MODES}, got {mode!r}")
        self.copy = stream if mode != "never" else None
        self.streaming = mode == "always" and stream is not None
        self.measuring = mode == "auto" and stream is not None
        self.trials: list[tuple[float, float, bool]] = []  # (in force, other, switched)
        self._count = 0
        self._base: list[float] = []
        self._other: list[float] = []

    def stream_now(self) -> bool:
        """Whether the next piece streams: the way in force, or the other in a trial window."""
        if not self.measuring:
            return self.streaming
        return self.streaming ^ (WINDOW <= self._count % PERIOD < 2 * WINDOW)

    def record(self, seconds: float) -> None:
        """One full piece took ``seconds``, written the way ``stream_now()`` said (nothing
        where the way is not measured)."""
        if not self.measuring:
            return
        phase = self._count % PERIOD
        self._count += 1
        if phase < WINDOW:
            self._base.append(seconds)
        elif phase < 2 * WINDOW:
            self._other.append(seconds)
            if phase == 2 * WINDOW - 1:
                base, other = statistics.median(self._base), statistics.median(self._other)
                switch = other < base * (1 - MARGIN)
                self.trials.append((base, other, switch))
                del self.trials[:-8]
                if switch:
                    self.streaming = not self.streaming
                self._base.clear()
                self._other.clear()
