"""An in-process transport: pairs between threads of one process, for tests.

It implements the same ``Pair`` interface as tcp and shm, so the communicator, the progress
loop and every algorithm run unchanged on it; ``local_comms(n)`` gives one Comm per rank.
"""

from __future__ import annotations

import collections
import threading

from ..errors import PeerLostError
from .base import Pair, Recv, Send
from .comm import Comm

__all__ = ["LocalPair", "local_comms"]


class _Channel:
    """One direction between two ranks: a byte queue with a lock."""

    def __init__(self):
        self.chunks: collections.deque[bytes] = collections.deque()
        self.lock = threading.Lock()
        self.closed = False


class LocalPair(Pair):
    fileno = -1

    def __init__(self, peer: int, outbound: _Channel, inbound: _Channel):
        self.peer, self.outbound, self.inbound = peer, outbound, inbound
        self._pending = memoryview(b"")

    def advance_send(self, op: Send) -> bool:
        if self.outbound.closed:
            raise PeerLostError(f"rank {self.peer} closed its connection", peer=self.peer)
        with self.outbound.lock:
            self.outbound.chunks.append(op.header + bytes(op.payload))
        op.offset = op.total
        return True

    def _take(self, dst: memoryview) -> int:
        got = 0
        while got < len(dst):
            if not self._pending:
                with self.inbound.lock:
                    if not self.inbound.chunks:
                        break
                    self._pending = memoryview(self.inbound.chunks.popleft())
            n = min(len(dst) - got, len(self._pending))
            dst[got:got + n] = self._pending[:n]
            self._pending = self._pending[n:]
            got += n
        return got

    def advance_recv(self, op: Recv) -> bool:
        if op.header_got < len(op.header_buf):
            op.header_got += self._take(memoryview(op.header_buf)[op.header_got:])
            if op.header_got < len(op.header_buf):
                self.check_alive()
                return False
            op.check_header()
        op.offset += self._take(op.payload[op.offset:])
        return op.offset == op.payload.nbytes

    def check_alive(self) -> None:
        if self.inbound.closed and not self.inbound.chunks and not self._pending:
            raise PeerLostError(f"rank {self.peer} closed its connection", peer=self.peer)

    def close(self) -> None:
        self.outbound.closed = True


def local_comms(size: int, timeout: float = 30.0) -> list[Comm]:
    """One Comm per rank, all in this process, joined by in-memory pairs."""
    channels = {(i, j): _Channel() for i in range(size) for j in range(size) if i != j}
    return [
        Comm(r, size, {p: LocalPair(p, channels[(r, p)], channels[(p, r)])
                       for p in range(size) if p != r}, timeout)
        for r in range(size)
    ]
