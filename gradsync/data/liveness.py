"""A worker's watch over its data servers: a stopped or cut-off data server is a lost one.

A data server that dies is found at once: its process vanishes (a same-host worker checks its
pid while it polls) and its connections close (every call fails). One that is *stopped*
(SIGSTOP, a debugger) or whose host is *cut off* shows neither: its pid lives and its sockets
stay open, and without more a worker would wait for its next batch up to the job's
``timeout`` (300 s). The ranks of the training job have heartbeats for this
(``gradsync/liveness/heartbeat.py``); data servers are not members of that job, and a worker talks
to each of them anyway, so the same idea costs less here. With the job's heartbeat settings
(``heartbeat_interval`` 0.25 s, ``heartbeat_timeout`` 2 s; a timeout of 0 turns this off):

- **Same host (the poll road).** Each data server's beater counts up a *beat* word in every
  stream's slot table each interval (``server.py``, ``slots.py``): the native thread of
  ``beater.py``, which needs no GIL, so a server whose producer holds the GIL in a long C call
  (an ``import torch``, a large unpickling) still beats. This watch, a thread of the worker,
  reads each polled server's beat every interval; a beat that has not moved for the timeout,
  of this watcher's own time, is a silent server. A look that comes more than half the
  timeout late (this worker was itself stopped or starved) restarts every clock instead of
  judging: a late watcher is no evidence about anyone else. No message.
- **Another host (the take road).** Every call to a data server is answered within a
  fraction of the timeout while it runs: a ``take`` whose batch is not ready answers
  ``pending`` after a quarter of the timeout, and the worker asks again. So the worker's
  connection waits for a reply with the timeout as its *silence* (``region_peer.RemotePeer``):
  no byte for that long is a stopped or cut-off server. A connection with nothing in flight is
  looked at with a ``ping`` each interval, on the connection's own request thread (one that
  is busy is watched by its own request already: a take in flight is received by the fetch
  thread when it waits, or by the connection's thread at most 0.1 s after it was sent,
  ``region_peer.LOOK_S``), so that a worker that has no batch to ask of that server yet
  still finds it silent.

While a worker's connections form (inside ``Loader(...)``: the dial, the hello, the read of
the slots) a server gets ``heartbeat.LINK_UP_S`` (30 s) to answer instead, as a heartbeat link
gets to form: the ranks of a job start seconds apart on a crowded machine.

A server found silent is *lost*, exactly as one found dead: the worker sets its batches aside
and hands them to the live servers at the end of the epoch (``server_set.py``), so each
sample is still delivered exactly once; its connection is shut, so that a server that wakes
finds the worker gone and ends. A server only slow is never silent: its beats go on while its producer
prepares a batch, its serving threads answer meanwhile (its switch interval is 0.2 ms), and
its takes answer ``pending``. What can still pass for silence: on the take road, one C call
that holds the server's GIL longer than the timeout (the replies come from Python threads);
on the poll road, only where the compiled module is not built (the beats then come from a
Python thread too).

Detection, with the defaults: a stopped same-host server is given up between 2 and 2.5 s after
its last beat (timeout + an interval of this watch, + 50 ms for a poll in progress to see it);
one on another host 2 s after the worker's first request left unanswered (a take in flight,
received at most 0.1 s after it was sent, or the next ping, at most an interval after the
stop). Within ``gradsync bench chaos``'s
default bound of 3 s.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ..errors import PeerLostError

if TYPE_CHECKING:
    from ..pipeline.engine import Handle

__all__ = ["Watch"]


class Watch:
    """The liveness watch of one ``Loader``'s data servers (module docstring).

    Args:
        loader: the worker's Loader: its ``peers``, ``pollers``, ``lost`` and ``_lose``.
        interval: seconds between looks (``heartbeat_interval``).
        silence: seconds without a beat, or a reply, after which a server is lost
            (``heartbeat_timeout``).
        clock: the watcher's clock (tests drive ``look`` with their own).
    """

    def __init__(self, loader, interval: float, silence: float, clock=time.monotonic):
        self.loader, self.interval, self.silence, self.clock = loader, interval, silence, clock
        self._beats: dict[int, tuple[int, float]] = {}  # server -> (beat seen, since when)
        self._pings: dict[int, Handle] = {}  # server -> its ping's handle, while in flight
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watch":
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gradsync-data-liveness")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.interval + 1.0)

    def forget(self, server: int) -> None:
        """Drops what was seen of ``server``'s process: the worker connected to another one
        (a server that came back, ``Loader._redial``), whose beat starts anew."""
        self._beats.pop(server, None)
        self._pings.pop(server, None)

    def _lose(self, d: int, peer, error: PeerLostError) -> None:
        """Gives up server ``d`` if ``peer`` is still the worker's connection to it: one that
        a process started again has replaced since (``Loader._redial``) is no news."""
        if self.loader.peers[d] is peer:
            self.loader._lose(d, error)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.look()

    def look(self) -> None:
        """One look at every live data server."""
        now = self.clock()
        # This watcher ran late (it was stopped or starved): whatever it missed is no
        # evidence against a server, so the beat clocks start again.
        late = self._last is None or now - self._last > self.silence / 2
        self._last = now
        loader = self.loader
        for d, peer in enumerate(loader.peers):
            if peer is None or d in loader.lost:
                continue
            road = loader.pollers[d]
            if road is not None:
                self._beat(d, peer, road, now, late)
            else:
                self._ping(d, peer)

    def _beat(self, d: int, peer, road, now: float, late: bool) -> None:
        beat = road.table.beats()
        seen = self._beats.get(d)
        if late or seen is None or seen[0] != beat:
            self._beats[d] = (beat, now)
            return
        quiet = now - seen[1]
        if quiet > self.silence:
            error = PeerLostError(f"{road.label} (pid {road.pid}, same host) has been silent "
                                  f"for {quiet:.1f}s: its beat stood still (stopped?)",
                                  peer=road.peer)
            road.silent = error  # a poll waiting on it raises it at its next check
            self._lose(d, peer, error)

    def _ping(self, d: int, peer) -> None:
        handle = self._pings.get(d)
        if handle is not None and not handle.poll():
            return  # the last ping still waits: its connection's silence judges

        def ping():
            try:
                peer.call_if_idle("ping")
            except PeerLostError as exc:  # silent, or the connection ended
                self._lose(d, peer, exc)

        self._pings[d] = peer.submit(ping, f"{peer.label}.ping")
