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
next). Whether lending pays is measured, not assumed, and so is the segment size of large
ring allreduces over sockets: ``trials.py`` measures, once per Comm (``Comm.tuning``), and the
ring keeps what was chosen in a plan per size (``trials.Plan``, in ``Comm.plans``), set up once
and read on every call; an exchange itself never measures.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import numpy as np

from . import frame
from .base import Expect, Pair, Recv, Send, Settle, wait_all
# The measuring lives in trials.py; its names stay importable from here.
from .trials import LEND_TRIALS, SEGMENT_BLOCK, SEGMENT_TRIALS, Lending, Trials, Tuning

__all__ = ["Comm", "CommView", "Communicator", "Trials", "Lending", "LEND_MIN_BYTES", "LEND_TRIALS",
           "SEGMENT_TRIALS", "SEGMENT_BLOCK"]

#: Smaller sends are copied even when lent: each lent frame costs an acknowledgement.
LEND_MIN_BYTES = 256 << 10


def _bytes_view(buf) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        return buf
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
        segment_trials: rounds of ``segments``' trials; 0 keeps ``chunk_bytes`` always.

    Attributes:
        tuning: what this Comm's collectives have measured (``trials.Tuning``), read when an
            algorithm sets up a plan.
        plans: the per-size plans algorithms keep for all the ranks in order (views have
            their own: ``CommView.plans``).
    """

    # Slots for what a compiled prepared run (``_shmfast.c``'s Prepared) writes per call at
    # their offsets, as ``begin_signed`` does; the rest goes in the instance's dict.
    __slots__ = ("seq", "description", "signature", "timeout", "_deadline", "_sent",
                 "_received", "__dict__", "__weakref__")

    def __init__(self, rank: int, size: int, pairs: Mapping[int, Pair], timeout: float,
                 on_idle: Callable[[float], None] = lambda waited: None,
                 segment_trials: "int | None" = None):
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
        self.tuning = Tuning(segment_trials)
        self.plans = self.tuning.plans_of(tuple(range(size)))

    @property
    def lending(self) -> Lending:
        """Whether large collectives lend (``Tuning.lending``)."""
        return self.tuning.lending

    @property
    def segment_trials(self) -> int:
        """Rounds of ``segments``' trials (``Tuning.segment_trials``)."""
        return self.tuning.segment_trials

    @property
    def lends(self) -> bool:
        """Whether a send to some peer can go out lent (``exchange(lend=True)``)."""
        return any(pair.lends for pair in self.pairs.values())

    def segments(self, chunk_bytes: int, nbytes: int,
                 ranks: "Sequence[int] | None" = None) -> "Trials[int] | None":
        """The trials of segment sizes for ring allreduces of about ``nbytes`` among ``ranks``
        (global ranks in ring order; default all), or None: ``Tuning.segments``, where the
        ring's trials count a socket among its pairs."""
        ranks = tuple(range(self.size)) if ranks is None else tuple(ranks)
        pairs = self.pairs
        return self.tuning.segments(ranks, chunk_bytes, nbytes, lambda: any(
            pairs[r].is_socket for r in ranks if r != self.rank))

    def begin(self, description: str, check: bool = True) -> None:
        """Starts the next collective. Every rank must call it with the same description."""
        self.seq += 1
        self.description = description
        self.signature = frame.signature_of(description) if check else 0
        self._deadline = time.monotonic() + self.timeout
        self._sent.clear()
        self._received.clear()

    def begin_signed(self, description: str, signature: int) -> float:
        """``begin`` with the signature already computed (``frame.signature_of(description)``,
        or 0 when checks are off): the per-call path of a collective whose description repeats.
        Returns the collective's deadline (``time.monotonic()`` seconds), for a caller that
        hands it on rather than reading the clock again. (``_shmfast.c``'s compiled prepared
        run takes these steps too, on this class's slots: a change here is one there.)"""
        self.seq += 1
        self.description = description
        self.signature = signature
        self._deadline = deadline = time.monotonic() + self.timeout
        if self._sent:
            self._sent.clear()
        if self._received:
            self._received.clear()
        return deadline

    def exchange(self, sends: Sequence[tuple[int, object]] = (),
                 recvs: Sequence[tuple[int, object]] = (), lend: bool = False) -> None:
        """Sends each ``(peer, buffer)`` and receives into each ``(peer, buffer)``, concurrently.

        Buffers are contiguous arrays or memoryviews; only their bytes travel, so a receive
        buffer must have exactly the size of the matching send. Messages between two ranks
        arrive in the order they were posted, several to one peer in one call included.

        Args:
            lend: the send buffers may go out by reference; the caller then leaves them
                unwritten until ``settle`` returns (or the peer's later messages prove it has
                read them). Without it, send buffers may be reused as soon as this returns.
        """
        ops: list[Send | Recv] = []
        seq, signature, pairs = self.seq, self.signature, self.pairs
        sent = self._sent
        last_sent: dict[int, Send] = {}  # the previous send to each peer in this call
        for peer, buf in sends:
            step = sent.get(peer, 0)
            sent[peer] = step + 1
            payload = _bytes_view(buf)
            pair = pairs[peer]
            flags = address = 0
            if lend and pair.lends and payload.nbytes >= LEND_MIN_BYTES:
                flags, address = frame.LENT, np.frombuffer(payload, np.uint8).ctypes.data
            send = Send(pair, frame.pack(frame.Kind.DATA, seq, step, signature, payload.nbytes,
                                         flags), payload, address, last_sent.get(peer))
            last_sent[peer] = send
            ops.append(send)
        received = self._received
        last_received: dict[int, Recv] = {}  # and the previous receive from each
        for peer, buf in recvs:
            step = received.get(peer, 0)
            received[peer] = step + 1
            payload = _bytes_view(buf)
            recv = Recv(pairs[peer], Expect(seq, step, signature, self._describe, payload.nbytes),
                        payload, last_received.get(peer))
            last_received[peer] = recv
            ops.append(recv)
        wait_all(ops, self._deadline, self.on_idle, self._waiting_for, sends, recvs)

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
        self.root: Comm = root
        self.ranks: list[int] = ranks
        self.rank, self.size = ranks.index(root.rank), len(ranks)
        self.plans = root.tuning.plans_of(tuple(ranks))

    @property
    def signature(self) -> int:
        return self.root.signature

    @property
    def tuning(self) -> Tuning:
        return self.root.tuning

    @property
    def lending(self) -> Lending:
        return self.root.lending

    def segments(self, chunk_bytes: int, nbytes: int) -> "Trials[int] | None":
        """``Comm.segments`` of the view's ranks."""
        return self.root.segments(chunk_bytes, nbytes, self.ranks)

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


#: What collective algorithms run on: the job's Comm, or a view of some of its ranks.
Communicator = Comm | CommView
