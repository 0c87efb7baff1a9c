"""A stream's slot table: how a same-host worker learns of a ready batch without a message.

A data server keeps, per worker, ``prefetch`` slots of batch bytes (``server.py``). Beside
them lies this *table*, a small region of shared memory (``table.<worker>``) that the server
writes and the worker polls, so that on one host a batch costs no control round trip: the
worker reads a header, then the slot's bytes, then writes one counter.

The table, in 8-byte words (each group on a 64-byte cache line of its own, so that the
worker's polling never steals the line the server writes, and vice versa)::

    control  word 0: 1 once a sample failed to prepare on this server; word 1, the *bell*:
             items published so far; word 2, the *beat*: counts up every heartbeat interval
             while the server runs (all three written by the server)
    ack      word 8: items of the stream the worker has finished reading; word 9: 1 while
             the worker sleeps on the bell (both written by the worker)
    headers  one line per slot: published (seq + 1, 0 = none), generation, epoch, batch
             index, bytes, sample count, when it was published (``time.monotonic_ns()``,
             one clock for every process of the host: how long the worker waited for the
             batch to be prepared, as ``take`` says it)
    ids      ``batch_size`` words per slot: the batch's sample ids

Publishing item ``seq`` into slot ``s = seq % prefetch``: the server writes the bytes, the ids
and the header's metadata, then the header's ``published`` word, last. The worker that polls
for ``seq`` reads ``published``; when it says ``seq``, it reads the metadata and ids, then
``published`` again, and takes them only if it still says ``seq`` (a seqlock). It then copies
the slot's bytes into its own buffer and writes ``ack = seq + 1`` (a worker that borrows the
slot, ``Loader(copy=False)``, writes it only when its loop takes the next batch); the server
rewrites slot ``s`` (item ``seq + prefetch``) only once it sees that ack. So backpressure (the server's
``prefetch`` credits) and the "taken" accounting need no message either.

Why it is safe without locks: every word has one writer, and x86 (TSO) keeps stores in
program order and loads in program order and never moves a store ahead of an earlier load.
The worker that sees ``published = seq + 1`` sees the bytes and metadata written before it;
the server that sees ``ack = seq + 1`` knows the worker has finished loading item ``seq``'s
bytes before it overwrites them. The same assumptions as the shared-memory rings
(``transport/shm.py``): an aligned 8-byte store is not torn, and glibc's ``memcpy`` fences
its non-temporal stores. Elsewhere (``shm.keeps_store_order`` false) workers ``take``.

Waiting (``Poller``): a worker whose next item is not yet published looks again a few times,
then sleeps on the bell with a futex (``transport/futex.py``, the shared-memory collectives'
protocol): it reads the bell, looks once more, says it sleeps (word 9), and asks the kernel
to sleep while the bell still holds what it read; the server, after each publish, rings the
bell (adds one), fences, and wakes the worker if it said it sleeps. So a published batch
wakes the worker at once, and a waiting worker uses no core: on a host with few cores the
server's producer (and the worker's own training loop, which needs the GIL) must run
meanwhile. Where futexes are missing it naps instead (the transport's nap, ``wait.Nap``:
doubling from 1 us to 0.5 ms). Every 50
ms of waiting it checks that the server is still alive, by its process id and start time as
the shared-memory rings do, and that its region connection has not ended (a ``take`` would
have seen either in its reply), that the worker's liveness watch has not found the server
silent (its beat still: a stopped server, ``liveness.py``), and a deadline (the job's
``timeout``), as a ``take`` would have waited.

Worked example, ``prefetch`` 2: the server publishes items 0 and 1 (slots 0, 1); it may not
write item 2 until ``ack >= 1``. The worker polls slot 0 for item 0 (published 1), reads it,
writes ack 1; the server sees it and writes item 2 into slot 0 (published 3); the worker,
polling slot 1 for item 1 meanwhile, finds published 2 and goes on.
"""

from __future__ import annotations

import platform
import socket
import time

import numpy as np

from ..errors import GradsyncTimeoutError, PeerLostError
from ..transport import shm
from ..transport.futex import Futex, fence
from ..transport.wait import Nap

__all__ = ["SlotTable", "Header", "Poller", "poller", "table_words", "check_open", "ACK_WORD",
           "FAILED_WORD"]

