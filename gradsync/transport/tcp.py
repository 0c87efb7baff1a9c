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
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

from ..errors import AuthenticationError, GradsyncTimeoutError, PeerLostError, ProtocolError
from . import frame
from . import splice as _splice
from .base import Pair, Recv, Send, Settle

__all__ = ["TcpPair", "Listener", "connect", "HANDSHAKE_TIMEOUT"]

log = logging.getLogger("gradsync.transport.tcp")

HANDSHAKE_TIMEOUT = 10.0
_NONCE = 32
_PROOF = struct.Struct(f"<q{_NONCE}s32s")
_SOCKET_BUFFER = 4 << 20
_ACK = frame.pack(frame.Kind.ACK, 0, 0, 0, 0)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    # A host that vanishes without closing its sockets (power loss, partition) is noticed by
    # keepalive probes after about 10 + 3 * 3 = 19 s instead of the kernel's two hours.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3)):
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
    header = frame.unpack(_recv_exact(sock, frame.HEADER_SIZE))
    if header.kind not in kinds:
        raise ProtocolError(f"handshake frame of kind {header.kind}, expected one of {kinds}")
    if header.length > frame.MAX_CONTROL_PAYLOAD:
        raise ProtocolError(f"handshake frame claims {header.length} bytes (limit "
                            f"{frame.MAX_CONTROL_PAYLOAD})")
    return _recv_exact(sock, header.length)


