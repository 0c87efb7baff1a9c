"""The peer side of one-sided memory regions: reaching another endpoint's regions.

``Endpoint.connect`` (``regions.py``) returns a ``RemotePeer``: one authenticated TCP
connection to an owner, its table of regions, and its control methods. A ``RemoteRegion``
does each access the cheapest way it can: a copy through this process's own mapping when the
region is shared memory on this host, else a request that the owner's serving thread answers
straight from or into the region (the protocol is in ``rma_frame.py``). A write into a
*fenced* region carries the writer's epoch and always goes through the owner, which decides
whether to store it (``regions.py``); reads of it still use the mapping. Requests to one peer
are ordered; requests to different peers run together on each peer's request thread.

*Silence.* A peer connected with ``silence=S`` (a data server's: ``gradsync/data/liveness.py``)
is an owner that always answers within S seconds while it runs: a reply of which no byte
arrives for S seconds means the owner is stopped, or its host cut off, and the request raises
``PeerLostError`` (``silent``) instead of waiting for the endpoint's timeout. The owner's
handlers must then never hold a reply longer than S (a data server's ``take`` answers
"pending" instead); ``call_if_idle`` lets a watcher ask only when no request is in flight,
which watches that peer already.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import socket
import threading
from typing import Callable

import numpy as np

from ..errors import GradsyncTimeoutError, PeerLostError, ProtocolError
from ..pipeline.engine import Handle
from . import rma_frame as rf
from . import shm
from .region_memory import Memory, Stripes, as_bytes
from .rma_frame import error_from, recv_exact, recv_into

__all__ = ["RemotePeer", "RemoteRegion", "wait"]

log = logging.getLogger("gradsync.regions")


class RemotePeer:
    """A connection to another endpoint: its regions and its control methods.

    Requests on one peer run one at a time in the order issued (blocking ones on the caller's
    thread, ``*_async`` ones on this peer's own thread), so requests to different peers can
    be in flight together while those to one peer stay ordered.

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
        self._lock = threading.Lock()
        self._requests = itertools.count(1)
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
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
        reply = self.request(rf.Op.CALL, 0, 0, body)
        return json.loads(reply)

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

    def set_silence(self, silence: float | None) -> None:
        """Changes ``silence`` (None: the endpoint's timeout) for the requests from now on."""
        self.silence = silence
        self.sock.settimeout(self.endpoint.timeout if silence is None else silence)

    def call_if_idle(self, method: str, **args) -> dict | None:
        """``call``, unless a request is in flight on this connection (None then, at once):
        a watcher's look (``silence``), which that request's own wait already makes."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            body = json.dumps({"method": method, **args}).encode()
            return json.loads(self._request(rf.Op.CALL, 0, 0, body))
        finally:
            self._lock.release()

    def abandon(self) -> None:
        """Gives the owner up (found lost) without waiting for a request in flight: shuts the
        socket, so that such a request fails at once and the owner, if it wakes, sees this
        peer gone; ``close`` still frees the rest."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def request(self, op: int, region: int, offset: int, payload=None, length: int = 0,
                into: np.ndarray | None = None, fence: int | None = None, attach=None):
        """One request and its reply, under this peer's lock. Returns a control reply's bytes
        (with ``attach``, ``call_into``'s pair). ``fence``: the writer's epoch, for a write
        or an accumulate into a fenced region."""
        with self._lock:
            return self._request(op, region, offset, payload, length, into, fence, attach)

    def _request(self, op: int, region: int, offset: int, payload=None, length: int = 0,
                 into: np.ndarray | None = None, fence: int | None = None, attach=None):
        """(Under ``_lock``.) ``request``."""
        if self._closed:
            raise PeerLostError(f"the connection to {self.label} is closed"
                                + (f": {self._why}" if self._why else ""), peer=self.ident)
        rid = next(self._requests)
        size = length if payload is None else len(payload) if isinstance(payload, bytes) \
            else payload.nbytes
        try:
            header = rf.pack(op, rid, region, offset, size, fence)
            if payload is None:
                self.sock.sendall(header)
            elif isinstance(payload, bytes):
                self.sock.sendall(header + payload)
            else:
                self.sock.sendall(header)
                self.sock.sendall(payload)
            reply = rf.unpack(recv_exact(self.sock, rf.HEADER_SIZE), rf.Op.REPLIES)
            if reply.request != rid:
                raise ProtocolError(f"{self.label} answered request {reply.request}, "
                                    f"expected {rid}")
            if reply.op == rf.Op.ERROR:
                refused = error_from(json.loads(recv_exact(self.sock, reply.length)),
                                      self.ident)
            elif into is not None:
                if reply.length != into.nbytes:
                    raise ProtocolError(f"{self.label} sent {reply.length} bytes for a "
                                        f"read of {into.nbytes}")
                recv_into(self.sock, into)
                return None
            else:
                if reply.length > rf.MAX_CALL:
                    raise ProtocolError(f"{self.label} sent a reply of {reply.length} bytes")
                body = recv_exact(self.sock, reply.length)
                if attach is None:
                    return body
                answer = json.loads(body)
                nbytes = answer.get("attached")
                if nbytes is None:
                    return answer, None
                out = attach(answer)
                if out.nbytes != nbytes:
                    raise ProtocolError(f"{self.label} attached {nbytes} bytes to its reply; "
                                        f"the buffer for them holds {out.nbytes}")
                recv_into(self.sock, out)
                return answer, out
        except socket.timeout:
            self._closed = True
            if self.silence is not None:
                self._why = (f"{self.label} has been silent for {self.silence:g}s (stopped, "
                             "or its host cut off?)")
                raise PeerLostError(self._why, peer=self.ident) from None
            raise GradsyncTimeoutError(f"{self.label} did not answer within "
                                       f"{self.endpoint.timeout:.0f}s") from None
        except (OSError, ProtocolError) as exc:
            # The stream is no longer in step with the owner: nothing more can go on it.
            self._closed = True
            raise PeerLostError(f"lost the connection to {self.label}: {exc} (did it exit "
                                f"or crash?)", peer=self.ident) from None
        # Raised outside the socket handling: a refusal is an answer, not a broken stream
        # (and a GradsyncTimeoutError it carries is no socket timeout).
        raise refused

    def submit(self, fn: Callable, name: str) -> Handle:
        """Runs ``fn`` on this peer's request thread, after every earlier async request."""
        handle = Handle(name)
        with self._cv:
            self._queue.append((handle, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"gradsync-regions-to{self.ident}")
                self._thread.start()
            self._cv.notify()
        return handle

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                handle, fn = self._queue.popleft()
            if fn is None:
                return
            try:
                handle.finish(result=fn())
            except BaseException as exc:  # delivered to whoever waits on the handle
                handle.finish(error=exc)

    def close(self) -> None:
        """Closes the connection (the owner sees a clean close) and unmaps shared regions."""
        if self._thread is not None:
            with self._cv:
                self._queue.append((None, None))
                self._cv.notify()
            self._thread.join(self.endpoint.timeout)
        with self._lock:
            self._closed = True
            try:
                self.sock.close()
            except OSError:
                pass
        for region in self._regions.values():
            region.direct = None
        for mapping, fd in self._maps:
            os.close(fd)
        self._maps.clear()


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
