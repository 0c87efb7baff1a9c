"""TCP between ranks: authenticated connections, frames streamed straight into caller buffers.

Connection set-up (the *handshake*) proves on both sides that the peer knows the job's secret
without sending it; a mutual challenge-response with HMAC-SHA256::

    acceptor  -> connector   HELLO    nonce_a (32 random bytes)
    connector -> acceptor    PROOF    rank, nonce_c, HMAC(secret, "connect" | job | nonce_a | rank | nonce_c)
    acceptor  -> connector   WELCOME  HMAC(secret, "accept" | job | nonce_c | acceptor rank)
                             (or REJECT, then close)

Each frame is validated before its payload is read (frame.py), and every step has a deadline,
so a port scanner, a peer of another job, garbage, a truncated frame or a silent connection is
dropped and logged by the listener while the job goes on.

After the handshake the socket is switched to non-blocking mode and driven by ``wait_all``:
``advance_send`` writes header and payload with one ``sendmsg``; ``advance_recv`` reads the
40-byte header, validates it, then ``recv_into``s the payload directly into the destination
array, so a tensor is never pickled or copied through a temporary buffer. A frame the caller
lent (``Comm.exchange(lend=True)``) skips the sender's copy too: its pages go into the socket by
reference (``splice.py``) and come back acknowledged (``TcpPair``).

Connections on demand. A job of N ranks needs only the connections its algorithms use (a ring
2 per rank, recursive doubling log2 N), so a ``TcpPair`` may start with no socket and an
*opener* that makes one on its first use by any exchange. Either end may need the pair first,
and both may at once, so either end *dials* (blocking connect and handshake, which needs only
the peer's listener thread, never its main thread) and the ends agree on one connection:

- this end takes a connection the peer already made to its listener, if there is one;
- otherwise it dials; the peer's listener welcomes it unless the peer is dialing this end at
  the same moment and is the higher rank: then it answers *busy* (a REJECT frame carrying
  HMAC(secret, "busy" | job | nonce_c | acceptor rank), so that only a holder of the secret
  can send it) and this end waits, without blocking, for the higher rank's connection, which
  its own listener always welcomes.

A process has one ``Listener``; each World on it (the job's, and every sub-world's) is a
``Route`` on it, found by the job id that every PROOF's HMAC binds: a connection proven for no
route's job is dropped as a wrong secret.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Container, Iterable

from ..errors import AuthenticationError, GradsyncError, GradsyncTimeoutError, PeerLostError, \
    ProtocolError
from . import frame
from . import splice as _splice
from .base import Pair, Recv, Send, Settle

__all__ = ["TcpPair", "Listener", "Route", "connect", "HANDSHAKE_TIMEOUT", "REFUSED_GRACE"]

log = logging.getLogger("gradsync.transport.tcp")

HANDSHAKE_TIMEOUT = 10.0
#: Seconds a peer known to listen may refuse connections before it counts as gone.
REFUSED_GRACE = 1.0
#: Seconds a rank told busy waits for the peer's connection before it dials again to see
#: whether the peer is still there (a peer lost between its busy answer and its connection).
BUSY_RECHECK = 1.0
_NONCE = 32
_PROOF = struct.Struct(f"<q{_NONCE}s32s")
_SOCKET_BUFFER = 4 << 20
#: The most bytes of a payload that must be waiting before a wait wakes to take them in
#: (``SO_RCVLOWAT``). Without it a payload on a slow link woke its wait for every packet:
#: 1,400 wakes a step per rank at 25 Mbit/s, 3x gloo's CPU time, taken from the ranks'
#: compute on a busy host. Never more than what is left of the frame, which is sure to come.
_WAKE_BYTES = 256 << 10
_ACK = frame.pack(frame.Kind.ACK, 0, 0, 0, 0)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    # A host that vanishes without closing its sockets (power loss, partition) is noticed by
    # keepalive probes after about 10 + 8 * 5 = 50 s instead of the kernel's two hours, when
    # the heartbeats (heartbeat.py, which notice it first) are off. Not fewer probes: on a
    # loaded host the kernel drops packets (the loopback backlog of 1,000 overflowed on 2 cores
    # with 128 ranks), and three probes lost in a row ended live connections with ETIMEDOUT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 8)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(frame.pack(kind, 0, 0, 0, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, *kinds: int) -> bytes:
    return _recv_frame_kind(sock, *kinds)[1]


def _recv_frame_kind(sock: socket.socket, *kinds: int) -> tuple[int, bytes]:
    header = frame.unpack(_recv_exact(sock, frame.HEADER_SIZE))
    if header.kind not in kinds:
        raise ProtocolError(f"handshake frame of kind {header.kind}, expected one of {kinds}")
    if header.length > frame.MAX_CONTROL_PAYLOAD:
        raise ProtocolError(f"handshake frame claims {header.length} bytes (limit "
                            f"{frame.MAX_CONTROL_PAYLOAD})")
    return header.kind, _recv_exact(sock, header.length)


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, two u64 at byte
# 120, after the u8 and u32 fields and the pacing rates (Linux 4.6 and later).
_TCP_INFO_LEN, _TCP_INFO_BYTES = 256, 120


class TcpPair(Pair):
    """An authenticated, non-blocking connection to rank ``peer``.

    Args:
        peer: the rank at the other end.
        sock: the connected socket, after the handshake; None for a pair connected on demand.
        splice: send lent frames by reference (``splice.py``) where the platform allows;
            false copies every frame (``GRADSYNC_TCP_SPLICE=0``).
        opener: for a pair without ``sock``: called on each advance until it returns the
            connected socket (None: not yet, try again); raises when the peer cannot be
            reached. ``Route.open`` with a dialer is the one a World gives.

    Until it has a socket the pair's ``fileno`` is -1 (``wait_all`` polls it instead of
    sleeping in ``select``); ``is_socket`` is true from the start.

    Lent frames. A ``Send`` with an ``address`` goes out as the header (copied) and then the
    payload's pages, by reference. The peer answers each such frame with an ACK frame once it
    holds all of it; ``unacked`` counts the lent frames not yet answered, and ``advance_settle``
    reads ACKs until it is 0. ACKs travel on the same stream as data: this side reads them
    wherever a frame header is due (skipping them in ``advance_recv``), and writes its own
    between frames, never inside one (``_ctl_out`` waits while a frame is half written).
    """

    is_socket = True

    def __init__(self, peer: int, sock: socket.socket | None = None, splice: bool = True,
                 opener: Callable[[], "socket.socket | None"] | None = None):
        self.peer = peer
        self.sock: socket.socket | None = None
        self.fileno = -1
        self._opener = opener
        if sock is not None:
            self._adopt(sock)
        self.lends = bool(splice) and _splice.available()
        self._splicer: _splice.Splicer | None = None
        self.unacked = 0
        self._ctl_out = bytearray()  # ACK frames owed to the peer, not yet taken by the socket
        self._sending: Send | None = None  # the frame being written: nothing else may go in
        self._hdr = bytearray(frame.HEADER_SIZE)  # the next header from the peer, as it comes
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._lowat = 1  # the socket's SO_RCVLOWAT: raised only inside a payload

    def _adopt(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fileno = sock.fileno()
        self._opener = None

    @property
    def connected(self) -> bool:
        """Whether the pair holds its socket (a pair made on demand: once first used)."""
        return self.sock is not None

    def _open(self) -> socket.socket | None:
        """Makes the connection the pair has not got yet; the socket, or None until it is made."""
        if self._opener is None:
            raise self._lost(None)  # closed before it ever connected
        sock = self._opener()
        if sock is not None:
            self._adopt(sock)
        return sock

    def _lost(self, exc: BaseException | None) -> PeerLostError:
        why = f": {exc}" if exc else ""
        return PeerLostError(f"lost the connection to rank {self.peer}{why} (did it exit or "
                             f"crash?)", peer=self.peer)

    def advance_send(self, op: Send) -> bool:
        sock = self.sock if self.sock is not None else self._open()
        if sock is None:
            return False
        try:
            if self._sending is not op:
                if self._sending is not None:
                    return False  # another frame to this peer is half written
                if self._ctl_out and not self._flush_ctl(sock):
                    return False  # ACKs first: they must not land inside this frame
                if op.address:
                    self.unacked += 1  # the header carries LENT: the peer will answer it
                self._sending = op
            if op.address and self.lends:
                self._send_lent(sock, op)
            else:
                self._send_copied(sock, op)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost(exc) from None
        self._sending = None
        if self._ctl_out:
            self._flush_ctl(sock)
        return True

    def _send_copied(self, sock: socket.socket, op: Send) -> None:
        hlen = len(op.header)
        while op.offset < op.total:
            if op.offset == 0:
                n = sock.sendmsg([op.header, op.payload])
            elif op.offset < hlen:
                n = sock.sendmsg([memoryview(op.header)[op.offset:], op.payload])
            else:
                n = sock.send(op.payload[op.offset - hlen:])
            op.offset += n

    def _send_lent(self, sock: socket.socket, op: Send) -> None:
        """The header by copy, then the payload's pages through the pipe into the socket."""
        hlen = len(op.header)
        while op.offset < hlen:
            op.offset += sock.send(memoryview(op.header)[op.offset:], socket.MSG_MORE)
        if self._splicer is None:
            try:
                self._splicer = _splice.Splicer(self.fileno)
            except OSError as exc:  # out of file descriptors for the pipe
                return self._copy_from_now_on(sock, op, exc)
        splicer = self._splicer
        while op.offset < op.total:
            if not splicer.piped:  # all sent so far is in the socket: lend the next piece
                try:
                    pushed = splicer.push(op.address + op.offset - hlen, op.total - op.offset)
                except OSError as exc:  # no vmsplice after all (seccomp, old kernel)
                    return self._copy_from_now_on(sock, op, exc)
                if not pushed:
                    raise BlockingIOError  # an empty pipe took nothing: try again later
            op.offset += splicer.drain(more=op.offset + splicer.piped < op.total)

    def _copy_from_now_on(self, sock: socket.socket, op: Send, exc: OSError) -> None:
        """Stops lending on this pair; sends the rest of ``op`` (and all later frames) copied.

        The peer still acknowledges ``op``, whose header says it was lent."""
        log.warning("lending pages to the socket to rank %d failed (%s); sending copies from "
                    "now on", self.peer, exc)
        self.lends = False
        self._send_copied(sock, op)

    def _flush_ctl(self, sock: socket.socket) -> bool:
        """Writes owed ACKs; True once all are out. Call only between frames."""
        try:
            while self._ctl_out:
                del self._ctl_out[:sock.send(self._ctl_out)]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost(exc) from None
        return True

    def _next_header(self, sock: socket.socket) -> None:
        """Reads until ``_hdr`` holds a whole header; raises BlockingIOError before that."""
        while self._hdr_got < frame.HEADER_SIZE:
            n = sock.recv_into(self._hdr_view[self._hdr_got:])
            if n == 0:
                raise self._lost(None)
            self._hdr_got += n

    def _take_ack(self) -> bool:
        """If ``_hdr`` is a whole ACK frame, counts it and clears ``_hdr``; True if it was."""
        if self._hdr[5] != frame.Kind.ACK:
            return False
        frame.unpack(self._hdr)  # magic and version
        if self.unacked <= 0:
            raise ProtocolError(f"rank {self.peer} acknowledged a frame that was not lent to it")
        self.unacked -= 1
        self._hdr_got = 0
        return True

    def advance_recv(self, op: Recv) -> bool:
        sock = self.sock if self.sock is not None else self._open()
        if sock is None:
            return False
        try:
            if self._ctl_out and self._sending is None:
                self._flush_ctl(sock)
            if op.header_got < frame.HEADER_SIZE:
                if self._lowat != 1:  # a payload left unfinished (a wait that gave up)
                    self._wake_at(sock, 1)
                self._next_header(sock)
                while self._take_ack():
                    self._next_header(sock)
                op.header_buf[:] = self._hdr
                op.header_got, self._hdr_got = frame.HEADER_SIZE, 0
                op.check_header()
            total = op.payload.nbytes
            while op.offset < total:
                n = sock.recv_into(op.payload[op.offset:])
                if n == 0:
                    raise self._lost(None)
                op.offset += n
        except (BlockingIOError, InterruptedError):
            if op.header_got < frame.HEADER_SIZE:
                op.header_got = self._hdr_got  # progress, for wait_all
            else:
                self._wake_at(sock, min(op.payload.nbytes - op.offset, _WAKE_BYTES))
            return False
        except (ConnectionError, TimeoutError) as exc:
            raise self._lost(exc) from None
        if self._lowat != 1:
            self._wake_at(sock, 1)  # headers and ACKs: wake for their first byte
        if op.lent:
            op.lent = False
            self._ctl_out += _ACK
            if self._sending is None:
                self._flush_ctl(sock)
        return True

    def _wake_at(self, sock: socket.socket, nbytes: int) -> None:
        """Makes a wait for this socket wake once ``nbytes`` are there to read (or it closes).
        Only ever as many as the peer is sure to send next: a payload's rest, else 1."""
        if nbytes != self._lowat:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError as exc:  # a socket closed under the wait
                raise self._lost(exc) from None
            self._lowat = nbytes

    def peek_header(self) -> "frame.Header | None":
        sock = self.sock
        if sock is None:
            return None
        raw: bytes | bytearray | None
        if self._hdr_got:  # a header this side began to take in (while looking for ACKs)
            raw = self._hdr if self._hdr_got == frame.HEADER_SIZE else None
        else:
            try:
                raw = sock.recv(frame.HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                return None  # nothing there yet, or a lost peer, which check_alive reports
            if len(raw) < frame.HEADER_SIZE:
                return None
        try:
            return None if raw is None else frame.unpack(raw)
        except ProtocolError:
            return None  # the receive that takes it reports it

    def advance_settle(self, op: Settle) -> bool:
        sock = self.sock
        if sock is None:
            return True  # never connected: nothing was lent or is owed
        try:
            if self._ctl_out and self._sending is None:
                self._flush_ctl(sock)
            while self.unacked:
                self._next_header(sock)
                if not self._take_ack():
                    raise ProtocolError(
                        f"rank {self.peer} sent a frame of kind {self._hdr[5]} while this rank "
                        f"waited for it to acknowledge {self.unacked} lent frame(s)")
                op.offset += 1
        except (BlockingIOError, InterruptedError):
            return False
        except (ConnectionError, TimeoutError) as exc:
            raise self._lost(exc) from None
        return not self._ctl_out

    def unsettled(self) -> bool:
        return bool(self.unacked or self._ctl_out)

    def moved(self) -> int:
        # The kernel's own counts (TCP_INFO: bytes acknowledged by the peer, bytes received),
        # one system call, so nothing is counted on the data path. Heartbeats on the same
        # connection count too (a few bytes a beat).
        sock = self.sock
        if sock is None:
            return 0
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except (OSError, AttributeError):  # closed meanwhile, or no TCP_INFO (not Linux)
            return 0
        if len(info) < _TCP_INFO_BYTES + 16:
            return 0  # a kernel older than 4.6: no byte counts
        acked, received = struct.unpack_from("QQ", info, _TCP_INFO_BYTES)
        return acked + received

    def owes_bytes(self) -> bool:
        return bool(self._ctl_out)

    def close(self) -> None:
        self._opener = None
        if self._splicer is not None:
            self._splicer.close()
        if self.sock is None:
            return
        try:
            self.sock.close()
        except OSError:
            pass


# A Route's record of one peer, besides an accepted socket not yet taken:
_DIALING = "dialing"  # this end is connecting to the peer (Route.open)
_WAITING = "waiting"  # the peer answered busy: its own connection is on the way
_DIALED = "dialed"  # the connection this end dialed belongs to a pair
_TAKEN = "taken"  # the connection the peer dialed belongs to a pair


class Route:
    """One World's connections on a shared ``Listener``: those proven for ``job`` to ``rank``.

    Made by ``Listener.route``; ``close`` removes it. Its state per peer (at most one
    connection per peer) is what lets both ends of a pair connect on demand without making
    two connections (the module docstring).
    """

    def __init__(self, listener: "Listener", job: str, rank: int, expect: Iterable[int],
                 on_accept: Callable[[int, socket.socket], None] | None = None):
        self.listener, self.job, self.rank = listener, job.encode(), rank
        # Admission asks only ``in``: an owner may widen it (regions.ANY_PEER).
        self.expect: Container[int] = set(expect)
        self.on_accept = on_accept
        self.slots: dict[int, "socket.socket | str"] = {}
        self._busy_since: dict[int, float] = {}
        self.closed = False

    def _admit(self, peer: int) -> bool:
        """For the listener, under its lock: True to welcome ``peer``'s connection, False
        to answer busy; raises AuthenticationError to drop it."""
        state = self.slots.get(peer)
        if not self.closed and peer in self.expect:
            if state is None:
                return True
            # Both ends dialing at once: the higher rank's connection is the one kept, even
            # when it is through before the lower rank's reaches the higher's listener.
            if peer > self.rank and state in (_DIALING, _WAITING):
                return True
            if peer < self.rank and state in (_DIALING, _DIALED):
                return False
        raise AuthenticationError(f"unexpected connection claiming rank {peer}")

    def open(self, peer: int, dial: Callable[[], "socket.socket | None"]
             ) -> "socket.socket | None":
        """The connection to ``peer``, made now if needed; None while it is on its way.

        Args:
            dial: connects to the peer's listener and returns the socket, or None when the
                peer answered busy (``connect(crossing=True)``).
        """
        cond = self.listener._cond
        with cond:
            state = self.slots.get(peer)
            if isinstance(state, socket.socket):
                self.slots[peer] = _TAKEN
                return state
            if state == _WAITING:
                if time.monotonic() - self._busy_since[peer] < BUSY_RECHECK:
                    return None
                state = None  # dial again: busy once more if the peer is alive and dialing
            if state is not None or self.closed:
                raise PeerLostError(f"rank {self.rank}: the connection to rank {peer} is "
                                    f"closed", peer=peer)
            self.slots[peer] = _DIALING
        try:
            sock = dial()
        except BaseException:
            with cond:
                if self.slots.get(peer) == _DIALING:
                    del self.slots[peer]
            raise
        with cond:
            state = self.slots.get(peer)
            if sock is None:  # busy: the peer's own connection is (or will be) here
                if isinstance(state, socket.socket):
                    self.slots[peer] = _TAKEN
                    return state
                self.slots[peer] = _WAITING
                self._busy_since[peer] = time.monotonic()
                return None
            self.slots[peer] = _DIALED
            return sock

    def wait_for(self, ranks: set[int], deadline: float,
                 alive: Callable[[], None] = lambda: None) -> dict[int, socket.socket]:
        """Returns the sockets of ``ranks`` once all of them have connected (and takes them).

        Args:
            alive: called about every 0.1 s while waiting; raises if the job was aborted.
        """
        cond = self.listener._cond
        with cond:
            while not all(isinstance(self.slots.get(r), socket.socket) for r in ranks):
                alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(r for r in ranks
                                     if not isinstance(self.slots.get(r), socket.socket))
                    raise GradsyncTimeoutError(
                        f"rank {self.rank}: rank(s) {missing} did not connect in time; are they "
                        f"running, and can they reach this host's port {self.listener.port}?")
                cond.wait(min(left, 0.1))
            # Every one of them holds its socket now: that ended the wait.
            found = {r: s for r in ranks if isinstance(s := self.slots[r], socket.socket)}
            self.slots.update(dict.fromkeys(ranks, _TAKEN))
            return found

    def close(self) -> None:
        """Stops accepting for this route; closes connections that no pair took."""
        with self.listener._cond:
            self.closed = True
            self.listener._routes.pop(self.job, None)
            left = [s for s in self.slots.values() if isinstance(s, socket.socket)]
            self.slots.clear()
        if self.on_accept is None:  # an on_accept owner owns the sockets it was given
            for sock in left:
                sock.close()


class Listener:
    """Accepts authenticated connections from peer ranks for the lifetime of the job.

    Handshakes run on short-lived threads with a deadline each, so one silent or hostile
    connection cannot hold up the others. Connections that fail are logged and closed;
    the job is not disturbed. One listener serves every World of a process: each is a
    ``Route`` (``route``), told apart by the job id in the connector's proof.

    Args:
        addr: the address to listen on.
        rank: this rank (sent in WELCOME) on the first route.
        secret: the job's secret, the same for every route.
        job: the first route's job id, bound into every proof so that a peer of another job
            is refused; None for a listener with no route yet.
        expect: ranks allowed to connect on the first route (each once).
        on_accept: if given, called with ``(rank, socket)`` for each authenticated connection
            of the first route, on its handshake thread, so that a long-lived owner
            (``regions.Endpoint``) can serve peers as they come; the connection is still
            recorded, so a rank connects once.

    Attributes:
        rejected: connections dropped (garbage, wrong secret, unexpected rank).
        busy: connections answered busy (both ends of a pair dialed at once).
        first: the route made from ``job``, or None.
    """

    def __init__(self, addr: str, rank: int, secret: bytes, job: str | None,
                 expect: Iterable[int] = frozenset(),
                 on_accept: Callable[[int, socket.socket], None] | None = None):
        self.rank, self.secret = rank, secret
        self._cond = threading.Condition()
        self._routes: dict[bytes, Route] = {}
        self._closed = False
        self.rejected = self.busy = 0
        self.sock = socket.create_server((addr, 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.first = None if job is None else self.route(job, rank, expect, on_accept)
        self._thread = threading.Thread(target=self._serve, name="gradsync-listener", daemon=True)
        self._thread.start()

    def route(self, job: str, rank: int, expect: Iterable[int],
              on_accept: Callable[[int, socket.socket], None] | None = None) -> Route:
        """Accepts connections proven for ``job`` from ``expect`` to ``rank`` from now on,
        until the route is closed. Raises ValueError if ``job`` has a route already."""
        route = Route(self, job, rank, expect, on_accept)
        with self._cond:
            if self._closed:
                raise ValueError("the listener is closed")
            if route.job in self._routes:
                raise ValueError(f"the listener has a route for job {job!r} already")
            self._routes[route.job] = route
        return route

    def _serve(self) -> None:
        while True:
            try:
                sock, address = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(sock, address), daemon=True,
                             name="gradsync-handshake").start()

    def _find(self, peer: int, nonce_a: bytes, nonce_c: bytes, mac: bytes) -> Route | None:
        with self._cond:
            routes = list(self._routes.values())
        rank = str(peer).encode()
        for route in routes:
            if hmac.compare_digest(mac, _mac(self.secret, b"connect", route.job, nonce_a, rank,
                                             nonce_c)):
                return route
        return None

    def _handshake(self, sock: socket.socket, address) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            nonce_a = os.urandom(_NONCE)
            _send_frame(sock, frame.Kind.HELLO, nonce_a)
            payload = _recv_frame(sock, frame.Kind.PROOF)
            if len(payload) != _PROOF.size:
                raise ProtocolError(f"PROOF of {len(payload)} bytes, expected {_PROOF.size}")
            peer, nonce_c, mac = _PROOF.unpack(payload)
            route = self._find(peer, nonce_a, nonce_c, mac)
            if route is None:
                raise AuthenticationError("wrong secret (or another job's peer)")
            me = str(route.rank).encode()
            with self._cond:
                if self._closed or not route._admit(peer):
                    if self._closed:
                        raise AuthenticationError(f"connection from rank {peer} after close")
                    # Busy: this rank is dialing the peer, and its connection is the one kept.
                    self.busy += 1
                    _send_frame(sock, frame.Kind.REJECT,
                                _mac(self.secret, b"busy", route.job, nonce_c, me))
                    sock.close()
                    return
                _send_frame(sock, frame.Kind.WELCOME,
                            _mac(self.secret, b"accept", route.job, nonce_c, me))
                sock.settimeout(None)
                _tune(sock)
                route.slots[peer] = sock
                self._cond.notify_all()
            if route.on_accept is not None:
                route.on_accept(peer, sock)
        except (AuthenticationError, ProtocolError, OSError, struct.error) as exc:
            self.rejected += 1
            log.warning("rank %d dropped a connection from %s: %s", self.rank, address, exc)
            try:
                if isinstance(exc, AuthenticationError):
                    _send_frame(sock, frame.Kind.REJECT, b"")
            except OSError:
                pass
            sock.close()

    def wait_for(self, ranks: set[int], deadline: float,
                 alive: Callable[[], None] = lambda: None) -> dict[int, socket.socket]:
        """``Route.wait_for`` of the first route."""
        assert self.first is not None, "a listener made without a job has no first route"
        return self.first.wait_for(ranks, deadline, alive)

    def close(self) -> None:
        """Stops listening; closes every route (connections already taken stay open)."""
        with self._cond:
            self._closed = True
            routes = list(self._routes.values())
        for route in routes:
            route.close()
        try:  # close() alone does not wake a thread blocked in accept() on Linux
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def _open(addr: str, port: int, alive: Callable[[], None]) -> socket.socket:
    """``socket.create_connection`` with ``HANDSHAKE_TIMEOUT``, except that the wait for the
    peer's kernel to answer calls ``alive`` every 0.1 s: a peer whose accept queue is full
    drops the SYN, and the kernel's retries (1 s, then 3 s) must not hide an abort."""
    error: OSError = OSError(f"no address for {addr}")
    for family, kind, proto, _, address in socket.getaddrinfo(addr, port, 0,
                                                              socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, os.strerror(code))
            poller = select.poll()
            poller.register(sock, select.POLLOUT | select.POLLERR | select.POLLHUP)
            end = time.monotonic() + HANDSHAKE_TIMEOUT
            while not poller.poll(100):
                if time.monotonic() > end:
                    raise socket.timeout("timed out")
                alive()
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            sock.settimeout(HANDSHAKE_TIMEOUT)
            return sock
        except GradsyncError:  # from alive (GradsyncTimeoutError is an OSError too)
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


def _await(sock: socket.socket, alive: Callable[[], None]) -> None:
    """Waits until ``sock`` has bytes to read (or ``HANDSHAKE_TIMEOUT`` passed: the read
    that follows then times out), calling ``alive`` every 0.1 s: a handshake with a live but
    busy peer must not hide an abort posted meanwhile (a peer lost elsewhere in the job)
    for the handshake's whole timeout."""
    end = time.monotonic() + HANDSHAKE_TIMEOUT
    poller = select.poll()  # not select(): it fails on descriptors past 1023
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    while True:
        left = end - time.monotonic()
        if left <= 0 or poller.poll(min(left, 0.1) * 1000):
            return
        alive()


def connect(addr: str, port: int, rank: int, peer: int, secret: bytes, job: str,
            deadline: float, alive: Callable[[], None] = lambda: None,
            crossing: bool = False) -> "socket.socket | None":
    """Connects to rank ``peer`` and proves this rank's identity; retries until ``deadline``.

    Args:
        alive: called between retries; raises if the job was aborted meanwhile.
        crossing: the peer is known to listen already and may be dialing this rank at the
            same time (a pair connected on demand): return None when it answers busy, and
            count a peer that refuses connections for ``REFUSED_GRACE`` seconds as gone
            (PeerLostError) instead of retrying until ``deadline``.
    """
    delay = 0.01
    refused_since = None
    while True:
        try:
            sock = _open(addr, port, alive)
            break
        except GradsyncError:
            raise  # the job's abort, seen by alive
        except OSError as exc:
            now = time.monotonic()
            if crossing and isinstance(exc, ConnectionRefusedError):
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSED_GRACE:
                    raise PeerLostError(f"rank {rank}: rank {peer} at {addr}:{port} no longer "
                                        f"accepts connections (did it exit or crash?)",
                                        peer=peer) from None
            if now + delay > deadline:
                raise GradsyncTimeoutError(f"rank {rank} could not connect to rank {peer} at "
                                           f"{addr}:{port}: {exc}") from None
            alive()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    try:
        jobb = job.encode()
        _await(sock, alive)
        nonce_a = _recv_frame(sock, frame.Kind.HELLO)
        nonce_c = os.urandom(_NONCE)
        mac = _mac(secret, b"connect", jobb, nonce_a, str(rank).encode(), nonce_c)
        _send_frame(sock, frame.Kind.PROOF, _PROOF.pack(rank, nonce_c, mac))
        _await(sock, alive)
        kind, reply = _recv_frame_kind(sock, frame.Kind.WELCOME, frame.Kind.REJECT)
        if kind == frame.Kind.REJECT and crossing and reply and hmac.compare_digest(
                reply, _mac(secret, b"busy", jobb, nonce_c, str(peer).encode())):
            sock.close()
            return None
        want = _mac(secret, b"accept", jobb, nonce_c, str(peer).encode())
        if kind != frame.Kind.WELCOME or not hmac.compare_digest(reply, want):
            raise AuthenticationError(f"rank {rank}: rank {peer} at {addr}:{port} refused this "
                                      f"rank's proof or failed to prove its own: do both have "
                                      f"the same GRADSYNC_SECRET and job id?")
    except (ProtocolError, OSError) as exc:
        sock.close()
        alive()  # the peer may have closed because the job was aborted: that error first
        raise PeerLostError(f"rank {rank}: handshake with rank {peer} at {addr}:{port} failed: "
                            f"{exc}", peer=peer) from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    _tune(sock)
    return sock