_LINE = 8  # words per cache line
FAILED_WORD, _BELL, _BEAT = 0, 1, 2
ACK_WORD, _SLEEPING = _LINE, _LINE + 1
_HEADERS = 2 * _LINE
# header fields, in words from the start of a slot's header line
_PUBLISHED, _GENERATION, _EPOCH, _INDEX, _NBYTES, _COUNT, _STAMP = range(7)


def table_words(prefetch: int, batch_size: int) -> int:
    """The table's size in 8-byte words for ``prefetch`` slots of ``batch_size`` samples."""
    return _HEADERS + prefetch * _LINE + prefetch * batch_size


def check_open(sock: socket.socket, label: str, peer: int | None) -> None:
    """Raises PeerLostError if the owner's end of the connection ``sock`` is closed (its
    process exited or was killed: the kernel closed it), looking without waiting.

    A peek through a non-blocking duplicate: the connection's own socket has a timeout, with
    which ``recv`` would wait for a byte. Nothing is due while no call is in flight, so a
    peek finds the end (0 bytes), no byte (alive), or a byte of a reply another thread is
    reading (alive; the peek leaves it there)."""
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as probe:
            probe.setblocking(False)
            ended = probe.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return
    except OSError as exc:
        raise PeerLostError(f"lost the connection to {label}: {exc}", peer=peer) from None
    if ended:
        raise PeerLostError(f"{label} closed its connection (did it exit or crash?)",
                            peer=peer)


class Header:
    """What the table says of one published item: as ``take`` answers it."""

    __slots__ = ("seq", "generation", "epoch", "index", "nbytes", "ids", "stamp")

    def __init__(self, seq: int, generation: int, epoch: int, index: int, nbytes: int,
                 ids: np.ndarray, stamp: int = 0):
        self.seq, self.generation, self.epoch = seq, generation, epoch
        self.index, self.nbytes, self.ids = index, nbytes, ids
        self.stamp = stamp  # time.monotonic_ns() when it was published


