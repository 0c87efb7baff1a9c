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
"""

from __future__ import annotations

import threading


from ...errors import GradsyncError
from .errors import BackendError, to_backend_error
from .tensors import as_bytes, contiguous
from .work import Lane, Work

__all__ = ["PointToPoint", "clone_store"]

_CLOSE_GRACE = 2.0  # seconds shutdown gives a lane to finish the message it is in


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
        self.world = None
        self.lane = Lane(f"gradsync-p2p-{src}-{dst}", self._failed)

    def _failed(self, exc: BaseException, what: str) -> BackendError:
        if isinstance(exc, GradsyncError) and self.world is not None:
            exc = self.world.fail(exc)
        return to_backend_error(exc, f"rank {self.parent.rank}: {what}")

    def connected(self):
        if self.world is None:
            # Its own store connection: the lanes of other directions connect at the same time.
            self.world = self.parent.subworld([self.src, self.dst], f"p2p.{self.src}.{self.dst}",
                                              base=clone_store(self.parent.store.base))
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

    def recv(self, tensors, src: int, tag: int) -> Work:
        me = self.world.rank
        if src == me:
            raise ValueError(f"rank {me} cannot receive from itself")
        d = self._direction(src, me)
        what = f"recv from rank {src} tag={tag}"
        work = Work(what, tensors)
        work._source_rank = src

        def run():
            world = d.connected()
            for t in tensors:
                target = contiguous(t)
                world.comm.begin(f"p2p {src}->{me} tag={tag} {target.nbytes} bytes",
                                 world.config.check_collectives)
                world.comm.exchange(recvs=[(0, as_bytes(target))])
                if target is not t:
                    t.copy_(target)
        return d.lane.submit(work, run)

    def close(self, wait: bool = True) -> None:
        with self._lock:
            directions = list(self._directions.values())
        for d in directions:
            d.close(wait)
