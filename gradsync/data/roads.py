"""How one batch comes to a worker: polled from a same-host server's slots, or by ``take`` calls.

``Roads`` is the part of an epoch's iterator (``Epoch``, ``epoch.py``) that brings the next
item of data server ``s``'s stream to the worker, checked against the plan:

- the *poll road*, from a server on this host (``_take``): no message. The loop's own
  ``next()`` polls the stream's slot table in shared memory (``slots.py``), the servers having
  prepared ``prefetch`` batches ahead, and reads the batch into a fresh buffer, which acks
  the slot with a one-sided write; or, with ``Loader(copy=False)``, lends the loop the slot
  itself (*borrowed*), acked when the loop asks for the next batch (``Epoch._release``).
- the *take road*, from a server on another host (``_call``): ``take`` calls whose replies
  carry the batches' bytes: ``data_takes`` of them (by default one) in flight per server on
  the one connection (more are pipelined, answered in order), together asking for up to
  ``data_window`` batches, each take bringing the one it asks for and those after it that the
  server has ready (a take sent while the worker holds batches waits there until all but one
  of them are: ``_post``); the next take is sent as soon as a reply is in, so its round trip
  runs while the batches in hand are used. A same-host server whose slots are mapped here
  but not polled answers takes without the bytes (the worker reads the slot), and a polled
  one answers a take with the message of a sample that failed.

Every item is checked against the plan (``_check``: its epoch, index and samples) and its
times are kept for ``Loader.transfers()``. What the roads read and move on in the Loader is
named by ``EpochLoader``: the Loader (``loader.py``) makes the epochs, so this module and
``epoch.py`` cannot import it.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import GradsyncTimeoutError, PeerLostError
from .layout import Layout
from .plan import Batch

if TYPE_CHECKING:
    from ..transport.region_peer import Posted

__all__ = ["EpochLoader", "Roads"]


class EpochLoader(Protocol):
    """The ``Loader`` as its epochs see it (``loader.py``; ``server_set.py`` for the links)."""

    servers: int
    copy: bool
    prefetch: int
    window: int  # items asked for per data server on another host
    takes: int  # takes in flight per data server on another host
    inline_reply_bytes: int
    generation: int
    collate: Any
    spec: Any
    layout: Layout | None
    slot_bytes: int
    lost: set[int]
    peers: list
    slots: list
    pollers: list
    _seq: list[int]
    _timeout: float
    _take_wait: float | None
    _transfers: collections.deque

    def _adopt(self, epoch: int, orphans: list[Batch]) -> list[tuple[Batch, int]]: ...

    def _lose(self, server: int, error: BaseException) -> None: ...

    def _ended(self, run: Any) -> None: ...


class Roads:
    """The roads of an epoch's batches (a base of ``Epoch``, which sets this state up)."""

    loader: EpochLoader
    epoch: int
    borrow: bool  # the poll road lends the loop the slot itself (``copy=False``)
    _stopping: bool
    # (poller, seq) of a borrowed slot, released at the next batch
    _held: tuple[Any, int] | None
    # Batches of each server still in ``work``: how many more items to ask a remote one
    # for (``_post``); its takes in flight, (items asked for, take) in the order sent,
    # by server; the items a take brought beyond the one needed then, (seq, answer,
    # bytes) in stream order, by server.
    _left: collections.Counter
    _posted: dict[int, collections.deque]
    _got: dict[int, collections.deque]

    def _take(self, batch: Batch, s: int) -> np.ndarray | None:
        """Batch ``batch`` from data server ``s``, in this worker's buffer or (borrowed) a
        view of the slot (None: the epoch was stopped before it came)."""
        loader = self.loader
        road = loader.pollers[s]
        if road is None:
            return self._call(batch, s)
        seq = loader._seq[s]
        start = time.perf_counter()
        header, waited = road.wait(seq, loader._timeout, lambda: self._stopping)
        if header is None:
            if self._stopping:
                return None
            # The server said a sample failed: its take raises the message (or answers, if
            # this item was published after all).
            return self._call(batch, s)
        polled = time.perf_counter()
        self._check(s, header.epoch, header.index, header.ids, batch)
        if header.generation != loader.generation:
            raise RuntimeError(f"data server {s} published item {seq} for generation "
                               f"{header.generation}; this worker is in generation "
                               f"{loader.generation}")
        if self.borrow:
            buf = road.view(header)
            self._held = (road, seq)
        else:
            # A fresh buffer each batch: the tensors handed to the loop view it for as long
            # as the loop keeps them, and the slot is rewritten as soon as it is acked.
            buf = np.empty(header.nbytes, dtype=np.uint8)
            road.read(header, buf)
        loader._seq[s] += 1
        loader._transfers.append((polled - start, waited, time.perf_counter() - polled,
                                  buf.nbytes))
        return buf

    def _check(self, s: int, epoch: int, index: int, ids, batch: Batch) -> None:
        # Both int64 arrays on the poll road: their bytes compare without NumPy's dispatch;
        # a take's list (JSON) against the plan's as a list, without making it an array.
        same = ids.tobytes() == batch.ids.tobytes() if isinstance(ids, np.ndarray) \
            and ids.dtype == batch.ids.dtype else list(ids) == batch.ids.tolist()
        if index != batch.index or epoch != self.epoch or not same:
            raise RuntimeError(f"data server {s} sent batch {index} of epoch {epoch} (samples "
                               f"{list(ids)[:8]}...) where the plan has batch {batch.index} "
                               f"of epoch {self.epoch} (samples {batch.ids.tolist()[:8]}...)")

    def _ask(self, s: int, seq: int | None, count: int, least: int = 1) -> "Posted":
        """Sends data server ``s`` a ``take`` and returns it in flight (``RemotePeer.post``):
        for item ``seq``, or without it for the item after those its takes in flight will
        have answered; with its bytes attached when its slots are not mapped here (they
        cross the connection once, into a fresh buffer), and then those of the next
        ``count - 1`` items that are ready, answered once ``least`` of them are. It
        releases the items received so far."""
        loader = self.loader
        peer = loader.peers[s]
        args = {"wait": loader._take_wait, "release": loader._seq[s]}
        if seq is not None:
            args["seq"] = seq
        if loader.slots[s].direct is not None:
            return peer.post_call("take", **args)

        def buffer(reply: dict) -> np.ndarray:
            return np.empty(reply["attached"], dtype=np.uint8)

        return peer.post_call_into("take", buffer, send=True, count=count, least=least,
                                   **args)

    def _call(self, batch: Batch, s: int) -> np.ndarray | None:
        """Batch ``batch`` by ``take`` calls (from another host, or a same-host server
        whose table is not polled); None: the epoch was stopped before it came.

        ``loader._seq[s]`` counts the items of the stream received (the next one to come).
        Up to ``takes`` takes of the server are in flight at once (``_post``), asking for
        up to ``window`` items together; their replies come in order, each checked against
        the item it should bring, and the items a reply brought beyond the one needed now
        wait in ``_got[s]`` for their batches' turn. As soon as a reply is in, the next
        take is sent, while the batches already here are checked and handed on, so a batch
        that the server makes ready finds a take waiting for it."""
        loader = self.loader
        start = time.perf_counter()
        waited = 0.0
        got, posted = self._got[s], self._posted[s]
        while not got:
            self._post(s, 1)
            if not posted:  # stopped, or given up meanwhile: nothing was asked
                if self._stopping:
                    return None
                raise PeerLostError(f"data server {s} was given up", peer=s)
            # Answered within ``_take_wait`` while the server runs: "pending" when the batch
            # is not ready yet, so that a slow batch is never a silent server.
            try:
                answer = posted[0][1].wait()
            except BaseException:
                # The takes behind it are received and dropped: the items they bring were
                # not released, and the server's stream goes on from what this worker holds.
                posted.clear()
                raise
            posted.popleft()
            info, attached = answer if isinstance(answer, tuple) else (answer, None)
            waited += float(info.get("waited", 0.0))
            if info.get("pending"):  # a take behind it asks for the same item
                if self._stopping:
                    return None
                if s in loader.lost:  # the liveness watch gave it up meanwhile
                    raise PeerLostError(f"data server {s} was given up", peer=s)
                if time.perf_counter() - start > loader._timeout:
                    raise GradsyncTimeoutError(f"data server {s} did not prepare this "
                                               f"worker's item {loader._seq[s]} within "
                                               f"{loader._timeout:.0f}s")
                continue
            self._received(s, info, attached)
        taken = time.perf_counter()
        _, info, buf = got.popleft()
        if buf is None:  # its slot is mapped here: read it before a take releases it
            buf = np.empty(info["nbytes"], dtype=np.uint8)
            loader.slots[s].read(buf, info["slot"] * loader.slot_bytes)
            loader._seq[s] += 1
        self._post(s, 0)  # the next takes go out while this batch is checked and handed on
        self._check(s, info["epoch"], info["index"], info["ids"], batch)
        # (The read's seconds include the next takes' sending, as they included the take
        # asked ahead before takes were pipelined: ``transfers()`` measures the same span.)
        loader._transfers.append((taken - start, waited, time.perf_counter() - taken,
                                  buf.nbytes))
        return buf

    def _received(self, s: int, info: dict, attached: np.ndarray | None) -> None:
        """Takes in a take's answer from data server ``s``: the items it brings, which
        must be the next ones of the stream, go into ``_got[s]``."""
        loader = self.loader
        first = loader._seq[s]
        if info.get("seq") != first:
            raise RuntimeError(f"data server {s} answered item {info.get('seq')} of this "
                               f"worker's stream where item {first} comes next")
        more = info.pop("more", [])
        got = self._got[s]
        if attached is None:  # no bytes: the worker reads the slot (``_call``)
            got.append((first, info, None))
            return
        at = info["nbytes"]
        got.append((first, info, attached[:at]))
        for k, extra in enumerate(more, 1):  # the items' bytes, one after the other
            got.append((first + k, extra, attached[at:at + extra["nbytes"]]))
            at += extra["nbytes"]
        loader._seq[s] += 1 + len(more)

    def _post(self, s: int, current: int) -> None:
        """Sends data server ``s`` takes for the items of it that this worker's work still
        needs (``current``: 1 while the batch being taken is not here yet), while fewer
        than ``takes`` are in flight and they ask for fewer than ``window`` items together.

        The first take of a run names its item; the ones sent behind it do not (the server
        answers the item after those the one before it answered, which a "pending" answer
        leaves where it was). Each releases the items received so far, so the items asked
        for and not yet released stay within the window, at most the stream's slots: the
        item a take waits for is always one the server may prepare."""
        loader = self.loader
        if self._stopping or s in loader.lost:
            return
        window, takes = loader.window, loader.takes
        if loader.pollers[s] is not None:  # polled: one take, for a failed sample's message
            if not current:
                return
            window = takes = 1
        elif loader.slots[s].direct is not None:  # a reply without bytes: one item each
            window = takes = min(takes, loader.prefetch)
        posted, got = self._posted[s], self._got[s]
        asked = sum(count for count, _ in posted)
        wanted = current + self._left[s] - len(got) - asked
        share = -(-window // takes)  # items a take asks for, at most
        while wanted > 0 and len(posted) < takes and asked < window:
            count = min(share, wanted, window - asked)
            # How many of its items the reply waits for (the server sends it once they are
            # ready): one, when the worker waits for this take with nothing in hand or in
            # flight (a run's first); else all but one. A reply sent as soon as its first
            # item is ready brings one batch whenever the server is the slower side, and
            # each batch then pays a take's request, reply and parse on both ends; one item
            # fewer than asked leaves the server a slot to prepare into while the reply
            # travels and the next take comes back, so its producer never waits for them.
            least = 1 if current and not posted else max(1, count - 1)
            posted.append((count, self._ask(s, None if posted else loader._seq[s], count,
                                            least)))
            asked += count
            wanted -= count