class SlotTable:
    """One stream's table, seen through an int64 array of ``table_words`` words: the server's
    own region, or the worker's mapping of it.

    Args:
        words: the table's memory (int64, zeroed when the server allocated it).
        prefetch, batch_size: the stream's slots and samples per batch.
    """

    def __init__(self, words: np.ndarray, prefetch: int, batch_size: int):
        if words.dtype != np.int64 or words.size != table_words(prefetch, batch_size):
            raise ValueError(f"a slot table of {prefetch} slots of {batch_size} samples is "
                             f"{table_words(prefetch, batch_size)} int64 words; got "
                             f"{words.size} of {words.dtype}")
        self.words, self.prefetch, self.batch_size = words, prefetch, batch_size
        # None where futexes are missing: the worker naps (and the bell wakes nobody).
        self.futex = Futex.open(words)
        self._headers = words[_HEADERS:_HEADERS + prefetch * _LINE].reshape(prefetch, _LINE)
        self._ids = words[_HEADERS + prefetch * _LINE:].reshape(prefetch, batch_size)
        # The worker's reads go through a memoryview of the words: an item of it is a Python
        # int in a fraction of a NumPy scalar's time, and the poll runs once per batch on a
        # thread whose caches have gone cold while it slept.
        self._view = words.data.cast("B").cast("q")  # ndarray.data: its memoryview

    # ------------------------------------------------------------------ the server's side
    def publish(self, seq: int, generation: int, epoch: int, index: int, nbytes: int,
                ids: np.ndarray) -> None:
        """Announces item ``seq``, whose bytes are already in slot ``seq % prefetch``."""
        slot = seq % self.prefetch
        header = self._headers[slot]
        self._ids[slot, :len(ids)] = ids
        header[_GENERATION:_STAMP + 1] = (generation, epoch, index, nbytes, len(ids),
                                          time.monotonic_ns())
        header[_PUBLISHED] = seq + 1  # last: the worker trusts nothing before it sees this
        self._ring()

    def _ring(self) -> None:
        self.words[_BELL] += 1  # one writer: no lost update
        if self.futex is not None:
            # The bell's store before the load of the worker's flag (x86 may let a load pass
            # an earlier store): a worker that said it sleeps is woken, one that did not yet
            # sees the new bell and does not sleep (futex.py's protocol).
            fence()
            if self.words[_SLEEPING]:
                self.futex.wake(_BELL * 8)

    def beat(self) -> None:
        """(The server's Python beater thread.) One beat: the server runs."""
        self.words[_BEAT] += 1  # one writer: no lost update

    def beaten_by(self, beats) -> None:
        """(The server.) The native beater (``beater.py``) counts up the beat word from now
        on, every interval, whatever holds the server's GIL; nothing else writes it."""
        beats.add_word(self.words, _BEAT)

    def acked(self) -> int:
        """Items the worker has finished reading (its one-sided counter)."""
        return int(self.words[ACK_WORD])

    def clear(self) -> None:
        """Forgets every published item (the stream goes on re-planned; its worker has read
        every item before the cut and stopped polling): a worker polling for an item from
        the cut on waits for the new one."""
        self._headers[:, _PUBLISHED] = 0

    def fail(self) -> None:
        """Tells the worker that this server can prepare nothing more (a sample failed)."""
        self.words[FAILED_WORD] = 1
        self._ring()

    # ------------------------------------------------------------------ the worker's side
    def poll(self, seq: int) -> Header | None:
        """Item ``seq``'s header when it is published, else None."""
        view, slot = self._view, seq % self.prefetch
        at = _HEADERS + slot * _LINE
        if view[at + _PUBLISHED] != seq + 1:
            return None
        meta = view[at:at + _LINE].tolist()
        first = _HEADERS + self.prefetch * _LINE + slot * self.batch_size
        ids = np.array(view[first:first + meta[_COUNT]], dtype=np.int64)
        # Read again after the metadata (seqlock): a header rewritten meanwhile (it cannot
        # be, while the worker has not acked ``seq``, unless the stream was re-planned) is
        # not taken.
        if meta[_PUBLISHED] != seq + 1 or view[at + _PUBLISHED] != seq + 1:
            return None
        return Header(seq, meta[_GENERATION], meta[_EPOCH], meta[_INDEX], meta[_NBYTES], ids,
                      meta[_STAMP])

    def ack(self, seq: int) -> None:
        """Item ``seq``'s bytes are in the worker's buffer: its slot is free again."""
        self._view[ACK_WORD] = seq + 1

    def failed(self) -> bool:
        """Whether the server said a sample failed (a ``take`` then fetches the message)."""
        return bool(self._view[FAILED_WORD])

    def beats(self) -> int:
        """The server's beat count (it moves every heartbeat interval while the server runs)."""
        return self._view[_BEAT]

    def bell(self) -> int:
        """The bell: changes whenever the server publishes (read it before the last look)."""
        return self._view[_BELL]

    def sleep(self, bell: int, seconds: float) -> bool:
        """Sleeps at most ``seconds`` while the bell still says ``bell``; False where there
        is no futex to sleep on (the caller naps)."""
        if self.futex is None:
            return False
        self.words[_SLEEPING] = 1
        try:
            # The kernel compares the bell with ``bell`` behind a full barrier, after this
            # thread joined the wait queue: a ring after the flag's store wakes it, one
            # before it changed the bell, and the kernel does not let it sleep.
            return self.futex.wait(_BELL * 8, bell, seconds)
        finally:
            self.words[_SLEEPING] = 0


# The poll's back-off: quick looks, then sleeps on the bell (or, without futexes, the
# transport's naps, ``wait.Nap``); how often the server's liveness is checked while waiting.
_LOOKS, _LIVENESS_EVERY = 8, 0.05


