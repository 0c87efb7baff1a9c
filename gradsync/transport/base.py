"""The narrow interface every transport implements, and the loop that drives it.

A ``Pair`` is this rank's connection to one peer. It moves *frames* (``frame.py``): a header
then a payload that goes straight from the sender's buffer into the receiver's buffer. Pairs
are non-blocking: ``Send`` and ``Recv`` are small state machines that a pair advances a bit
at a time, so one thread can drive many of them at once (a ring step sends right while it
receives from the left) without a thread per connection. ``wait_all`` is that driver: it
advances every operation, sleeps in ``select`` (sockets) or climbs the spin, yield, nap ladder
of ``wait.py`` (shared memory) when nothing moves, and checks the deadline and the job's abort
flag while it waits.

A pair that can *lend* (``Pair.lends``, TCP on Linux: ``splice.py``) sends a ``Send`` marked
``lent`` by reference to the caller's memory instead of copying it; ``Settle`` waits until the
peer has acknowledged every frame lent to it, after which that memory may be written again.
"""

from __future__ import annotations

import select
import time
from typing import Callable, Sequence

from ..errors import CollectiveMismatchError, GradsyncTimeoutError, ProtocolError
from . import frame
from .wait import CHECK_EVERY, Backoff

__all__ = ["Pair", "Send", "Recv", "Settle", "Expect", "wait_all", "different_collective"]


class Expect:
    """What the receiver expects of the next frame: checked before the payload is trusted."""

    __slots__ = ("seq", "step", "signature", "describe", "header")

    def __init__(self, seq: int, step: int, signature: int, describe: Callable[[], str],
                 length: int = -1):
        self.seq, self.step, self.signature, self.describe = seq, step, signature, describe
        # The header a frame of ``length`` bytes that passes has (not lent), to compare at once.
        self.header = (frame.pack(frame.Kind.DATA, seq, step, signature, length)
                       if length >= 0 and signature else None)


class Send:
    """One frame on its way out: ``header`` then ``payload``; ``offset`` counts bytes sent.

    ``address`` is the payload's address when the frame is lent (its header has the LENT flag
    and the pair sends the pages by reference), else 0. ``after``: the frame to the same peer
    posted just before this one in the same wait, which must be all out before this one
    starts (frames on a pair never interleave).
    """

    __slots__ = ("pair", "header", "payload", "offset", "total", "address", "after", "done")

    def __init__(self, pair: "Pair", header: bytes, payload: memoryview, address: int = 0,
                 after: "Send | None" = None):
        self.pair, self.header, self.payload = pair, header, payload
        self.offset, self.total = 0, len(header) + payload.nbytes
        self.address = address
        self.after, self.done = after, False

    def advance(self) -> bool:
        if self.after is not None:  # an earlier frame to the same peer goes out first
            if not self.after.done:
                return False
            self.after = None
        self.done = self.pair.advance_send(self)
        return self.done


class Recv:
    """One frame on its way in, straight into ``payload`` (a writable byte view).

    ``after``: the receive from the same peer posted just before this one in the same wait;
    this one takes the peer's next frame only once that one has all of its own."""

    __slots__ = ("pair", "expect", "payload", "header_buf", "header_got", "offset", "lent",
                 "after", "done")

    def __init__(self, pair: "Pair", expect: Expect, payload: memoryview,
                 after: "Recv | None" = None):
        self.pair, self.expect, self.payload = pair, expect, payload
        self.header_buf = bytearray(frame.HEADER_SIZE)
        self.header_got = 0
        self.offset = 0
        self.lent = False  # the sender lent the payload: acknowledge it once it is all here
        self.after, self.done = after, False

    def advance(self) -> bool:
        if self.after is not None:  # an earlier frame from the same peer comes in first
            if not self.after.done:
                return False
            self.after = None
        self.done = self.pair.advance_recv(self)
        return self.done

    def check_header(self) -> None:
        """Validates the received header against ``expect``; raises before any payload lands."""
        if self.header_buf == self.expect.header:  # the frame expected, not lent
            return
        h = frame.unpack(self.header_buf)
        e = self.expect
        if h.kind != frame.Kind.DATA:
            raise ProtocolError(f"rank {self.pair.peer} sent a control frame (kind {h.kind}) "
                                f"where data was expected")
        if h.seq != e.seq or (e.signature and h.signature != e.signature):
            raise different_collective(self.pair.peer, h, e.seq, e.describe(), e.signature)
        if h.step != e.step or h.length != self.payload.nbytes:
            raise ProtocolError(f"rank {self.pair.peer} sent message {h.step} of {h.length} bytes "
                                f"in collective #{h.seq}; expected message {e.step} of "
                                f"{self.payload.nbytes} bytes")
        self.lent = bool(h.flags & frame.LENT)


