"""The communicator: what collective algorithms see of the transports.

An algorithm knows its rank, the world size and one verb, ``exchange``: post these sends and
these receives together and return when all are done. The communicator stamps every frame with
the collective's sequence number, the message's index on its pair, and the collective's
signature, so that a rank that issued a different collective is caught at its first frame.

Lending. ``exchange(..., lend=True)`` lets a pair that can (TCP on Linux) send the buffers by
reference instead of copying them (``splice.py``): then the sender must not write into them
until the peers have them, and ``settle`` waits for exactly that. An algorithm that lends
calls ``settle`` before it writes into memory it lent, unless its structure already implies
the peer read it, and at the latest before it returns (the caller may write into the buffer
next). Whether lending pays is measured, not assumed (``Lending``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from . import frame
from .base import Expect, Pair, Recv, Send, Settle, wait_all

__all__ = ["Comm", "CommView", "Lending", "LEND_MIN_BYTES", "LEND_TRIALS"]

#: Smaller sends are copied even when lent: each lent frame costs an acknowledgement.
LEND_MIN_BYTES = 256 << 10

#: The first collectives that may lend copy and lend in turn, this many times each, and the
#: faster way is kept (``Lending``); 0 lends from the start, unmeasured.
LEND_TRIALS = 3


class Lending:
    """Whether a Comm's large collectives lend their send buffers, decided by timing them.

    Lending saves the sender's copy but costs the kernel's page references and an
    acknowledgement per frame, and which is cheaper depends on the machine: on one 2-core VM
    lending made a 64 MiB allreduce over loopback TCP about a fifth faster, on another (same
    kernel) it took about 1.4 times as long (docs/benchmarks.md). So the first ``2 * trials`` collectives that
    may lend alternate, copying first, each timed per byte, and from then on the way with the
    lower median is used. Every rank runs the same collectives, so all try the same way at the
    same time; each then decides for its own sends (a lent frame says so, and any receiver
    acknowledges it), so the ranks need not agree.
    """

    def __init__(self, trials: int):
        self.trials = trials
        self.seconds_per_byte: dict[bool, list[float]] = {False: [], True: []}
        self.chosen: "bool | None" = True if trials == 0 else None

    def next(self) -> bool:
        """Whether the next collective that may lend does."""
        if self.chosen is not None:
            return self.chosen
        tried = self.seconds_per_byte
        return len(tried[True]) < len(tried[False])

    def record(self, lent: bool, seconds: float, nbytes: int) -> None:
        """What a collective that may lend took; chooses once both ways have their trials."""
        if self.chosen is not None or nbytes <= 0:
            return
        tried = self.seconds_per_byte
        tried[lent].append(seconds / nbytes)
        if min(len(tried[False]), len(tried[True])) >= self.trials:
            self.chosen = statistics.median(tried[True]) < statistics.median(tried[False])


def _bytes_view(buf) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("transport buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Comm:
    """Point-to-point messaging between the ranks of one job, for collective algorithms.

    Args:
        rank: this rank.
        size: the number of ranks.
        pairs: a connected Pair for every other rank.
        timeout: seconds one collective may wait on live peers.
        on_idle: called while waiting (see ``wait_all``); raises to abort the wait.
    """

    def __init__(self, rank: int, size: int, pairs: Mapping[int, Pair], timeout: float,
                 on_idle: Callable[[float], None] = lambda waited: None):
        self.rank, self.size = rank, size
        self.pairs = dict(pairs)
        self.timeout = timeout
        self.on_idle = on_idle
        self.seq = 0
        self.signature = 0
        self.description = "no collective"
        self._deadline = 0.0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._scratch: dict[int, np.ndarray] = {}
        self.lending = Lending(LEND_TRIALS)

    @property
    def lends(self) -> bool:
        """Whether a send to some peer can go out lent (``exchange(lend=True)``)."""
        return any(pair.lends for pair in self.pairs.values())

    def begin(self, description: str, check: bool = True) -> None:
        """Starts the next collective. Every rank must call it with the same description."""
        self.seq += 1
        self.description = description
        self.signature = frame.signature_of(description) if check else 0
        self._deadline = time.monotonic() + self.timeout
        self._sent.clear()
        self._received.clear()

    def begin_signed(self, description: str, signature: int) -> None:
        """``begin`` with the signature already computed (``frame.signature_of(description)``,
        or 0 when checks are off): the per-call path of a collective whose description repeats.
        """
        self.seq += 1
        self.description = description
        self.signature = signature
        self._deadline = time.monotonic() + self.timeout
        if self._sent:
            self._sent.clear()
        if self._received:
            self._received.clear()

    def exchange(self, sends: Sequence[tuple[int, object]] = (),
                 recvs: Sequence[tuple[int, object]] = (), lend: bool = False) -> None:
        """Sends each ``(peer, buffer)`` and receives into each ``(peer, buffer)``, concurrently.

        Buffers are contiguous arrays or memoryviews; only their bytes travel, so a receive
        buffer must have exactly the size of the matching send. Messages between two ranks
        arrive in the order they were posted.

        Args:
            lend: the send buffers may go out by reference; the caller then leaves them
                unwritten until ``settle`` returns (or the peer's later messages prove it has
                read them). Without it, send buffers may be reused as soon as this returns.
        """
        ops: list[Send | Recv] = []
        for peer, buf in sends:
            step = self._sent.get(peer, 0)
            self._sent[peer] = step + 1
            payload = _bytes_view(buf)
            pair = self.pairs[peer]
            flags = address = 0
            if lend and pair.lends and payload.nbytes >= LEND_MIN_BYTES:
                flags, address = frame.LENT, np.frombuffer(payload, np.uint8).ctypes.data
            header = frame.pack(frame.Kind.DATA, self.seq, step, self.signature, payload.nbytes,
                                flags)
            ops.append(Send(pair, header, payload, address))
        for peer, buf in recvs:
            step = self._received.get(peer, 0)
            self._received[peer] = step + 1
            expect = Expect(self.seq, step, self.signature, self._describe)
            ops.append(Recv(self.pairs[peer], expect, _bytes_view(buf)))
        wait_all(ops, self._deadline, self.on_idle,
                 lambda: self._waiting_for(sends, recvs))

    def settle(self) -> None:
        """Returns once every peer of this collective has acknowledged what was lent to it,
        and this rank's own acknowledgements are out; at once when nothing was lent."""
        ops = [Settle(self.pairs[p]) for p in self._sent.keys() | self._received.keys()
               if self.pairs[p].unsettled()]
        if ops:
            wait_all(ops, self._deadline, self.on_idle, lambda: (
                f"collective #{self.seq} {self.description} on rank {self.rank}: waiting for "
                f"rank(s) {sorted(op.pair.peer for op in ops)} to acknowledge lent buffers"))

    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """A reusable uint8 work buffer of at least ``nbytes`` (one per ``slot``).

        Reusing it avoids a fresh allocation, and the page faults that come with it, per call.
        """
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 4096), dtype=np.uint8)
            self._scratch[slot] = buf
        return buf[:nbytes]

    def view(self, ranks: Sequence[int]) -> "CommView":
        """The ranks ``ranks`` (global, in this order, this rank among them) as a communicator
        of their own: rank ``i`` of the view is ``ranks[i]``. See ``CommView``."""
        return CommView(self, ranks)

    def _describe(self) -> str:
        return self.description

    def _waiting_for(self, sends, recvs) -> str:
        peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
        return (f"collective #{self.seq} {self.description} on rank {self.rank}: "
                f"exchanging with rank(s) {peers}")

    def close(self) -> None:
        for pair in self.pairs.values():
            pair.close()


