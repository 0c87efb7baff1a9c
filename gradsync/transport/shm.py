"""Shared memory between two ranks on one host: a byte ring per direction.

Each direction is a single-producer/single-consumer *ring* in a segment of ``/dev/shm``.
The receiver owns (creates) its inbound ring; the sender attaches to it. A ring carries the
same frames as TCP (``frame.py``: the 40-byte header, then the payload), so the receiver
reads and validates the header (``Recv.check_header``) before a byte of payload is copied
into the destination buffer, exactly as over a socket.

Two counters describe a ring, both byte *positions* that only ever grow (64 bits never wrap:
at 10 GB/s that is 58 years):

    write   bytes the producer has published (written by the producer only)
    read    bytes the consumer has finished with (written by the consumer only)

``write - read`` bytes are readable and ``capacity - (write - read)`` are free; a position
``p`` lives at byte ``p % capacity`` of the data area. Worked example, capacity 8, a frame
of 12 bytes (a 4-byte header for brevity, then 8 bytes of payload)::

    send: read=0 write=0  free 8  copy bytes 0..7 to 0..7          publish write=8
    recv: read=0 write=8  avail 8 header 0..3, check it; payload 4..7  publish read=8
    send: read=8 write=8  free 8  copy bytes 8..11 to 0..3 (wrapped) publish write=12
    recv: read=8 write=12 avail 4 payload 8..11 from 0..3            publish read=12

Neither side ever blocks: ``advance_send``/``advance_recv`` copy what fits and return, and
``wait_all`` polls them (``fileno`` is -1) on the spin, yield, nap ladder of ``wait.py``.

Why no locks: each counter has one writer, sits alone on its 64-byte cache line (so the
consumer's polling does not steal the line the producer writes, and vice versa), and is
published *after* the bytes it covers. That is enough on x86-64, whose memory model (TSO)
keeps stores in program order and loads in program order, and never moves a store ahead of
an earlier load: the consumer that sees ``write = w`` also sees every byte below ``w``, and
the producer that sees ``read = r`` knows the consumer has finished loading every byte below
``r`` before it overwrites them. Two more assumptions hold in practice: a 64-bit aligned
store from a memoryview item assignment is one instruction (not torn), and glibc's
``memcpy``, which uses non-temporal (weakly ordered) stores for large copies, ends them with
an ``sfence``. ARM and POWER reorder stores, and Python has no fence to put between them;
this module refuses to run there (``require_tso``).

Segment lifecycle (``open_pairs`` does it all): every rank creates its inbound rings; a
barrier; every rank attaches to its outbound rings; a second barrier; every rank unlinks the
segments it created. From then on the rings live only as mappings, so nothing is left in
``/dev/shm`` however the job ends, even under ``kill -9``.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import re
from typing import Callable, Mapping

from ..errors import PeerLostError, ProtocolError
from . import frame
from .base import Pair, Recv, Send

__all__ = ["ShmPair", "DEFAULT_CAPACITY", "ring_bytes", "keeps_store_order", "SHM_DIR", "open_pairs", "ring_name", "create_ring",
           "attach_ring", "unlink_ring", "create_segment", "attach_segment", "unlink_segment",
           "check_job_id", "process_start_time", "require_tso"]

SHM_DIR = "/dev/shm"
DEFAULT_CAPACITY = 4 << 20
CACHE_LINE = 64

# The ring's control area: four cache lines of which each is written by one side only.
# Indices count 64-bit words.
_WRITE = 0              # line 0: write position (producer)
_READ = 8               # line 1: read position (consumer)
_WRITER_CLOSED = 16     # line 2: the producer closed its end (producer)
_READER_CLOSED = 24     # line 3: the consumer closed its end (consumer)
_DATA = 4 * CACHE_LINE  # the data area follows

# Largest copy between two publications of a counter: a quarter of the ring, at most 1 MiB.
# Publishing often lets the consumer copy out while the producer still copies in, instead of
# the two taking turns over whole rings (whole-ring chunks were never faster:
# docs/benchmarks-history.md, "Measurement notes moved out of the code"). Publishing costs
# one store, so smaller chunks would only add Python overhead per call.
_CHUNK = 1 << 20

_JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def ring_bytes(capacity: int = DEFAULT_CAPACITY) -> int:
    """Bytes of /dev/shm one byte ring of ``capacity`` takes (its control lines included)."""
    return _DATA + capacity


def keeps_store_order(machine: str) -> bool:
    """Whether CPUs of ``machine`` (``platform.machine()``) keep stores in order, as the
    rings' lock-free protocol needs (x86)."""
    return machine.lower() in _TSO_MACHINES