class TcpPair(Pair):
    """An authenticated, non-blocking connection to rank ``peer``.

    Args:
        peer: the rank at the other end.
        sock: the connected socket, after the handshake.
        splice: send lent frames by reference (``splice.py``) where the platform allows;
            false copies every frame (``GRADSYNC_TCP_SPLICE=0``).

    Lent frames. A ``Send`` with an ``address`` goes out as the header (copied) and then the
    payload's pages, by reference. The peer answers each such frame with an ACK frame once it
    holds all of it; ``unacked`` counts the lent frames not yet answered, and ``advance_settle``
    reads ACKs until it is 0. ACKs travel on the same stream as data: this side reads them
    wherever a frame header is due (skipping them in ``advance_recv``), and writes its own
    between frames, never inside one (``_ctl_out`` waits while a frame is half written).
    """

    def __init__(self, peer: int, sock: socket.socket, splice: bool = True):
        self.peer = peer
        self.sock = sock
        sock.setblocking(False)
        self.fileno = sock.fileno()
        self.lends = bool(splice) and _splice.available()
        self._splicer: _splice.Splicer | None = None
        self.unacked = 0
        self._ctl_out = bytearray()  # ACK frames owed to the peer, not yet taken by the socket
        self._sending: Send | None = None  # the frame being written: nothing else may go in
        self._hdr = bytearray(frame.HEADER_SIZE)  # the next header from the peer, as it comes
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0

    def _lost(self, exc: BaseException | None) -> PeerLostError:
        why = f": {exc}" if exc else ""
        return PeerLostError(f"lost the connection to rank {self.peer}{why} (did it exit or "
                             f"crash?)", peer=self.peer)

    def advance_send(self, op: Send) -> bool:
        try:
            if self._sending is not op:
                if self._sending is not None:
                    return False  # another frame to this peer is half written
                if self._ctl_out and not self._flush_ctl():
                    return False  # ACKs first: they must not land inside this frame
                if op.address:
                    self.unacked += 1  # the header carries LENT: the peer will answer it
                self._sending = op
            if op.address and self.lends:
                self._send_lent(op)
            else:
                self._send_copied(op)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost(exc) from None
        self._sending = None
        if self._ctl_out:
            self._flush_ctl()
        return True

    def _send_copied(self, op: Send) -> None:
        hlen = len(op.header)
        while op.offset < op.total:
            if op.offset == 0:
                n = self.sock.sendmsg([op.header, op.payload])
            elif op.offset < hlen:
                n = self.sock.sendmsg([memoryview(op.header)[op.offset:], op.payload])
            else:
                n = self.sock.send(op.payload[op.offset - hlen:])
            op.offset += n

    def _send_lent(self, op: Send) -> None:
        """The header by copy, then the payload's pages through the pipe into the socket."""
        hlen = len(op.header)
        while op.offset < hlen:
            op.offset += self.sock.send(memoryview(op.header)[op.offset:], socket.MSG_MORE)
        if self._splicer is None:
            try:
                self._splicer = _splice.Splicer(self.fileno)
            except OSError as exc:  # out of file descriptors for the pipe
                return self._copy_from_now_on(op, exc)
        splicer = self._splicer
        while op.offset < op.total:
            if not splicer.piped:  # all sent so far is in the socket: lend the next piece
                try:
                    pushed = splicer.push(op.address + op.offset - hlen, op.total - op.offset)
                except OSError as exc:  # no vmsplice after all (seccomp, old kernel)
                    return self._copy_from_now_on(op, exc)
                if not pushed:
                    raise BlockingIOError  # an empty pipe took nothing: try again later
            op.offset += splicer.drain(more=op.offset + splicer.piped < op.total)

    def _copy_from_now_on(self, op: Send, exc: OSError) -> None:
        """Stops lending on this pair; sends the rest of ``op`` (and all later frames) copied.

        The peer still acknowledges ``op``, whose header says it was lent."""
        log.warning("lending pages to the socket to rank %d failed (%s); sending copies from "
                    "now on", self.peer, exc)
        self.lends = False
        self._send_copied(op)

    def _flush_ctl(self) -> bool:
        """Writes owed ACKs; True once all are out. Call only between frames."""
        try:
            while self._ctl_out:
                del self._ctl_out[:self.sock.send(self._ctl_out)]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost(exc) from None
        return True

    def _next_header(self) -> None:
        """Reads until ``_hdr`` holds a whole header; raises BlockingIOError before that."""
        while self._hdr_got < frame.HEADER_SIZE:
            n = self.sock.recv_into(self._hdr_view[self._hdr_got:])
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
        try:
            if self._ctl_out and self._sending is None:
                self._flush_ctl()
            if op.header_got < frame.HEADER_SIZE:
                self._next_header()
                while self._take_ack():
                    self._next_header()
                op.header_buf[:] = self._hdr
                op.header_got, self._hdr_got = frame.HEADER_SIZE, 0
                op.check_header()
            total = op.payload.nbytes
            while op.offset < total:
                n = self.sock.recv_into(op.payload[op.offset:])
                if n == 0:
                    raise self._lost(None)
                op.offset += n
        except (BlockingIOError, InterruptedError):
            if op.header_got < frame.HEADER_SIZE:
                op.header_got = self._hdr_got  # progress, for wait_all
            return False
        except (ConnectionError, TimeoutError) as exc:
            raise self._lost(exc) from None
        if op.lent:
            op.lent = False
            self._ctl_out += _ACK
            if self._sending is None:
                self._flush_ctl()
        return True

    def peek_header(self) -> "frame.Header | None":
        if self._hdr_got:  # a header this side began to take in (while looking for ACKs)
            raw = self._hdr if self._hdr_got == frame.HEADER_SIZE else None
        else:
            try:
                raw = self.sock.recv(frame.HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                return None  # nothing there yet, or a lost peer, which check_alive reports
            if len(raw) < frame.HEADER_SIZE:
                return None
        try:
            return None if raw is None else frame.unpack(raw)
        except ProtocolError:
            return None  # the receive that takes it reports it

    def advance_settle(self, op: Settle) -> bool:
        try:
            if self._ctl_out and self._sending is None:
                self._flush_ctl()
            while self.unacked:
                self._next_header()
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

    def owes_bytes(self) -> bool:
        return bool(self._ctl_out)

    def close(self) -> None:
        if self._splicer is not None:
            self._splicer.close()
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """Accepts authenticated connections from peer ranks for the lifetime of the job.

    Handshakes run on short-lived threads with a deadline each, so one silent or hostile
    connection cannot hold up the others. Connections that fail are logged and closed;
    the job is not disturbed.

    Args:
        addr: the address to listen on.
        rank: this rank (sent in WELCOME).
        secret: the job's secret.
        job: the job id, bound into every proof so that a peer of another job is refused.
        expect: ranks allowed to connect (each once).
        on_accept: if given, called with ``(rank, socket)`` for each authenticated connection,
            on its handshake thread, so that a long-lived owner (``regions.Endpoint``) can serve
            peers as they come; the connection is still recorded, so a rank connects once.
    """

    def __init__(self, addr: str, rank: int, secret: bytes, job: str, expect: set[int],
                 on_accept: Callable[[int, socket.socket], None] | None = None):
        self.rank, self.secret, self.job = rank, secret, job.encode()
        self._expect = set(expect)
        self._accepted: dict[int, socket.socket] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.rejected = 0
        self._on_accept = on_accept
        self.sock = socket.create_server((addr, 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="gradsync-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, address = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(sock, address), daemon=True,
                             name="gradsync-handshake").start()

    def _handshake(self, sock: socket.socket, address) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            nonce_a = os.urandom(_NONCE)
            _send_frame(sock, frame.Kind.HELLO, nonce_a)
            payload = _recv_frame(sock, frame.Kind.PROOF)
            if len(payload) != _PROOF.size:
                raise ProtocolError(f"PROOF of {len(payload)} bytes, expected {_PROOF.size}")
            peer, nonce_c, mac = _PROOF.unpack(payload)
            want = _mac(self.secret, b"connect", self.job, nonce_a, str(peer).encode(), nonce_c)
            if not hmac.compare_digest(mac, want):
                raise AuthenticationError("wrong secret (or another job's peer)")
            with self._cond:
                if peer not in self._expect or peer in self._accepted or self._closed:
                    raise AuthenticationError(f"unexpected connection claiming rank {peer}")
                _send_frame(sock, frame.Kind.WELCOME,
                            _mac(self.secret, b"accept", self.job, nonce_c, str(self.rank).encode()))
                sock.settimeout(None)
                _tune(sock)
                self._accepted[peer] = sock
                self._cond.notify_all()
            if self._on_accept is not None:
                self._on_accept(peer, sock)
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
        """Returns the sockets of ``ranks`` once all of them have connected.

        Args:
            alive: called about every 0.1 s while waiting; raises if the job was aborted.
        """
        with self._cond:
            while not ranks <= self._accepted.keys():
                alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(ranks - self._accepted.keys())
                    raise GradsyncTimeoutError(
                        f"rank {self.rank}: rank(s) {missing} did not connect in time; are they "
                        f"running, and can they reach this host's port {self.port}?")
                self._cond.wait(min(left, 0.1))
            return {r: self._accepted[r] for r in ranks}

    def close(self) -> None:
        with self._cond:
            self._closed = True
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


def connect(addr: str, port: int, rank: int, peer: int, secret: bytes, job: str,
            deadline: float, alive: Callable[[], None] = lambda: None) -> socket.socket:
    """Connects to rank ``peer`` and proves this rank's identity; retries until ``deadline``.

    Args:
        alive: called between retries; raises if the job was aborted meanwhile.
    """
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=HANDSHAKE_TIMEOUT)
            break
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise GradsyncTimeoutError(f"rank {rank} could not connect to rank {peer} at "
                                           f"{addr}:{port}: {exc}") from None
            alive()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    try:
        jobb = job.encode()
        nonce_a = _recv_frame(sock, frame.Kind.HELLO)
        nonce_c = os.urandom(_NONCE)
        mac = _mac(secret, b"connect", jobb, nonce_a, str(rank).encode(), nonce_c)
        _send_frame(sock, frame.Kind.PROOF, _PROOF.pack(rank, nonce_c, mac))
        reply = _recv_frame(sock, frame.Kind.WELCOME, frame.Kind.REJECT)
        want = _mac(secret, b"accept", jobb, nonce_c, str(peer).encode())
        if not reply or not hmac.compare_digest(reply, want):
            raise AuthenticationError(f"rank {rank}: rank {peer} at {addr}:{port} refused this "
                                      f"rank's proof or failed to prove its own: do both have "
                                      f"the same GRADSYNC_SECRET and job id?")
    except (ProtocolError, OSError) as exc:
        sock.close()
        raise PeerLostError(f"rank {rank}: handshake with rank {peer} at {addr}:{port} failed: "
                            f"{exc}", peer=peer) from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    _tune(sock)
    return sock
