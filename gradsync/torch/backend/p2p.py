"""Sends and receives: one lane and one two-rank World per peer and direction.

Collectives number their frames with a sequence that every rank of the World advances
together; a send involves two ranks only, so it cannot use the group's World without putting
the other ranks' sequence out of step. Each ordered pair (src, dst) that exchanges messages
gets a World of its own instead, ``[src, dst]``, made on first use by both ends (a collective
over those two ranks, through the group's store), and a lane that runs its messages in order.
Every message is one "collective" of that World: sequence numbers pair the n-th send with the
n-th receive, and the description (tag and size) must agree, or both ends fail with a
mismatch. Directions have separate lanes, so ``batch_isend_irecv`` with sends and receives in
any order on each rank cannot deadlock: a send never waits behind a receive.

Tags are checked, not used for matching: messages between two ranks in one direction are
received in the order they were sent, whatever their tags (gloo matches by tag).

A receive from any source (``dist.recv`` without ``src``) does not know which direction to
wait on, and a direction's World exists only once both ends have made it. So a sender that
opens a direction first says so in the group's store (one key per direction, once: sends pay
nothing more), and the receive from any source, on a lane of its own, looks in turn at each
other rank: a direction not yet open but announced is opened; on an open one, the next
message's header is peeked at (``peek_header``: it is not taken) while that direction's lane is
idle, and the first rank whose message has arrived is received from, on this thread but
holding that direction's lane, so it never races a ``recv(src=...)`` of the same direction.
Store look-ups happen only while such a receive waits, at most every ``_ANNOUNCE_POLL_S``.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING

from ...cluster.rendezvous import Store
from ...errors import GradsyncError, GradsyncTimeoutError
from ...transport.wait import Nap
from .errors import BackendError, to_backend_error
from .tensors import as_bytes, contiguous
from .work import Lane, Work

if TYPE_CHECKING:
    from ...connect.world import World

__all__ = ["PointToPoint", "clone_store"]

_CLOSE_GRACE = 2.0  # seconds shutdown gives a lane to finish the message it is in
_ANNOUNCE_POLL_S = 0.01  # how often a receive from any source asks if a direction opened


def _opened_key(src: int, dst: int) -> str:
    return f"p2p-open/{src}-{dst}"


def clone_store(store):
    """A new connection to ``store`` (torch's ``Store.clone``), or ``store`` if it cannot."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):  # a store that cannot clone: share it
        return store


class _Direction:
    """The World and lane of messages from ``src`` to ``dst`` (made on the lane, lazily)."""

    def __init__(self, parent, src: int, dst: int):
        self.parent, self.src, self.dst = parent, src, dst
        self.world: World | None = None
        self.lane = Lane(f"gradsync-p2p-{src}-{dst}", self._failed)

    def _failed(self, exc: BaseException, what: str) -> BackendError:
        if isinstance(exc, GradsyncError) and self.world is not None:
            exc = self.world.fail(exc)
        return to_backend_error(exc, f"rank {self.parent.rank}: {what}")

    def connected(self):
        if self.world is None:
            # Its own store connection: the lanes of other directions connect at the same time.
            base = clone_store(self.parent.store.base)
            if self.src == self.parent.rank:
                # For a receive from any source at the other end (see the module's doc).
                Store.over(base, self.parent.store.job, self.parent.store.timeout).set(
                    _opened_key(self.src, self.dst), "1")
            self.world = self.parent.subworld([self.src, self.dst], f"p2p.{self.src}.{self.dst}",
                                              base=base)
        if self.world.failure is not None:
            raise self.world.failure
        return self.world

    def close(self, wait: bool) -> None:
        self.lane.close(BackendError("the process group has been shut down"), wait=wait)
        if not wait and not self.lane.join(_CLOSE_GRACE):
            # Still in a send or receive that no partner matched: its connections stay open
            # (closing them under it could pull shared memory from under its feet); the
            # daemon thread ends with the process.
            return
        if self.world is not None:
            self.world.close()


class PointToPoint:
    """The send and receive lanes of one process group's World."""

    def __init__(self, world):
        self.world = world
        self._directions: dict[tuple[int, int], _Direction] = {}
        self._lock = threading.Lock()
        self._any: "Lane | None" = None  # receives from any source, in order (on first use)
        self._announced: Store | None = None  # the store connection they look for announcements on

    def _direction(self, src: int, dst: int) -> _Direction:
        with self._lock:
            d = self._directions.get((src, dst))
            if d is None:
                d = self._directions[(src, dst)] = _Direction(self.world, src, dst)
            return d

    def send(self, tensors, dst: int, tag: int) -> Work:
        me = self.world.rank
        if dst == me:
            raise ValueError(f"rank {me} cannot send to itself")
        d = self._direction(me, dst)
        what = f"send to rank {dst} tag={tag}"

        def run():
            world = d.connected()
            for t in tensors:
                t = contiguous(t)
                world.comm.begin(f"p2p {me}->{dst} tag={tag} {t.nbytes} bytes",
                                 world.config.check_collectives)
                world.comm.exchange(sends=[(1, as_bytes(t))])
        return d.lane.submit(Work(what, tensors), run)

    @staticmethod
    def _receive(world, src: int, me: int, tensors, tag: int) -> None:
        """Receives ``tensors`` from ``src`` over the direction's ``world`` (its rank 0)."""
        for t in tensors:
            target = contiguous(t)
            world.comm.begin(f"p2p {src}->{me} tag={tag} {target.nbytes} bytes",
                             world.config.check_collectives)
            world.comm.exchange(recvs=[(0, as_bytes(target))])
            if target is not t:
                t.copy_(target)

    def recv(self, tensors, src: int, tag: int) -> Work:
        me = self.world.rank
        if src == me:
            raise ValueError(f"rank {me} cannot receive from itself")
        d = self._direction(src, me)
        what = f"recv from rank {src} tag={tag}"
        work = Work(what, tensors)
        work._src = src
        return d.lane.submit(work, lambda: self._receive(d.connected(), src, me, tensors, tag))

    def recv_anysource(self, tensors, tag: int) -> Work:
        """Receives ``tensors`` from whichever rank's message arrives first; the Work's
        ``_source_rank()`` says which (the module's doc says how)."""
        me, size = self.world.rank, self.world.size
        if size < 2:
            raise ValueError("a receive from any source needs a group of two ranks or more")
        work = Work(f"recv from any rank tag={tag}", tensors)
        with self._lock:
            if self._any is None:
                self._any = Lane(f"gradsync-p2p-any-{me}",
                                 lambda exc, what: to_backend_error(exc, f"rank {me}: {what}"))
                self._announced = self.world.store.clone_private()
            lane, store = self._any, self._announced
            assert store is not None  # made with the lane, just above
        sources = [r for r in range(me + 1, size)] + [r for r in range(me)]

        def take(d, src):
            """On ``d``'s lane (held): receives from ``src`` if its message is there."""
            try:
                world = d.connected()
                pair = world.comm.pairs[0]
                if not getattr(pair, "connected", True):
                    pair._open()  # a TCP pair connects on first use: this is its first use
                if pair.peek_header() is None:
                    return False
                self._receive(world, src, me, tensors, tag)
                return True
            except GradsyncError as exc:
                raise d._failed(exc, work.what) from exc

        def run():
            world = self.world
            start = time.monotonic()
            deadline = start + world.config.timeout
            next_ask = dict.fromkeys(sources, start)
            nap = Nap()  # the transport's sleep rung, between looks
            while True:
                for src in sources:
                    d = self._direction(src, me)
                    if d.world is None:  # not open yet: has the sender announced it?
                        now = time.monotonic()
                        if now < next_ask[src]:
                            continue
                        next_ask[src] = now + _ANNOUNCE_POLL_S
                        if not store.check(_opened_key(src, me)):
                            continue
                    ran, took = d.lane.try_run(functools.partial(take, d, src))
                    if ran and took:
                        work._src = src
                        return
                now = time.monotonic()
                if lane.closed is not None:  # shut down or aborted: no message will come
                    raise lane.closed
                if world.failure is not None:
                    raise world.failure
                world.on_idle(now - start)  # raises on an abort record or a lost peer
                if now > deadline:
                    raise GradsyncTimeoutError(
                        f"rank {me} timed out after {now - start:.1f}s receiving from any "
                        f"rank (tag={tag}): no rank sent to it")
                nap()
        return lane.submit(work, run)

    def close(self, wait: bool = True) -> None:
        with self._lock:
            directions = list(self._directions.values())
            any_lane = self._any
        if any_lane is not None:  # first: it may hold a direction's lane
            any_lane.close(BackendError("the process group has been shut down"), wait=wait)
            if not wait:
                any_lane.join(_CLOSE_GRACE)
        for d in directions:
            d.close(wait)