def different_collective(peer: int, h: "frame.Header", seq: int, description: str,
                         signature: int) -> CollectiveMismatchError:
    """The error for a frame of rank ``peer`` (header ``h``) that belongs to another collective
    than this rank's #``seq``."""
    return CollectiveMismatchError(
        f"rank {peer} sent data for a different collective (its collective #{h.seq}, "
        f"signature {h.signature:#x}) than this rank's #{seq} {description} "
        f"(signature {signature:#x})")


class Settle:
    """Waits until ``pair``'s peer has acknowledged every frame lent to it (see ``Pair``)."""

    __slots__ = ("pair", "offset")

    def __init__(self, pair: "Pair"):
        self.pair = pair
        self.offset = 0  # acknowledgements (and bytes of them) taken in: progress for wait_all

    def advance(self) -> bool:
        return self.pair.advance_settle(self)


class Pair:
    """This rank's connection to one peer. Subclasses: ``TcpPair``, ``ShmPair``."""

    peer: int
    #: A selectable file descriptor, or -1 when the pair must be polled (shared memory, or a
    #: TCP pair not connected yet).
    fileno: int = -1
    #: Whether the pair is a network socket (TCP), connected yet or not: what decides the
    #: socket-only choices (segment trials, lending), where ``fileno`` says how to wait now.
    is_socket: bool = False
    #: Whether ``Send`` ops with an ``address`` go out by reference (then acknowledged).
    lends: bool = False

    def advance_send(self, op: Send) -> bool:
        """Moves as much of ``op`` as possible without blocking; True once all is sent."""
        raise NotImplementedError

    def advance_recv(self, op: Recv) -> bool:
        """Moves as much of ``op`` as possible without blocking; True once all has arrived."""
        raise NotImplementedError

    def advance_settle(self, op: Settle) -> bool:
        """True once the peer has acknowledged every lent frame (at once if none was lent)."""
        return True

    def unsettled(self) -> bool:
        """True while lent frames await acknowledgement or acknowledgements await sending."""
        return False

    def owes_bytes(self) -> bool:
        """True while acknowledgements for the peer wait for room in the send buffer."""
        return False

    def peek_header(self) -> "frame.Header | None":
        """The header of the peer's next frame when all of it has arrived, without taking it;
        None when it has not (or the pair cannot look). Only between frames: while no
        receive on this pair is under way."""
        return None

    def check_alive(self) -> None:
        """Raises PeerLostError if the peer is known to be gone (called while waiting)."""

    def moved(self) -> int:
        """Bytes sent plus bytes received on this pair so far (frames whole, headers too),
        from counters the transport keeps anyway; read once an interval by ``traffic.py``,
        never on an operation's path. 0 where the transport keeps none."""
        return 0

    def close(self) -> None:
        raise NotImplementedError


