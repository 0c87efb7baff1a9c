"""The peer side of one-sided memory regions: reaching another endpoint's regions.

``Endpoint.connect`` (``regions.py``) returns a ``RemotePeer``: one authenticated TCP
connection to an owner, its table of regions, and its control methods. A ``RemoteRegion``
does each access the cheapest way it can: a copy through this process's own mapping when the
region is shared memory on this host, else a request that the owner's serving thread answers
straight from or into the region (the protocol is in ``rma_frame.py``). A write into a
*fenced* region carries the writer's epoch and always goes through the owner, which decides
whether to store it (``regions.py``); reads of it still use the mapping.

*Pipelining.* The owner's serving thread reads one connection's requests one after the other
and answers each before it reads the next, and every reply carries its request's number. So
a peer may send a request before the replies of earlier ones are in (``post``): requests to
one peer are sent in the order issued, several may be in flight at once, and their replies
come back in that order, each checked against the number of the oldest request in flight and
received straight into that request's buffer. Who does the work, and what it costs:

- the *requester's thread* sends its request (under a lock that keeps the order), and when
  it waits, receives the replies before its own and its own: no other thread is woken for a
  request in the common case, where the requester waits soon after it posted;
- a *blocking* request (``request``, ``call``, a region's ``read``) with nothing in flight is
  sent and its reply read under that same lock, as one exchange: the parameter servers'
  calls cost what they cost before pipelining; behind posted requests, it waits its turn;
- this peer's *request thread* runs the ``*_async`` requests, in order, and while requests
  are posted it looks at them every ``LOOK_S``: a reply that nobody waited for across two
  looks is received there, so that a requester busy elsewhere never leaves it in the kernel's
  buffers (where a large one holds the owner's serving thread in its send).

Requests to different peers run together. An ERROR reply fails its own request only; a
broken stream (a socket error, a reply out of step) fails every request in flight, as
``abandon`` does at once.

*Silence.* A peer connected with ``silence=S`` (a data server's: ``gradsync/data/liveness.py``)
is an owner that always answers within S seconds while it runs: a reply of which no byte
arrives for S seconds means the owner is stopped, or its host cut off, and the request raises
``PeerLostError`` (``silent``) instead of waiting for the endpoint's timeout, as does every
request in flight behind it. The owner answers pipelined requests one after the other, so
each reply's S counts from the end of the one before. The owner's handlers must then never
hold a reply longer than S (a data server's ``take`` answers "pending" instead). A request in
flight is always being watched, by its waiter or at most ``2 * LOOK_S`` after it was posted
by the request thread, and ``call_if_idle`` lets a watcher ask only when no request is in
flight.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import socket
import threading
import time
from typing import Callable

import numpy as np

from ..errors import GradsyncTimeoutError, PeerLostError, ProtocolError
from ..pipeline.engine import Handle
from . import rma_frame as rf
from . import shm
from .region_memory import Memory, Stripes, as_bytes
from .rma_frame import error_from, recv_exact, recv_into

__all__ = ["RemotePeer", "RemoteRegion", "Posted", "wait"]

log = logging.getLogger("gradsync.regions")

# Seconds between the request thread's looks at the replies in flight (``RemotePeer.post``): a
# reply that nobody has waited for across two looks is received by that thread. Short beside
# a data server's silence (2 s) and its take's wait (0.5 s); long beside a round trip, so
# that a requester that waits soon (the Loader's fetch thread) receives its own replies.
LOOK_S = 0.05


class RemotePeer:
    """A connection to another endpoint: its regions and its control methods.

    Requests on one peer are sent in the order issued and answered in that order; several
    may be in flight at once (``post``, module docstring), each blocking one waits for its
    own reply (after the earlier ones'), and ``*_async`` ones run one at a time on this
    peer's own thread. Requests to different peers run together.

    Args:
        endpoint: this process's ``regions.Endpoint`` (its id, host, timeout and whether it
            maps same-host regions); not imported here, so that this module stays below it.
        ident: the owner's endpoint id.
        sock: the authenticated connection to the owner.
        label: how error messages name the owner.
        silence: seconds without a byte of a reply after which the owner is lost (module
            docstring); None: the endpoint's timeout, then ``GradsyncTimeoutError``.
    """

    def __init__(self, endpoint, ident: int, sock: socket.socket, label: str,
                 silence: float | None = None):
        self.endpoint, self.ident, self.label = endpoint, ident, label
        self.sock = sock
        self.silence = silence
        # A timeout per recv: bytes that keep coming (a large read on a slow link) are no
        # silence, whatever the whole reply takes.
        sock.settimeout(endpoint.timeout if silence is None else silence)
        # Requests are sent one at a time under ``_send_lock`` and posted ones join
        # ``_inflight`` in that order, which is the order of their replies; one thread at a
        # time (the one with ``_receiving``, under ``_turn``) receives the oldest's reply. A
        # blocking request with nothing in flight keeps ``_send_lock`` until its reply is
        # in and never joins ``_inflight`` (``request``).
        self._send_lock = threading.Lock()
        self._requests = itertools.count(1)
        self._inflight: collections.deque[Posted] = collections.deque()
        self._turn = threading.Condition()
        self._receiving = False
        # The request thread: ``*_async`` requests, queued under ``_cv``; while
        # ``_watching``, a look at the replies in flight every ``LOOK_S`` (``_look``), which
        # remembers the number of the oldest request it saw in flight (``_seen``).
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._watching = False
        self._seen = 0
        self._closed = False
        self._why = ""  # what closed it, for the requests that come after
        self._regions: dict[str, RemoteRegion] = {}
        self._maps: list = []
        self.host = ""
        self.pid = 0
        self.refresh()

    def refresh(self) -> None:
        """Reads the owner's region table again (after it allocated new regions)."""
        info = self.call("_regions")
        self.host, self.pid = info["host"], info["pid"]
        for desc in info["regions"]:
            if desc["name"] not in self._regions:
                self._regions[desc["name"]] = RemoteRegion(self, desc, self._map(desc))

    def _map(self, desc: dict) -> Memory | None:
        if not (self.endpoint.direct and desc["segment"] and self.host == self.endpoint.host):
            return None
        try:
            mapping = shm.attach_segment(desc["segment"])
            fd = os.open(os.path.join(shm.SHM_DIR, desc["segment"]), os.O_RDWR)
        except (FileNotFoundError, PermissionError) as exc:
            # Same host name but another machine (or the owner already unlinked it): go on
            # over TCP, which reaches every region.
            log.debug("%s: region %s not mapped (%s); using TCP", self.label, desc["name"], exc)
            return None
        self._maps.append((mapping, fd))
        u8 = np.frombuffer(mapping, dtype=np.uint8, count=desc["nbytes"])
        return Memory(u8, np.dtype(desc["dtype"]), Stripes(desc["nbytes"], fd))

    def region(self, name: str) -> "RemoteRegion":
        """The owner's region ``name``; KeyError names the regions it has."""
        if name not in self._regions:
            self.refresh()
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"{self.label} has no region {name!r} (it has "
                           f"{sorted(self._regions)})") from None

    # ------------------------------------------------------------------ requests
    def call(self, method: str, **args) -> dict:
        """Sends a control message and returns the owner's JSON reply."""
        body = json.dumps({"method": method, **args}).encode()
        return json.loads(self.request(rf.Op.CALL, 0, 0, body))

    def call_async(self, method: str, **args) -> Handle:
        return self.submit(lambda: self.call(method, **args), f"{self.label}.{method}")

    def call_into(self, method: str, into: Callable[[dict], np.ndarray], **args
                  ) -> tuple[dict, np.ndarray | None]:
        """``call`` whose reply may carry bytes (the owner's handler returned it
        ``regions.Attached``): they are received straight into ``into(reply)``, a writable
        contiguous array of ``reply["attached"]`` bytes. Returns the reply and that array
        (None when nothing was attached)."""
        body = json.dumps({"method": method, **args}).encode()
        return self.request(rf.Op.CALL, 0, 0, body, attach=into)

    def call_into_async(self, method: str, into: Callable[[dict], np.ndarray],
                        **args) -> Handle:
        return self.submit(lambda: self.call_into(method, into, **args),
                           f"{self.label}.{method}")

    def post_call(self, method: str, **args) -> "Posted":
        """``call`` pipelined (``post``): sends the control message now and returns at
        once; the ``Posted``'s ``wait()`` returns the owner's JSON reply."""
        body = json.dumps({"method": method, **args}).encode()
        return self.post(rf.Op.CALL, 0, 0, body, decode=json.loads)

    def post_call_into(self, method: str, into: Callable[[dict], np.ndarray],
                       **args) -> "Posted":
        """``call_into`` pipelined (``post``): sends now; ``wait()`` returns (reply, array
        or None), the attached bytes received straight into ``into(reply)`` as they come."""
        body = json.dumps({"method": method, **args}).encode()
        return self.post(rf.Op.CALL, 0, 0, body, attach=into)

    def set_silence(self, silence: float | None) -> None:
        """Changes ``silence`` (None: the endpoint's timeout) for the requests from now on."""
        self.silence = silence
        self.sock.settimeout(self.endpoint.timeout if silence is None else silence)

    def call_if_idle(self, method: str, **args) -> dict | None:
        """``call``, unless a request is in flight on this connection (None then, at once):
        a watcher's look (``silence``), which the receipt of that request's reply already
        makes (by its waiter, or at most ``2 * LOOK_S`` after it was posted by this peer's
        thread: ``post``)."""
        if not self._send_lock.acquire(blocking=False):
            return None
        try:
            if self._inflight:
                return None
            body = json.dumps({"method": method, **args}).encode()
            return json.loads(self._exchange(rf.Op.CALL, 0, 0, body))
        finally:
            self._send_lock.release()

    def abandon(self) -> None:
        """Gives the owner up (found lost) without waiting for a request in flight: shuts the
        socket, so that every request in flight fails at once (``PeerLostError``) and the
        owner, if it wakes, sees this peer gone; ``close`` still frees the rest."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def request(self, op: int, region: int, offset: int, payload=None, length: int = 0,
                into: np.ndarray | None = None, fence: int | None = None, attach=None):
        """One request and its reply, received on this thread (after the replies of the
        requests posted before it). Returns a control reply's bytes (with ``attach``,
        ``call_into``'s pair). ``fence``: the writer's epoch, for a write or an accumulate
        into a fenced region."""
        with self._send_lock:
            if not self._inflight:
                # Nothing in flight, and nothing can be posted while this lock is held: no
                # other thread reads the socket, so the request is sent and its reply read
                # here, as on a connection without pipelining (the parameter servers' path
                # pays for no ``Posted`` and no turn to receive).
                return self._exchange(op, region, offset, payload, length, into, fence,
                                      attach)
            posted = self._send(Posted(self, op, into, attach, None), region, offset,
                                payload, length, fence)
        return posted.wait()

    def post(self, op: int, region: int, offset: int, payload=None, length: int = 0,
             into: np.ndarray | None = None, fence: int | None = None, attach=None,
             decode: Callable | None = None) -> "Posted":
        """Sends one request now and returns without waiting for its reply: the requests
        posted on one peer are in flight together, and their replies come back in the order
        they were sent. ``Posted.wait()`` returns what ``request`` would (passed through
        ``decode``, when given) or raises its error.

        The request is sent on the calling thread, and each reply is received, straight into
        ``into`` or ``attach``'s buffer (the bytes cross once), by the thread that waits for
        it or for a later one: no other thread takes part in the common case, where the
        requester waits soon. A reply that nobody has waited for at two looks of this peer's
        request thread, ``LOOK_S`` apart, is received by that thread: a reply never waits in
        the kernel's buffers for a requester that is busy elsewhere (a large one would hold
        the owner's serving thread in its send, up to the owner's timeout), and the
        ``silence`` of a request in flight is always judged, at most ``2 * LOOK_S`` late.
        Raises at once, sending nothing, when the connection is already closed or lost; an
        ERROR reply fails only its own request."""
        with self._send_lock:
            posted = self._send(Posted(self, op, into, attach, decode), region, offset,
                                payload, length, fence)
        if not self._watching:  # (read without a lock: ``_look`` says why that is enough)
            self._watch()
        return posted

    def _write(self, op: int, request: int, region: int, offset: int, payload, length: int,
               fence: int | None) -> None:
        """(Under ``_send_lock``.) Puts request number ``request`` on the stream; a failure
        to send marks the connection lost and raises its error."""
        if self._closed:
            raise self._closed_error()
        size = length if payload is None else len(payload) if isinstance(payload, bytes) \
            else payload.nbytes
        header = rf.pack(op, request, region, offset, size, fence)
        try:
            if payload is None:
                self.sock.sendall(header)
            elif isinstance(payload, bytes):
                self.sock.sendall(header + payload)
            else:
                self.sock.sendall(header)
                self.sock.sendall(payload)
        except OSError as exc:  # socket.timeout is one
            # Half a request may be on the stream: nothing more can go on it, and the
            # replies of the requests before it are no longer worth waiting for.
            error = self._broken(exc)
            self.abandon()
            raise error from None

    def _exchange(self, op: int, region: int, offset: int, payload=None, length: int = 0,
                  into: np.ndarray | None = None, fence: int | None = None, attach=None):
        """(Under ``_send_lock``, nothing in flight.) ``request``: sends it and reads its
        reply on this thread."""
        request = next(self._requests)
        self._write(op, request, region, offset, payload, length, fence)
        try:
            result, refused = self._read(request, into, attach)
        except Exception as exc:  # as in ``_receive_one``
            raise self._broken(exc) from None
        if refused is not None:  # an answer, not a broken stream
            raise refused
        return result

    def _send(self, posted: "Posted", region: int, offset: int, payload=None, length: int = 0,
              fence: int | None = None) -> "Posted":
        """(Under ``_send_lock``.) Numbers ``posted``, sends its request and puts it in
        flight, behind every request sent before it."""
        posted.request = next(self._requests)
        self._write(posted.op, posted.request, region, offset, payload, length, fence)
        self._inflight.append(posted)
        return posted

    def _receive(self, target: "Posted") -> None:
        """Receives the replies in flight, in order, until ``target``'s is in (or the
        connection is lost): one thread at a time receives; the others wait until their
        own reply has come or the turn to receive is free."""
        with self._turn:
            while not target.done:
                if not self._receiving:
                    self._receiving = True
                    break
                self._turn.wait()
            else:
                return
        self._receive_until(target)

    def _receive_until(self, target: "Posted") -> None:
        """(The thread that took the turn to receive.) Receives until ``target``'s reply is
        in, then gives the turn up."""
        try:
            while True:
                self._receive_one()
                if target.done:
                    break
                with self._turn:  # a waiter for the reply just in
                    self._turn.notify_all()
        finally:
            with self._turn:
                self._receiving = False
                self._turn.notify_all()

    def _receive_one(self) -> None:
        """(The receiving thread.) The reply of the oldest request in flight."""
        posted = self._inflight[0]
        if self._closed:  # abandoned or lost: no reply is waited for
            self._fail_all()
            return
        try:
            result, refused = self._read(posted.request, posted.into, posted.attach)
        except Exception as exc:  # a socket error (or timeout), a reply out of step, or a
            # buffer ``attach`` could not make: the stream is no longer in step with the
            # owner, and nothing more can go on it.
            error = self._broken(exc)
            self._inflight.popleft()
            posted.finish(error=error)
            self._fail_all()
            return
        self._inflight.popleft()
        # A refusal is an answer, not a broken stream: the requests after it go on.
        posted.finish(result=result, error=refused)

    def _read(self, request: int, into: np.ndarray | None, attach):
        """Reads the reply to request number ``request``: (result, None), or (None, the
        error an ERROR reply carries)."""
        reply = rf.unpack(recv_exact(self.sock, rf.HEADER_SIZE), rf.Op.REPLIES)
        if reply.request != request:
            raise ProtocolError(f"{self.label} answered request {reply.request}, "
                                f"expected {request}")
        if reply.op == rf.Op.ERROR:
            return None, error_from(json.loads(self._recv(reply.length)), self.ident)
        if into is not None:
            if reply.length != into.nbytes:
                raise ProtocolError(f"{self.label} sent {reply.length} bytes for a "
                                    f"read of {into.nbytes}")
            recv_into(self.sock, into)
            return None, None
        if reply.length > rf.MAX_CALL:
            raise ProtocolError(f"{self.label} sent a reply of {reply.length} bytes")
        body = self._recv(reply.length)
        if attach is None:
            return body, None
        answer = json.loads(body)
        nbytes = answer.get("attached")
        if nbytes is None:
            return (answer, None), None
        out = attach(answer)
        if out.nbytes != nbytes:
            raise ProtocolError(f"{self.label} attached {nbytes} bytes to its reply; "
                                f"the buffer for them holds {out.nbytes}")
        recv_into(self.sock, out)
        return (answer, out), None

    def _recv(self, n: int) -> bytes:
        data = recv_exact(self.sock, n)
        assert data is not None  # (None only at an end of stream that ``eof_ok`` allows)
        return data

    def _broken(self, exc: BaseException) -> BaseException:
        """Marks the connection lost by ``exc`` (a socket error or a reply out of step);
        returns the error for the request it happened to."""
        self._closed = True
        if isinstance(exc, socket.timeout):
            if self.silence is not None:
                self._why = (f"{self.label} has been silent for {self.silence:g}s (stopped, "
                             "or its host cut off?)")
                return PeerLostError(self._why, peer=self.ident)
            self._why = f"{self.label} did not answer within {self.endpoint.timeout:.0f}s"
            return GradsyncTimeoutError(self._why)
        if not self._why:
            self._why = f"lost the connection to {self.label}: {exc}"
        return PeerLostError(f"lost the connection to {self.label}: {exc} (did it exit or "
                             "crash?)", peer=self.ident)

    def _closed_error(self) -> PeerLostError:
        return PeerLostError(f"the connection to {self.label} is closed"
                             + (f": {self._why}" if self._why else ""), peer=self.ident)

    def _fail_all(self) -> None:
        """(The receiving thread, or ``close``.) Fails every request in flight: the
        connection is closed or lost, and no reply will come."""
        while self._inflight:
            self._inflight.popleft().finish(error=self._closed_error())

    def _watch(self) -> None:
        """Has the request thread look at the replies in flight every ``LOOK_S`` (``post``)
        until none is."""
        with self._cv:
            self._watching = True
            self._start()
            self._cv.notify()

    def _look(self) -> None:
        """(The request thread, ``LOOK_S`` after its last look while watching.) Receives the
        replies in flight up to the newest, when the oldest is the one seen at the last look
        and nobody is receiving: nobody has waited for it since. Stops watching when nothing
        is in flight."""
        with self._turn:
            # Cleared before ``_inflight`` is read, and ``post`` reads it after adding its
            # request: so either this look sees that request, or ``post`` sees the watch
            # stopped and starts it again. Never a request in flight that nobody watches.
            self._watching = False
            if not self._inflight:
                self._seen = 0
                return
            self._watching = True
            oldest = self._inflight[0].request
            if self._receiving or oldest != self._seen:
                self._seen = oldest
                return
            self._receiving = True
            target = self._inflight[-1]
        # (Up to the newest now, not on: a request posted meanwhile is its requester's
        # to receive, as it waits for it soon.)
        self._receive_until(target)

    def submit(self, fn: Callable, name: str) -> Handle:
        """Runs ``fn`` on this peer's request thread, after every earlier async request."""
        handle = Handle(name)
        with self._cv:
            self._queue.append((handle, fn))
            self._start()
            self._cv.notify()
        return handle

    def _start(self) -> None:
        """(Under ``_cv``.) Starts the request thread, the first time it is needed."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"gradsync-regions-to{self.ident}")
            self._thread.start()

    def _loop(self) -> None:
        """(The request thread.) Runs the submitted requests in order, and looks at the
        replies in flight (``_look``) every ``LOOK_S`` while watching."""
        due = time.monotonic()  # of the next look, while watching
        while True:
            with self._cv:
                # A look that is due goes first: requests submitted one after another must
                # not put it off.
                while not self._queue and not (self._watching and time.monotonic() >= due):
                    self._cv.wait(max(0.0, due - time.monotonic()) if self._watching else None)
                job = None if self._watching and time.monotonic() >= due \
                    else self._queue.popleft()
            if job is None:
                due = time.monotonic() + LOOK_S
                try:
                    self._look()
                except Exception:  # (a reply's error is its request's; this is a bug)
                    log.exception("%s: receiving the replies in flight failed", self.label)
                continue
            handle, fn = job
            if fn is None:
                return
            try:
                result = fn()
            except BaseException as exc:  # delivered to whoever waits on the handle
                handle.finish(error=exc)
                continue
            handle.finish(result=result)

    def close(self) -> None:
        """Closes the connection (the owner sees a clean close, after every reply in flight
        has been received) and unmaps shared regions."""
        if self._thread is not None:
            with self._cv:
                self._queue.append((None, None))
                self._cv.notify()
            self._thread.join(self.endpoint.timeout)
        with self._send_lock:
            if self._inflight and not self._closed:  # posted, and nobody waited
                self._receive(self._inflight[-1])
            with self._turn:
                while self._receiving:
                    self._turn.wait()
                self._closed = True
                self._fail_all()
            try:
                self.sock.close()
            except OSError:
                pass
        for region in self._regions.values():
            region.direct = None
        for mapping, fd in self._maps:
            os.close(fd)
        self._maps.clear()


class Posted:
    """A request sent to another endpoint whose reply is still to come (``RemotePeer.post``).

    ``wait()`` returns its result, or raises its error (an ERROR reply's, or the lost
    connection's); ``poll()`` says whether the reply is in. Replies arrive in the order the
    requests were sent, each one received straight into its request's buffer.
    """

    __slots__ = ("peer", "op", "into", "attach", "decode", "request", "done", "_result",
                 "_error")

    def __init__(self, peer: RemotePeer, op: int, into: np.ndarray | None, attach,
                 decode: Callable | None):
        self.peer, self.op, self.into, self.attach, self.decode = peer, op, into, attach, decode
        self.request = 0  # its number on the connection, once sent
        # Set once, by the receiving thread, after the result: a waiter reads it under the
        # peer's ``_turn``, which that thread notifies after each reply.
        self.done = False
        self._result = None
        self._error: BaseException | None = None

    def poll(self) -> bool:
        return self.done

    def finish(self, result=None, error: BaseException | None = None) -> None:
        """(The receiving thread.) The reply is in, or the request failed."""
        self._result, self._error = result, error
        self.done = True

    def wait(self):
        """The reply's result (``decode``-d); receives the replies before it and its own
        when no other thread is doing so. No byte of a reply for the connection's
        ``silence`` (else the endpoint's timeout) fails it and every request in flight."""
        if not self.done:
            self.peer._receive(self)
        if self._error is not None:
            raise self._error
        if self.decode is not None:
            return self.decode(self._result)
        return self._result


class RemoteRegion:
    """A region of another endpoint; offsets and sizes are in bytes.

    Attributes:
        name, nbytes, dtype, shape: as the owner registered it.
        fenced: writes must carry the writer's epoch (``fence=``) and go through the owner.
        direct: this process's mapping of the region when it is shared memory on this host
            (accesses are then a copy in this process; for a fenced region, reads only),
            else None (accesses go over TCP).
    """

    def __init__(self, peer: RemotePeer, desc: dict, direct: Memory | None):
        self.peer, self.index, self.name = peer, desc["index"], desc["name"]
        self.nbytes, self.dtype = desc["nbytes"], np.dtype(desc["dtype"])
        self.shape = tuple(desc["shape"])
        self.fenced = bool(desc["fenced"])
        self.direct = direct

    def _check(self, what: str, nbytes: int, offset: int, fence=None) -> None:
        if offset < 0 or nbytes > self.nbytes - offset:
            raise ValueError(f"{what} of {nbytes} bytes at offset {offset} is outside region "
                             f"'{self.name}' of {self.peer.label} ({self.nbytes} bytes)")
        if what == "read":
            return
        if self.fenced and fence is None:
            raise ValueError(f"region '{self.name}' of {self.peer.label} is fenced: a {what} "
                             f"must carry the writer's epoch (fence=...)")
        if fence is not None:
            if not self.fenced:
                raise ValueError(f"region '{self.name}' of {self.peer.label} is not fenced: "
                                 f"{what} it without a fence")
            rf.check_epoch(fence)

    def read(self, out, offset: int = 0):
        """Copies ``out.nbytes`` bytes of the region from ``offset`` into ``out``; returns it."""
        u8 = as_bytes(out, writable=True)
        self._check("read", u8.nbytes, offset)
        if self.direct is not None:
            self.direct.read(u8, offset)
        else:
            self.peer.request(rf.Op.READ, self.index, offset, length=u8.nbytes, into=u8)
        return out

    def write(self, src, offset: int = 0, fence: int | None = None) -> None:
        """Copies the bytes of ``src`` into the region at ``offset``.

        Args:
            fence: the writer's epoch; required by a fenced region (and refused by any
                other). The owner refuses a write of an epoch below its fence with
                ``StaleWriteError``, having stored none of it.
        """
        u8 = as_bytes(src, writable=False)
        self._check("write", u8.nbytes, offset, fence)
        if self.direct is not None and not self.fenced:
            self.direct.write(u8, offset)
        else:
            self.peer.request(rf.Op.WRITE, self.index, offset, u8, fence=fence)

    def accumulate(self, src, offset: int = 0, fence: int | None = None) -> None:
        """Adds ``src`` (of the region's dtype) element-wise into the region at ``offset``
        (``fence``: as for ``write``)."""
        arr = src.detach().numpy() if hasattr(src, "detach") else np.asarray(src)
        if arr.dtype != self.dtype:
            raise TypeError(f"accumulate of {arr.dtype} into region '{self.name}' of "
                            f"{self.dtype}: convert first")
        u8 = as_bytes(arr, writable=False)
        self._check("accumulate", u8.nbytes, offset, fence)
        if offset % self.dtype.itemsize:
            raise ValueError(f"accumulate offset {offset} is not a multiple of the element "
                             f"size {self.dtype.itemsize}")
        if self.direct is not None and not self.fenced:
            self.direct.accumulate(u8, offset, start=self.peer.endpoint.ident)
        else:
            self.peer.request(rf.Op.ACCUMULATE, self.index, offset, u8, fence=fence)

    def read_async(self, out, offset: int = 0) -> Handle:
        return self.peer.submit(lambda: self.read(out, offset), f"read {self.name}")

    def write_async(self, src, offset: int = 0, fence: int | None = None) -> Handle:
        return self.peer.submit(lambda: self.write(src, offset, fence), f"write {self.name}")

    def accumulate_async(self, src, offset: int = 0, fence: int | None = None) -> Handle:
        return self.peer.submit(lambda: self.accumulate(src, offset, fence),
                                f"accumulate {self.name}")


def wait(handles) -> list:
    """Waits for every handle and returns their results; raises the first error."""
    results, first = [], None
    for h in handles:
        try:
            results.append(h.wait())
        except BaseException as exc:
            first = first or exc
            results.append(None)
    if first is not None:
        raise first
    return results
