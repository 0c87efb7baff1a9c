"""One-sided memory regions: remote memory that peers read, write and accumulate into.

"RPC considered harmful" (Xue et al.) argues that a remote peer holding tensors should look
like a device with memory, not like a service: the caller names a region and a byte range and
the bytes move, with no serialisation and no handler in between. This module gives every
process an ``Endpoint`` that *owns* named regions (``allocate`` or ``register``) and *reaches*
other endpoints' regions (``connect(...).region(name)``), each remote region offering
``read``, ``write`` and ``accumulate`` (add into) on a byte range, blocking or ``*_async``.

How the bytes move depends on where the owner is:

- **Same host, region allocated in shared memory** (``allocate``): the peer maps the region's
  segment and does the access itself, a single ``memcpy`` (or an add) in its own process; the
  owner's CPU is not involved at all. The mapping is exactly the region, so a peer cannot
  touch memory outside it.
- **Otherwise** (another host, ``transport="tcp"``, or a region ``register``-ed from ordinary
  memory): a request goes over an authenticated TCP connection (the handshake of ``tcp.py``)
  to the owner, where one thread per connected peer validates the header
  (``rma_frame.check_access``: bounds, alignment) and then ``recv_into``-s a WRITE straight
  into the region, or ``sendall``-s a READ straight from it. An ACCUMULATE is received a
  stripe at a time into a per-connection scratch buffer and added in place: the one copy an
  add cannot avoid.

Concurrency. A region is cut into *stripes* (``STRIPE_BYTES``, 1 MiB). A write or an
accumulate holds the lock of one stripe at a time (a ``threading.Lock`` per stripe inside a
process, and an ``fcntl`` record lock on the stripe's bytes of the shared segment across
processes), so concurrent accumulates from several peers lose no update, and a write never
interleaves with an accumulate inside a stripe. Accumulators start at a stripe chosen by their
endpoint id and wrap around, so that several peers adding into one region work on different
stripes instead of queueing behind each other. A read takes each stripe's lock shared: a read
sees every stripe at one moment, but different stripes may be from before and after a
concurrent update (as with RDMA; a caller that needs one version of a whole region arranges
that itself, as the parameter server does with its rounds).

Fencing. A region may be allocated *fenced*: it is written only by peers that act for an
*epoch* (a parameter server's view number), each write carrying its epoch, and the owner
refuses (``StaleWriteError``) a write whose epoch is below its fence, which it raises
(``raise_fence``) when it enters a newer epoch. The owner must decide that before a byte is
stored, so a fenced region is written only through its owner, even by a peer on its host
(which still maps the region, for reads): the serving thread receives each stripe into its
scratch buffer, then admits the store under the fence (``region_memory.Fence``) and copies.
A peer's direct copy could not be refused once begun, nor waited for if that peer is stopped
half-way (the case fencing exists for); the cost is one copy more per stripe, and TCP
instead of a ``memcpy`` between same-host copies of a fenced region. Regions that every peer
writes as often as possible (the gradients of parameter-server workers) stay unfenced.

Control messages (``call``) travel on the same TCP connection as small JSON objects and are
answered by handlers the owner registers (``on_call``). They carry who did what, never tensors.
A handler may return its reply ``Attached`` to bytes of a region (a data server's ``take``
answers with the batch it names): the bytes follow the reply on the stream, sent straight
from the region, and the peer's ``call_into`` receives them straight into its buffer, so the
answer and the bytes cost one round trip instead of a call and a READ.

This module is the owner's side (its regions and the serving threads); the peer's side
(``RemotePeer``, ``RemoteRegion``) is ``region_peer.py``; below both, ``region_memory.py`` holds
the memory and stripe locks that both touch, and ``rma_frame.py`` the wire: the header, the
errors an ERROR reply carries, and reading the stream.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import socket
import threading
from typing import Callable

import numpy as np

from ..errors import GradsyncError, ProtocolError
from . import rma_frame as rf
from . import shm, tcp
from .region_memory import STRIPE_BYTES, Fence, Memory, Stripes
from .region_peer import RemotePeer
from .rma_frame import Incoming, RegionAccessError, StaleWriteError, error_payload

__all__ = ["Endpoint", "Region", "Memory", "Stripes", "Fence", "STRIPE_BYTES",
           "RegionAccessError", "StaleWriteError", "ANY_PEER", "Attached"]

log = logging.getLogger("gradsync.regions")

_DRAIN_LIMIT = 1 << 30  # payload bytes of a refused request that are read and dropped


class _AnyPeer:
    """Every endpoint id (a non-negative integer), each once: the ``expect`` of an owner whose
    peers come and go while it runs, so that it cannot list them in advance (a data server of
    an elastic job: ``gradsync/data/server.py``). A peer must still prove the job's secret and
    id, and an id connects only once."""

    def __contains__(self, ident) -> bool:
        return isinstance(ident, int) and ident >= 0

    def __repr__(self) -> str:
        return "ANY_PEER"


ANY_PEER = _AnyPeer()


class Attached:
    """A control reply with bytes that follow it on the stream (``RemotePeer.call_into``).

    Args:
        reply: the JSON-able reply; it gains ``"attached"``, the number of bytes.
        data: a contiguous uint8 view of the bytes (a region's, usually), or a list of them,
            sent one after the other (several slots of a data server, which need not lie
            side by side). The handler's caller must keep them unchanged until they are
            sent: the serving thread sends them after the handler has returned (a data
            server's slots stay unreleased until the worker asks for a later item).
    """

    __slots__ = ("reply", "data")

    def __init__(self, reply: dict, data: "np.ndarray | list[np.ndarray]"):
        parts = data if isinstance(data, list) else [data]
        self.reply = {**reply, "attached": int(sum(part.nbytes for part in parts))}
        self.data = parts


class Region(Memory):
    """A region this endpoint owns: a named, contiguous array that peers may access.

    Attributes:
        array: the owner's own view of the memory (use it like any array; take
            ``stripes`` or use ``read``/``write``/``accumulate`` when peers may write it).
        segment: the shared-memory segment's name, empty for ordinary memory.
        fenced: peers' writes must carry an epoch at or above the owner's fence.
    """

    def __init__(self, index: int, name: str, array: np.ndarray, segment: str = "",
                 fd: int | None = None, mapping=None, fenced: bool = False):
        super().__init__(array.reshape(-1).view(np.uint8), array.dtype,
                         Stripes(array.nbytes, fd))
        self.index, self.name, self.array = index, name, array
        self.segment, self.fd, self.mapping = segment, fd, mapping
        self.fenced = fenced

    def describe(self) -> dict:
        return {"index": self.index, "name": self.name, "nbytes": self.nbytes,
                "dtype": self.dtype.str, "shape": list(self.array.shape),
                "segment": self.segment, "fenced": self.fenced}


# --- the endpoint ---------------------------------------------------------------------------

class Endpoint:
    """This process's regions, the thread that serves them, and its connections to others.

    Args:
        ident: this endpoint's id among the job's endpoints (a rank).
        host: this process's host name (peers on the same host map shared regions).
        secret, job: the job's secret and id; connections prove both (``tcp.py``).
        addr: the address to listen on.
        expect: the ids of the peers that may connect (each once), or ``ANY_PEER``; none:
            do not listen.
        timeout: seconds one request may wait for its reply, and a peer's stream may stall.
        direct: map same-host shared regions (False forces every access over TCP).
        label: how peers' error messages name this endpoint.
    """

    def __init__(self, ident: int, host: str, secret: bytes, job: str, addr: str = "127.0.0.1",
                 expect: set[int] | frozenset[int] | _AnyPeer = frozenset(),
                 timeout: float = 300.0, direct: bool = True,
                 label: str = ""):
        self.ident, self.host, self.job = ident, host, shm.check_job_id(job)
        self.secret, self.timeout, self.direct = secret, timeout, direct
        self.label = label or f"endpoint {ident}"
        self.regions: list[Region] = []
        self._by_name: dict[str, Region] = {}
        self.fence = Fence()  # the oldest epoch whose writes the fenced regions take
        self._handlers: dict[str, Callable[[int, dict], dict]] = {
            "_regions": lambda peer, args: self._directory()}
        self._on_disconnect: list[Callable[[int, BaseException | None], None]] = []
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._closed = False
        self._segments = itertools.count()
        # Names still in /dev/shm; unlinked at exit even if close() is never reached (only a
        # kill -9 before unlink_segments() can leave one behind).
        self._linked: set[str] = set()
        atexit.register(_unlink_all, self._linked)
        # Only peers in ``expect`` may connect; with none (a parameter-server worker, which only
        # reaches others' regions) there is nothing to listen for.
        self.listener = None
        if isinstance(expect, _AnyPeer):
            self.listener = tcp.Listener(addr, ident, secret, job, {0}, on_accept=self._accepted)
            # The route checks admission with ``in``: any id, still once each (tcp.Route). The
            # listener has that first route: it was made with the job.
            assert self.listener.first is not None
            self.listener.first.expect = ANY_PEER
        elif expect:
            self.listener = tcp.Listener(addr, ident, secret, job, expect,
                                         on_accept=self._accepted)
        self.addr, self.port = addr, self.listener.port if self.listener else 0

    # ------------------------------------------------------------------ owning regions
    def allocate(self, name: str, shape, dtype=np.float32, fenced: bool = False) -> np.ndarray:
        """A new zeroed region in shared memory, which same-host peers access directly
        (``fenced``: peers write it through this endpoint only, each write carrying an epoch
        that ``raise_fence`` has not passed)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return self.register(name, np.zeros(shape, dtype), fenced).array
        segment = f"{self._segment_prefix()}{next(self._segments)}"
        mapping = shm.create_segment(segment, nbytes)
        self._linked.add(segment)
        # The record locks need a descriptor of the segment for the life of the region.
        fd = os.open(os.path.join(shm.SHM_DIR, segment), os.O_RDWR)
        array = np.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)
        return self._add(name, array, segment, fd, mapping, fenced).array

    def register(self, name: str, array, fenced: bool = False) -> Region:
        """Makes an existing contiguous array (or CPU tensor) a region; peers reach it over
        TCP only, through this endpoint's serving threads (``fenced``: as for ``allocate``)."""
        if hasattr(array, "detach") and hasattr(array, "numpy"):
            array = array.detach().numpy()
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise ValueError("a region must be a contiguous NumPy array or CPU tensor")
        return self._add(name, array, "", None, None, fenced)

    def _add(self, name, array, segment, fd, mapping, fenced) -> Region:
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"{self.label} already has a region named {name!r}")
            region = Region(len(self.regions), name, array, segment, fd, mapping, fenced)
            self.regions.append(region)
            self._by_name[name] = region
        return region

    def region(self, name: str) -> Region:
        return self._by_name[name]

    def unlink_segments(self) -> None:
        """Removes the shared segments' names: peers that mapped them keep their mappings, new
        ones can no longer map them. Call once every same-host peer has mapped them."""
        _unlink_all(self._linked)

    def clear_stale(self) -> list[str]:
        """Removes the segment names an earlier process of this endpoint id left in /dev/shm
        (a SIGKILL leaves whatever ``unlink_segments`` had not yet removed), which would
        refuse this process's own. Only for a replacement whose predecessor has exited (the
        launcher starts one only then); returns the names removed."""
        return shm.unlink_prefixed(self._segment_prefix())

    def _segment_prefix(self) -> str:
        return f"gradsync-{self.job}-r{self.ident}-"

    def unlink(self, name: str) -> None:
        """Removes region ``name``'s shared segment name (``unlink_segments`` for one region):
        for an owner whose peers map their regions at different times."""
        segment = self._by_name[name].segment
        if segment in self._linked:
            _unlink_all({segment})
            self._linked.discard(segment)

    def raise_fence(self, epoch: int) -> None:
        """Refuses, from now on, every write into a fenced region that carries an epoch below
        ``epoch``; returns once no write of an older epoch is still being stored (a stripe's
        copy already admitted, one per connection at most: never a wait for a writer's
        bytes). Never lowers the fence."""
        self.fence.raise_to(rf.check_epoch(epoch))

    def on_call(self, method: str, handler: Callable[[int, dict], dict]) -> None:
        """Answers ``call(method, ...)`` from peers with ``handler(peer, args) -> dict``.

        Handlers run on the calling peer's serving thread; one may block (its peer waits for
        the reply). A GradsyncError or ValueError it raises reaches the caller as the same
        class."""
        self._handlers[method] = handler

    def on_disconnect(self, callback: Callable[[int, BaseException | None], None]) -> None:
        """``callback(peer, error)`` when a peer's connection ends (error None: closed)."""
        self._on_disconnect.append(callback)

    def _directory(self) -> dict:
        return {"host": self.host, "pid": os.getpid(),
                "regions": [r.describe() for r in self.regions]}

    # ------------------------------------------------------------------ serving peers
    def _accepted(self, peer: int, sock: socket.socket) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._conns[peer] = sock
        threading.Thread(target=self._serve, args=(peer, sock), daemon=True,
                         name=f"gradsync-region-peer{peer}").start()

    def _serve(self, peer: int, sock: socket.socket) -> None:
        """One peer's requests, in order, until it closes the connection: each is answered
        before the next is read, which a peer's pipelined requests rely on (their replies
        come back in the order they were sent: ``RemotePeer.post``)."""
        error: BaseException | None = None
        scratch = np.empty(STRIPE_BYTES, dtype=np.uint8)
        # A peer may idle between requests as long as it likes, but once a request has begun
        # its bytes must keep coming (``Incoming``): a WRITE that stalls half-way holds its
        # stripe's lock, and every other peer of that stripe would wait with it.
        sock.settimeout(self.timeout)
        incoming = Incoming(sock)
        try:
            while True:
                raw = incoming.header()
                if raw is None:
                    break
                req = rf.unpack(raw, rf.Op.REQUESTS)
                if req.op == rf.Op.CALL:
                    self._serve_call(peer, sock, incoming, req)
                else:
                    self._serve_access(sock, incoming, req, scratch)
        except (OSError, ProtocolError, ValueError) as exc:
            error = exc
            if not self._closed:
                log.warning("%s dropped its connection from peer %d: %s", self.label, peer, exc)
        finally:
            with self._lock:
                self._conns.pop(peer, None)
            try:
                sock.close()
            except OSError:
                pass
            if not self._closed:
                for callback in self._on_disconnect:
                    callback(peer, error)

    def _serve_call(self, peer: int, sock: socket.socket, incoming: Incoming,
                    req: rf.Request) -> None:
        payload = incoming.exact(req.length)
        attached = None
        try:
            message = json.loads(payload)
            method = message.pop("method")
            handler = self._handlers.get(method)
            if handler is None:
                raise ValueError(f"{self.label} has no control method {method!r}")
            result = handler(peer, message)
            if isinstance(result, Attached):
                result, attached = result.reply, result.data
            reply = json.dumps(result).encode()
            op = rf.Op.REPLY
        except (GradsyncError, ValueError, TypeError, KeyError) as exc:
            reply, op = error_payload(exc), rf.Op.ERROR
        except Exception as exc:  # a bug in a handler must not take the owner down
            log.exception("%s: control method failed for peer %d", self.label, peer)
            reply, op = error_payload(exc), rf.Op.ERROR
        head = rf.pack(op, req.request, 0, 0, len(reply)) + reply
        if attached is not None and op == rf.Op.REPLY:
            # Straight from the region (the one copy is the kernel's), behind the reply.
            rf.send_parts(sock, [head, *attached])
        else:
            sock.sendall(head)

    def _serve_access(self, sock: socket.socket, incoming: Incoming, req: rf.Request,
                      scratch: np.ndarray) -> None:
        why = rf.check_access(req, self.regions, lambda r: r.dtype.itemsize)
        if why is not None:
            self._refuse(sock, incoming, req, scratch, 0 if req.op == rf.Op.READ else req.length,
                         RegionAccessError(f"{self.label}: {why}"))
            return
        region = self.regions[req.region]
        if req.op != rf.Op.READ:
            refused = rf.check_fence(req, region, self.fence.level, self.label)
            if refused is not None:
                self._refuse(sock, incoming, req, scratch, req.length, refused)
                return
            if region.fenced:
                self._store_fenced(sock, incoming, req, region, scratch)
                return
        lo, hi = req.offset, req.offset + req.length
        if req.op == rf.Op.READ:
            sock.sendall(rf.pack(rf.Op.REPLY, req.request, req.region, lo, req.length))
            for a, b in region.stripes.pieces(lo, hi):
                region.stripes.acquire(a, shared=True)
                try:
                    sock.sendall(region.u8[a:b].data)
                finally:
                    region.stripes.release(a)
        elif req.op == rf.Op.WRITE:
            # Straight from the socket into the region, one stripe (and its lock) at a time.
            for a, b in region.stripes.pieces(lo, hi):
                region.stripes.acquire(a)
                try:
                    incoming.into(region.u8[a:b])
                finally:
                    region.stripes.release(a)
            sock.sendall(rf.pack(rf.Op.REPLY, req.request, req.region, lo, 0))
        else:
            for a, b in region.stripes.pieces(lo, hi):
                piece = scratch[:b - a]
                incoming.into(piece)
                region.add_piece(piece, a)
            sock.sendall(rf.pack(rf.Op.REPLY, req.request, req.region, lo, 0))

    def _store_fenced(self, sock: socket.socket, incoming: Incoming, req: rf.Request,
                      region: Region, scratch: np.ndarray) -> None:
        """A WRITE or ACCUMULATE into a fenced region, a stripe at a time: each stripe is
        received into ``scratch`` first and stored only if the fence still admits the
        request's epoch (the owner may raise it while the bytes arrive). Once one is refused
        the rest is drained unstored: stripes stored before the fence rose stay, which the
        owner, then still in the writer's epoch, took as it takes any write."""
        fence = req.fence
        assert fence is not None  # check_fence refused a write into a fenced region without one
        lo, hi = req.offset, req.offset + req.length
        for a, b in region.stripes.pieces(lo, hi):
            piece = scratch[:b - a]
            incoming.into(piece)
            if not self.fence.enter(fence):
                self._refuse(sock, incoming, req, scratch, hi - b, StaleWriteError.refusing(
                    self.label, f"{rf.Op.NAMES[req.op]} into region '{region.name}'",
                    fence, self.fence.level))
                return
            try:
                if req.op == rf.Op.WRITE:
                    region.write_piece(piece, a)
                else:
                    region.add_piece(piece, a)
            finally:
                self.fence.leave()
        sock.sendall(rf.pack(rf.Op.REPLY, req.request, req.region, lo, 0))

    def _refuse(self, sock: socket.socket, incoming: Incoming, req: rf.Request,
                scratch: np.ndarray, left: int, error: BaseException) -> None:
        """Answers ``req`` with ERROR ``error`` after reading and dropping the ``left``
        payload bytes still on the stream (too many: the stream is dropped instead)."""
        if left > _DRAIN_LIMIT:
            raise ProtocolError(f"refused request of {req.length} bytes: {error}")
        _drain(incoming, left, scratch)
        body = error_payload(error)
        sock.sendall(rf.pack(rf.Op.ERROR, req.request, 0, 0, len(body)) + body)

    # ------------------------------------------------------------------ reaching peers
    def connect(self, peer: int, addr: str, port: int, deadline: float,
                label: str = "", listening: bool = False,
                silence: float | None = None) -> RemotePeer:
        """Connects to endpoint ``peer`` (listening at ``addr:port``) and reads its regions.

        ``listening``: the peer is known to listen already (it published its address once
        its listener was open), so a connection it refuses for ``tcp.REFUSED_GRACE`` seconds
        means it is gone: PeerLostError then, instead of retrying until ``deadline``.
        ``silence``: a reply silent this long means the peer is lost (``RemotePeer``)."""
        # ``crossing`` also lets a peer that dials this rank at the same moment answer busy;
        # an endpoint dials no one, so its listener never does, and a socket always comes back.
        sock = tcp.connect(addr, port, self.ident, peer, self.secret, self.job, deadline,
                           crossing=listening)
        assert sock is not None
        return RemotePeer(self, peer, sock, label or f"endpoint {peer}", silence=silence)

    def close(self) -> None:
        """Stops serving, closes every connection and frees this endpoint's regions."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        if self.listener is not None:
            self.listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.unlink_segments()
        for region in self.regions:
            if region.fd is not None:
                os.close(region.fd)
                region.fd = region.stripes.fd = None


def _unlink_all(names: set[str]) -> None:
    for name in list(names):
        shm.unlink_segment(name)
        names.discard(name)


def _drain(incoming: Incoming, n: int, scratch: np.ndarray) -> None:
    while n > 0:
        k = min(n, scratch.nbytes)
        incoming.into(scratch[:k])
        n -= k