def wait_all(ops: Sequence["Send | Recv | Settle"], deadline: float,
             on_idle: Callable[[float], None], what: Callable[..., str], *what_args) -> None:
    """Advances ``ops`` until all are complete.

    Args:
        ops: the sends and receives of one step; their order on each pair is their wire order.
        deadline: ``time.monotonic()`` value after which GradsyncTimeoutError is raised.
        on_idle: called with the seconds waited so far, about every abort_poll_interval while
            nothing moves; it raises when the job was aborted or a peer is known dead.
        what: describes the wait for error messages (called with ``what_args`` only on the
            error path).
    """
    started = time.monotonic()
    # The first round advances every op: for a pair made on demand, that dials and
    # authenticates its peer, so it too looks at liveness between its ops (``_round``).
    pending, next_idle = _round(list(ops), started + CHECK_EVERY, on_idle, started)
    if not pending:
        return
    # Where a pair must be polled (shared memory): spin, yield, then nap (``wait.py``). Only
    # a polled pair's progress (or an op done) starts the ladder again: bytes arriving on a
    # socket of the same wait say nothing about when the polled peer will write, and on a slow
    # link they arrive every few milliseconds, which kept such a wait spinning and yielding.
    backoff = Backoff()
    while pending:
        before = _moved(pending)
        still, next_idle = _round(pending, next_idle, on_idle, started)
        if not still:
            return
        if len(still) != len(pending):  # an op done: the ladder starts again
            backoff.reset()
            pending = still
            continue
        after = _moved(still)
        if after[0] != before[0]:  # a polled pair moved
            backoff.reset()
            continue
        polled = after[2]  # how many ops are on polled pairs
        if not polled and after[1] != before[1]:
            continue  # only sockets, and they moved: advance them again before sleeping
        now = time.monotonic()
        if now >= next_idle:
            if now >= deadline:
                raise GradsyncTimeoutError(f"timed out after {now - started:.1f}s waiting for "
                                           f"{what(*what_args)}")
            _look(pending, on_idle, started)
            next_idle = now + CHECK_EVERY
        if polled == len(pending):
            backoff.idle()
        elif not polled:
            # Only sockets: sleep in the kernel until one is ready (or it is time to look up).
            backoff.count()
            _select(pending, max(0.0, min(next_idle, deadline) - now))
        else:
            # Both kinds: the polled pairs' ladder, whose naps wake early for the sockets.
            sockets = [op for op in pending if op.pair.fileno >= 0]
            backoff.idle(lambda seconds: _select(sockets, seconds))


def _select(ops, seconds: float) -> None:
    """Sleeps until one of ``ops``' sockets is ready to read or write, or ``seconds`` pass."""
    rd = [op.pair.fileno for op in ops if not isinstance(op, Send)]
    wr = [op.pair.fileno for op in ops if isinstance(op, Send) or op.pair.owes_bytes()]
    select.select(rd, wr, [], seconds)


def _round(pending: list, next_idle: float, on_idle: Callable[[float], None],
           started: float) -> "tuple[list, float]":
    """Advances each of ``pending`` once; returns the ops not complete and the next time to
    look at liveness. A long round (first advances that dial peers made on demand) looks
    between its ops too, so a peer known dead or an abort is seen then, not after the round's
    last dial."""
    still = []
    for i, op in enumerate(pending):
        if not op.advance():
            still.append(op)
        if i + 1 < len(pending) and time.monotonic() >= next_idle:
            _look(still + pending[i + 1:], on_idle, started)
            next_idle = time.monotonic() + CHECK_EVERY
    return still, next_idle


def _look(ops, on_idle: Callable[[float], None], started: float) -> None:
    """The waits' liveness checks: the job's first (``on_idle``: the abort record, a peer the
    heartbeats found lost), then each pair's own (a same-host peer's process). In that order
    because a peer that raised the job's first failure exits: its own loss is no news."""
    on_idle(time.monotonic() - started)
    for op in ops:
        op.pair.check_alive()


def _moved(ops) -> "tuple[int, int, int]":
    """Bytes moved so far by ``ops`` over polled pairs and over sockets (a change means
    progress short of completion), and how many of ``ops`` are on polled pairs."""
    polled = sockets = count = 0
    for op in ops:
        moved = op.offset + getattr(op, "header_got", 0)
        if op.pair.fileno < 0:
            polled += moved
            count += 1
        else:
            sockets += moved
    return polled, sockets, count