class Poller:
    """A worker's road to one same-host data server's stream: its table, its slots' bytes
    (this process's mapping) and the server process, watched while waiting.

    Args:
        table: the stream's table, mapped.
        slots: the stream's slots, mapped (uint8, ``prefetch * slot_bytes``).
        slot_bytes: bytes per slot.
        pid, started: the server's process id and start time (``shm.process_start_time``).
        label: how errors name the server; ``peer``: its rank, for ``PeerLostError``.
        sock: the worker's region connection to the server, watched for its end (None: not
            watched).
    """

    def __init__(self, table: SlotTable, slots: np.ndarray, slot_bytes: int, pid: int,
                 started: int, label: str, peer: int | None, sock: socket.socket | None = None):
        self.table, self.slots, self.slot_bytes = table, slots, slot_bytes
        self.pid, self.started, self.label, self.peer = pid, started, label, peer
        self.sock = sock
        # Set by the worker's liveness watch when the server's beat stood still too long
        # (stopped): the wait raises it at its next check.
        self.silent: PeerLostError | None = None

    def wait(self, seq: int, timeout: float, stopping) -> tuple[Header | None, float]:
        """Waits until item ``seq`` is published; returns its header (None if the server
        said a sample failed, or ``stopping()`` became true) and the seconds of the wait
        during which it was still being prepared (until the server published it).

        Raises:
            PeerLostError: the server's process is gone.
            GradsyncTimeoutError: nothing within ``timeout`` seconds.
        """
        header = self.table.poll(seq)
        if header is not None:  # the steady state, when the server is ahead
            return header, 0.0
        start_ns = time.monotonic_ns()
        start = time.perf_counter()
        looks, nap = 0, None  # a Nap only where the kernel refuses the futex: rare
        checked = start
        while True:
            if self.table.failed() or stopping():
                return None, time.perf_counter() - start
            now = time.perf_counter()
            if now - checked >= _LIVENESS_EVERY:
                checked = now
                self.check_alive()
                if now - start > timeout:
                    raise GradsyncTimeoutError(
                        f"{self.label} did not prepare this worker's item {seq} within "
                        f"{timeout:.0f}s")
            bell = self.table.bell()  # before the look: a publish after it changes the bell
            header = self.table.poll(seq)
            if header is not None:
                # The rest of the wait, from the publish to here, is the wake-up's.
                return header, max(0, header.stamp - start_ns) / 1e9
            looks += 1
            if looks <= _LOOKS:
                continue
            if not self.table.sleep(bell, _LIVENESS_EVERY):
                nap = nap or Nap()
                nap()

    def check_alive(self) -> None:
        """Raises PeerLostError if the server's process has exited (or its pid was reused),
        its end of the region connection is closed, or it was found silent."""
        if self.silent is not None:
            raise self.silent
        if shm.process_start_time(self.pid) != self.started:
            raise PeerLostError(f"{self.label} (pid {self.pid}, same host) exited or was "
                                "killed while this worker waited for a batch", peer=self.peer)
        if self.sock is not None:
            check_open(self.sock, self.label, self.peer)

    def view(self, header: Header) -> np.ndarray:
        """The item's bytes where they lie, in the slot (``Loader(copy=False)``): valid until
        ``table.ack(header.seq)``, after which the server may write the slot again."""
        at = (header.seq % self.table.prefetch) * self.slot_bytes
        return self.slots[at:at + header.nbytes]

    def read(self, header: Header, out: np.ndarray) -> None:
        """Copies the item's bytes into ``out``, then acks it (its slot is free again).

        No stripe lock, unlike a region read: the server writes this slot again only after
        the ack, so nobody writes the bytes while they are copied."""
        at = (header.seq % self.table.prefetch) * self.slot_bytes
        np.copyto(out, self.slots[at:at + header.nbytes])
        self.table.ack(header.seq)


def poller(peer, ident: int, prefetch: int, batch_size: int, slot_bytes: int) -> Poller | None:
    """The poll road to data server ``peer`` (a ``RemotePeer``) for worker ``ident``'s stream,
    or None where the worker must ``take``: the server's regions are not mapped here (another
    host, ``GRADSYNC_TRANSPORT=tcp``), the CPU may reorder stores, or the server's process
    cannot be watched (another pid namespace, or /proc hides it)."""
    slots, table = peer.region(f"slots.{ident}"), peer.region(f"table.{ident}")
    if slots.direct is None or table.direct is None:
        return None
    if not shm.keeps_store_order(platform.machine()):
        return None
    started = shm.process_start_time(peer.pid)
    if started is None or started == -1:
        return None
    words = table.direct.u8.view(np.int64)
    return Poller(SlotTable(words, prefetch, batch_size), slots.direct.u8, slot_bytes,
                  peer.pid, started, peer.label, peer.ident, peer.sock)
