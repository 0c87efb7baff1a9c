"""One epoch's iterator on a worker: where its batches come from, and the delivered ones.

Each ``iter(loader)`` is one ``Epoch`` (``loader.py`` makes it, once the data servers have
queued the epoch's batches): it yields this worker's batches in plan order, each as the
tensors of the samples' layout (or the collate's), brought by the roads of ``roads.py``, and
keeps the batches *delivered*, those the loop has finished with, for ``state_dict()``.

Two ways to run. When every live data server is on this host (each stream's slot table
polled), the training loop's own ``next()`` polls for the next batch (*inline*): the
servers already prepare ``prefetch`` batches ahead into their slots, so a thread between
them and the loop would add only its hand-over (a queue, and the GIL passed back and
forth) to every batch. So it does over TCP when a take's reply is small (a window of
batches of at most ``INLINE_REPLY_BYTES``): the take for the next batches is sent as
soon as a reply is in (``Roads._call``), its reply lands in the socket's receive buffer while
the loop trains, and the loop's own receive is a copy; the connection's thread watches
the takes in flight for silence meanwhile, and receives a reply the loop has not asked
for within two of its looks (a step longer than 50 ms: ``region_peer.LOOK_S``).
Otherwise (larger batches, which would stream in while the loop waits) a *fetch thread*
takes the batches ahead into the queue, ``prefetch`` of them, so that reads over TCP
overlap the training step.

*Borrowed* batches (``Loader(copy=False)``, inline only): the yielded tensors view the
stream's slot itself, not a copy, and the slot is released (acked) when the loop asks for
the next batch, ends the epoch, or the Loader is reset or closed. So a batch must be used
before the next one is taken (``.clone()`` what is kept longer); in exchange the worker
copies nothing at all.

A data server lost during the epoch (or before it) leaves its batches aside, and once the
live servers' batches are all taken they are handed to the live servers and taken from
them (``_batches``, ``Loader._adopt``): each sample still exactly once, and each server's
stream still taken in the order it was queued.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import numpy as np

from ..errors import PeerLostError
from ..liveness.pace import meter
from .plan import Batch
from .roads import EpochLoader, Roads

__all__ = ["Epoch", "INLINE_REPLY_BYTES"]

_END = object()  # the fetch thread's last item of an epoch
# A take's reply of at most this many bytes (a window of batches) is taken by the training
# loop itself, without a fetch thread (``Epoch``): it fits in the socket's receive buffer as
# the kernel grants it from the start (Linux's tcp_rmem default, 128 KiB, of which half
# holds data), so it arrives there while the loop trains, and the loop's receive is a copy.
INLINE_REPLY_BYTES = 64 << 10


class Epoch(Roads):
    """One epoch's iterator on a worker (see the module's docstring)."""

    def __init__(self, loader: EpochLoader, epoch: int, work: list[tuple[Batch, int]],
                 orphans: list[Batch], done: np.ndarray | None):
        self.loader, self.epoch = loader, epoch
        self.done = done  # the samples delivered before the epoch started (a resumed one)
        self.work, self.orphans = collections.deque(work), orphans
        self.delivered: list[np.ndarray] = []
        self.in_hand: np.ndarray | None = None
        self.ids: np.ndarray | None = None  # the sample ids of the batch last yielded
        self._stopping = False
        # The roads' state (``Roads`` says what each holds).
        self._left = collections.Counter(s for _, s in work)
        self._posted = collections.defaultdict(collections.deque)
        self._got = collections.defaultdict(collections.deque)
        self._held = None
        self._failed: BaseException | None = None  # raised again by every later next()
        live = [d for d in range(loader.servers) if d not in loader.lost]
        self.inline = all(loader.pollers[d] is not None for d in live) \
            or loader.window * loader.slot_bytes <= loader.inline_reply_bytes
        self.borrow = self.inline and not loader.copy
        self._items = self._batches()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if not self.inline:
            self._queue = queue.Queue(maxsize=loader.prefetch)
            self._thread = threading.Thread(target=self._fetch, daemon=True,
                                            name="gradsync-data-fetch")
            self._thread.start()

    def _batches(self):
        """Yields (batch, buffer) for this worker's batches in plan order.

        The batches of a data server lost on the way (or before the epoch) are set aside and,
        once the live servers' batches are all taken, handed to the live servers and taken
        from them: so each server's stream is always taken in the order it was queued."""
        loader = self.loader
        while self.work or self.orphans:
            if not self.work:
                adopted = loader._adopt(self.epoch, self.orphans)
                self.work.extend(adopted)
                self._left.update(s for _, s in adopted)
                self.orphans = []
            batch, s = self.work.popleft()
            self._left[s] -= 1
            if s in loader.lost and not self._got[s]:
                # (A batch whose bytes came before the loss is received: it is handed on.)
                self.orphans.append(batch)
                continue
            try:
                buf = self._take(batch, s)
            except PeerLostError as exc:
                if self._stopping:  # the Loader is closing its connections: no loss
                    return
                loader._lose(s, exc)
                self.orphans.append(batch)
                continue
            if buf is None:  # stopped while waiting: the batch was not taken
                return
            yield batch, buf

    def _fetch(self) -> None:
        """(The fetch thread.) Takes the batches ahead of the loop into the queue."""
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the training loop, which raises it
            self._put(exc)

    def _put(self, item) -> bool:
        assert self._queue is not None  # only the fetching thread puts, and it has its queue
        while not self._stopping:
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def acknowledge(self) -> None:
        """The batch in hand is delivered (the loop finished with it)."""
        if self.in_hand is not None:
            self.delivered.append(self.in_hand)
            self.in_hand = None

    def _release(self) -> None:
        """Frees the borrowed slot of the batch last yielded (its ack)."""
        if self._held is not None:
            road, seq = self._held
            self._held = None
            road.table.ack(seq)

    def _next_item(self):
        if self._failed is not None:  # the batches stopped at an error: never a silent end
            return self._failed
        if self._queue is not None:
            return self._queue.get()
        try:
            return next(self._items)
        except StopIteration:
            return _END
        except BaseException as exc:
            return exc

    def __next__(self):
        self.acknowledge()
        self._release()
        began = time.monotonic_ns()
        item = self._next_item()
        # The loop's wait for this batch: its step's "data" (pace.py), not its compute.
        meter.waited_for_data(began, time.monotonic_ns())
        if item is _END:
            self.loader._ended(self)
            raise StopIteration
        if isinstance(item, BaseException):
            self._failed = item
            self.stop()
            raise item
        batch, buf = item
        self.in_hand = self.ids = batch.ids
        loader = self.loader
        if loader.collate is not None:
            return loader.collate.unpack(loader.spec, buf, len(batch.ids))
        assert loader.layout is not None  # a Loader without a collate has the samples' layout
        return loader.layout.unpack(buf, len(batch.ids))

    def stop(self) -> None:
        self._stopping = True
        self._release()

    def join(self, timeout: float) -> None:
        """Waits for the fetch thread to end (after ``stop``)."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the data fetch thread did not stop within {timeout:.0f}s")