def require_tso() -> None:
    """Raises NotImplementedError unless this CPU keeps stores in order (x86)."""
    machine = platform.machine().lower()
    if not keeps_store_order(machine):
        raise NotImplementedError(
            f"gradsync's shared-memory transport relies on x86 store ordering and this is "
            f"{machine!r}; use the tcp transport (GRADSYNC_TRANSPORT=tcp)")


def check_job_id(job: str) -> str:
    """Returns ``job`` if it can be part of a file name in /dev/shm; raises ValueError."""
    if not isinstance(job, str) or not _JOB_ID.fullmatch(job):
        raise ValueError(f"job id {job!r} must be 1-128 characters of A-Z a-z 0-9 _ . -")
    return job


# --- segments ----------------------------------------------------------------------------

def create_segment(name: str, size: int) -> mmap.mmap:
    """Creates ``/dev/shm/<name>`` of ``size`` zero bytes and maps it; fails if it exists.

    Raises:
        FileExistsError: a segment of that name exists (a live job with the same id, or one
            killed between creating and unlinking its segments: remove it by hand).
        OSError: /dev/shm has no room for ``size`` bytes.
    """
    if size <= 0:
        raise ValueError(f"segment size must be positive, got {size}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"shared-memory segment {path} already exists: is "
                              f"another job using the id, or did a killed one leave it? "
                              f"Remove it or use another job id", path) from None
    try:
        os.ftruncate(fd, size)
        # ftruncate only sets the size: tmpfs allocates pages on first touch, and a touch
        # that finds /dev/shm full kills the process with SIGBUS in the middle of a
        # collective. Reserving the pages now turns that into an error here.
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OSError(exc.errno, f"cannot reserve {size} bytes in {SHM_DIR} for {name}: "
                              f"{exc.strerror}; enlarge {SHM_DIR} (docker run --shm-size) or "
                              f"use smaller shared-memory buffers") from None
        return _map(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def attach_segment(name: str) -> mmap.mmap:
    """Maps the existing segment ``/dev/shm/<name>`` (all of it)."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"shared-memory segment {path} does not exist: "
                                f"attach only after its creator has created it (a barrier) and "
                                f"before it unlinks it (a second barrier)", path) from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"shared-memory segment {path} is empty")
        return _map(fd, size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    """Removes ``/dev/shm/<name>``; mappings stay valid until unmapped. Missing is fine."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def unlink_prefixed(prefix: str) -> list[str]:
    """Removes every ``/dev/shm/<prefix>*``; returns the names removed. For a process that
    replaces a killed one under the same names (its predecessor has exited: SIGKILL left
    them), never for names a live process may still create or map."""
    if not prefix or "/" in prefix:
        raise ValueError(f"not a segment name prefix: {prefix!r}")
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        if name.startswith(prefix):
            unlink_segment(name)
            removed.append(name)
    return removed


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE fills the page tables now, so the first collective does not pay a minor
    # page fault per 4 KiB page (about 0.1 us each, 16k of them for 64 MiB).
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


# --- is the peer alive? ---------------------------------------------------------------------

def process_start_time(pid: int) -> "int | None":
    """The start time (clock ticks since boot) of live process ``pid``, None if gone or a zombie.

    A pid alone may be reused by an unrelated process after the peer died; pid plus start
    time may not. Returns -1 when /proc does not let us look (hidepid): assume alive.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return -1
    # Field 2, the command name, is in parentheses and may itself hold spaces or ')'.
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X", b"x"):  # field 3, the state: zombie or dead
        return None
    return int(fields[19])  # field 22


# --- rings -----------------------------------------------------------------------------------

def ring_name(job: str, dst: int, src: int) -> str:
    """Name of the segment carrying frames from rank ``src`` to rank ``dst``."""
    return f"gradsync-{check_job_id(job)}-{dst}-{src}"


def create_ring(job: str, dst: int, src: int, capacity: int = DEFAULT_CAPACITY) -> mmap.mmap:
    """Creates the ring from ``src`` to ``dst`` (called by the receiver, ``dst``)."""
    if capacity < 1:
        raise ValueError(f"ring capacity must be at least 1 byte, got {capacity}")
    return create_segment(ring_name(job, dst, src), _DATA + capacity)


def attach_ring(job: str, dst: int, src: int) -> mmap.mmap:
    """Maps the ring from ``src`` to ``dst`` (called by the sender, ``src``)."""
    seg = attach_segment(ring_name(job, dst, src))
    if len(seg) <= _DATA:
        raise ValueError(f"{ring_name(job, dst, src)} is {len(seg)} bytes: not a gradsync ring")
    return seg


def unlink_ring(job: str, dst: int, src: int) -> None:
    unlink_segment(ring_name(job, dst, src))


class _Ring:
    """One end of a ring: the mapping, its counters, and this side's cached position."""

    __slots__ = ("seg", "ctl", "data", "capacity", "chunk", "pos")

    def __init__(self, seg: mmap.mmap, mine: int):
        self.seg = seg
        self.ctl = memoryview(seg)[:_DATA].cast("Q")
        self.data = memoryview(seg)[_DATA:]
        self.capacity = len(self.data)
        self.chunk = max(1, min(_CHUNK, self.capacity // 4))
        # This side is the only writer of counter ``mine``, so it can keep the value in a
        # Python int and never read it back from shared memory.
        self.pos = self.ctl[mine]

    def put(self, src: memoryview) -> None:
        """Copies ``src`` in at the write position, wrapping; the caller publishes."""
        n, cap = len(src), self.capacity
        at = self.pos % cap
        first = min(n, cap - at)
        self.data[at:at + first] = src[:first]
        if n > first:
            self.data[:n - first] = src[first:]
        self.pos += n

    def get(self, dst: memoryview) -> None:
        """Copies ``len(dst)`` bytes out from the read position, wrapping; the caller publishes."""
        n, cap = len(dst), self.capacity
        at = self.pos % cap
        first = min(n, cap - at)
        dst[:first] = self.data[at:at + first]
        if n > first:
            dst[first:] = self.data[:n - first]
        self.pos += n

    def release(self) -> None:
        self.ctl.release()
        self.data.release()
        try:
            self.seg.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when that does


def _bytes(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class ShmPair(Pair):
    """This rank's shared-memory connection to rank ``peer`` on the same host.

    Args:
        peer: the peer's rank.
        peer_pid: the peer's process id (in this pid namespace), watched by ``check_alive``.
        inbound: the mapped ring from the peer to this rank (created by this rank).
        outbound: the mapped ring from this rank to the peer (created by the peer).

    Raises:
        PeerLostError: ``peer_pid`` is not a live process.
    """

    fileno = -1

    def __init__(self, peer: int, peer_pid: int, inbound: mmap.mmap, outbound: mmap.mmap):
        require_tso()
        self.peer, self.peer_pid = peer, peer_pid
        self._peer_started = process_start_time(peer_pid)
        if self._peer_started is None:
            raise PeerLostError(f"rank {peer} (pid {peer_pid}) is not running", peer=peer)
        # None once closed; only ``moved`` may still be asked then (an operation on a closed
        # pair is a caller's bug).
        self._in: _Ring | None = _Ring(inbound, _READ)
        self._out: _Ring | None = _Ring(outbound, _WRITE)

    def moved(self) -> int:
        # The rings' own positions: bytes written out and read in (another thread's view of
        # them may lag by the copy in progress, never more). The pace thread may ask after
        # ``close`` (traffic.py): a closed pair counts nothing, as a closed TCP pair does.
        out, inb = self._out, self._in
        if out is None or inb is None:
            return 0
        return out.pos + inb.pos

    def advance_send(self, op: Send) -> bool:
        out = self._out
        assert out is not None, "send on a closed pair"
        hlen = len(op.header)
        while op.offset < op.total:
            free = out.capacity - (out.pos - out.ctl[_READ])
            if free <= 0:
                if out.ctl[_READER_CLOSED]:
                    raise self._lost("closed its end")
                return False
            if op.offset < hlen:
                src = memoryview(op.header)[op.offset:]
            else:
                src = _bytes(op.payload)[op.offset - hlen:]
            n = min(len(src), free, out.chunk)
            out.put(src[:n])
            op.offset += n
            out.ctl[_WRITE] = out.pos  # publish only after the bytes are in (see top)
        return True

    def advance_recv(self, op: Recv) -> bool:
        inb = self._in
        assert inb is not None, "receive on a closed pair"
        if op.header_got < frame.HEADER_SIZE:
            avail = inb.ctl[_WRITE] - inb.pos
            n = min(frame.HEADER_SIZE - op.header_got, avail)
            if n <= 0:
                return False
            inb.get(memoryview(op.header_buf)[op.header_got:op.header_got + n])
            op.header_got += n
            inb.ctl[_READ] = inb.pos
            if op.header_got < frame.HEADER_SIZE:
                return False
            op.check_header()  # before any payload lands in the caller's buffer
        payload = _bytes(op.payload)
        total = payload.nbytes
        while op.offset < total:
            avail = inb.ctl[_WRITE] - inb.pos
            if avail <= 0:
                return False
            n = min(total - op.offset, avail, inb.chunk)
            inb.get(payload[op.offset:op.offset + n])
            op.offset += n
            inb.ctl[_READ] = inb.pos  # the producer may now reuse these bytes
        return True

    def peek_header(self) -> "frame.Header | None":
        inb = self._in
        assert inb is not None, "peek on a closed pair"
        if inb.ctl[_WRITE] - inb.pos < frame.HEADER_SIZE:
            return None
        raw = bytearray(frame.HEADER_SIZE)
        inb.get(memoryview(raw))
        inb.pos -= frame.HEADER_SIZE  # not taken: the read position is published unchanged
        try:
            return frame.unpack(raw)
        except ProtocolError:
            return None  # the receive that takes it reports it

    def check_alive(self) -> None:
        inb, out = self._in, self._out
        assert inb is not None and out is not None, "check_alive on a closed pair"
        if inb.ctl[_WRITER_CLOSED] and inb.ctl[_WRITE] == inb.pos:
            raise self._lost("closed its end")
        if out.ctl[_READER_CLOSED]:
            raise self._lost("closed its end")
        started = process_start_time(self.peer_pid)
        if started is None or (started != self._peer_started and started != -1):
            raise self._lost("exited or was killed")

    def _lost(self, what: str) -> PeerLostError:
        return PeerLostError(f"rank {self.peer} (pid {self.peer_pid}, same host) {what}; "
                             f"shared-memory connection lost", peer=self.peer)

    def close(self) -> None:
        """Tells the peer this end is gone (it raises PeerLostError) and unmaps the rings."""
        inb, out = self._in, self._out
        if inb is None or out is None:
            return
        out.ctl[_WRITER_CLOSED] = 1
        inb.ctl[_READER_CLOSED] = 1
        inb.release()
        out.release()
        self._in = self._out = None


def open_pairs(job: str, rank: int, peer_pids: Mapping[int, int], barrier: Callable[[], None],
               capacity: int = DEFAULT_CAPACITY) -> dict[int, ShmPair]:
    """Connects this rank to each of ``peer_pids`` (rank -> pid, all on this host).

    Every rank of the host calls it at the same time with matching arguments; ``barrier()``
    must return only once every rank of the host has called it (a store barrier).

    Returns:
        A connected ShmPair per peer. No segment remains in /dev/shm once this returns, and
        this rank's are removed even if it raises.
    """
    require_tso()
    peers = sorted(peer_pids)
    created: list[int] = []
    inbound: dict[int, mmap.mmap] = {}
    try:
        for p in peers:
            inbound[p] = create_ring(job, rank, p, capacity)
            created.append(p)
        barrier()  # every inbound ring exists before anyone attaches
        outbound = {p: attach_ring(job, p, rank) for p in peers}
        barrier()  # every ring is mapped by both ends before its creator unlinks it
    finally:
        for p in created:
            unlink_ring(job, rank, p)
    return {p: ShmPair(p, peer_pids[p], inbound[p], outbound[p]) for p in peers}