class CommView:
    """A subset or reordering of a Comm's ranks that algorithms can run on unchanged.

    Hierarchical algorithms run a ring inside each host, another across hosts, and a ring
    in topology order renumbers all ranks; each of these is a view. A view has no state of its
    own: its frames go out on the parent's pairs with the parent's sequence number, signature
    and per-pair message counters, so views used one after another inside one collective pair
    up their messages exactly as the parent's own would (every rank walks the same views in
    the same order).

    Args:
        parent: the job's Comm (or another view).
        ranks: global ranks of the view's members, in the view's order; must hold this rank.
    """

    def __init__(self, parent: "Comm | CommView", ranks: Sequence[int]):
        root = parent.root if isinstance(parent, CommView) else parent
        ranks = [parent.ranks[r] for r in ranks] if isinstance(parent, CommView) else list(ranks)
        if root.rank not in ranks:
            raise ValueError(f"rank {root.rank} is not in the view {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a view lists a rank twice: {ranks}")
        self.root, self.ranks = root, ranks
        self.rank, self.size = ranks.index(root.rank), len(ranks)

    @property
    def signature(self) -> int:
        return self.root.signature

    @property
    def lending(self) -> Lending:
        return self.root.lending

    @property
    def lends(self) -> bool:
        """Whether a send to some peer of the view can go out lent."""
        pairs = self.root.pairs
        return any(pairs[r].lends for r in self.ranks if r in pairs)

    def exchange(self, sends: Sequence[tuple[int, object]] = (),
                 recvs: Sequence[tuple[int, object]] = (), lend: bool = False) -> None:
        """``Comm.exchange`` with peers given as ranks of this view."""
        self.root.exchange([(self.ranks[p], b) for p, b in sends],
                           [(self.ranks[p], b) for p, b in recvs], lend)

    def settle(self) -> None:
        """``Comm.settle`` (for all of the parent's peers of this collective)."""
        self.root.settle()

    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        return self.root.scratch(nbytes, slot)

    def view(self, ranks: Sequence[int]) -> "CommView":
        """A view of this view: ``ranks`` are ranks of this view."""
        return CommView(self, ranks)
