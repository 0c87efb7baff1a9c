"""One-sided memory regions (``transport/regions.py``): the request header, bounds and stripes;
every access path against NumPy; refused, hostile, stalled and lost peers; and accumulates from
several processes at once, which must lose no update. Values are small integers, so every sum
is exact; each test has a job id of its own and leaves nothing in /dev/shm.
"""

from __future__ import annotations

import errno
import faulthandler
import fcntl
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
import types
import uuid

import numpy as np
import pytest

from gradsync.errors import AuthenticationError, GradsyncError, PeerLostError, ProtocolError
from gradsync.transport import region_memory, region_peer
from gradsync.transport import rma_frame as rf
from gradsync.transport.region_peer import wait
from gradsync.transport.regions import (STRIPE_BYTES, Attached, Endpoint, RegionAccessError,
                                       Stripes)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

SECRET = b"r" * 32
HOST = "h"  # every endpoint claims the same host, so allocated regions are mapped directly
READ, WRITE, ACC = rf.Op.READ, rf.Op.WRITE, rf.Op.ACCUMULATE


def _leftovers(job: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"gradsync-{job}-"))


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = _soon(seconds)
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# --- pure logic ---------------------------------------------------------------------------

_CALL = rf.pack(rf.Op.CALL, 7, 0, 0, 10)


@pytest.mark.parametrize("raw, allowed, match", [
    (b"XXXX" + _CALL[4:], rf.Op.REQUESTS, "magic"),
    (_CALL[:4] + b"\x01" + _CALL[5:], rf.Op.REQUESTS, "version"),
    (rf.pack(rf.Op.REPLY, 1, 0, 0, 0), rf.Op.REQUESTS, "op 5"),
    (rf.pack(99, 1, 0, 0, 0), rf.Op.REQUESTS, "op 99"),
    (rf.pack(READ, 1, 0, 0, 0), rf.Op.REPLIES, "op 1"),
    (rf.pack(rf.Op.CALL, 1, 0, 0, rf.MAX_CALL + 1), rf.Op.REQUESTS, "control message"),
    (rf.pack(rf.Op.ERROR, 1, 0, 0, 2**64 - 1), rf.Op.REPLIES, "control message"),
])
def test_unpack_rejects_untrustworthy_headers(raw, allowed, match):
    with pytest.raises(ProtocolError, match=match):
        rf.unpack(raw, allowed)


class _Trickle:
    """A socket whose ``sendmsg`` takes at most ``most`` bytes of its buffers per call (as a
    full send buffer makes a kernel take part of them)."""

    def __init__(self, most: int):
        self.most, self.calls, self.sent = most, 0, bytearray()

    def sendmsg(self, buffers):
        self.calls += 1
        room = self.most
        for buf in buffers:
            piece = bytes(buf[:room])
            self.sent += piece
            room -= len(piece)
            if not room:
                break
        return self.most - room


@pytest.mark.parametrize("most", [1, 5, 7, 1 << 20])
def test_send_parts_sends_every_byte_in_order_across_partial_sends(most):
    # A reply and the batches attached to it (``regions.Attached``): bytes, arrays (one
    # empty), sent one after the other whatever the kernel takes per call.
    parts = [b"head", np.arange(9, dtype=np.uint8), np.zeros(0, np.uint8),
             np.full(6, 7, np.uint8)[::1], b"x"]
    sock = _Trickle(most)
    rf.send_parts(sock, parts)
    want = b"".join(bytes(part) for part in parts)
    assert bytes(sock.sent) == want
    assert sock.calls == -(-len(want) // most)  # no call that sent nothing


class _Feed:
    """A socket whose receives return ``steps`` in turn: bytes (as much as the buffer takes;
    the rest at the next receive) or an exception to raise (a timeout); then end of stream."""

    def __init__(self, *steps):
        self.steps, self.calls = list(steps), 0

    def recv_into(self, view):
        self.calls += 1
        step = self.steps.pop(0) if self.steps else b""
        if isinstance(step, BaseException):
            raise step
        n = min(len(view), len(step))
        view[:n] = step[:n]
        if n < len(step):
            self.steps.insert(0, step[n:])
        return n


def _call(request: int, body: bytes) -> bytes:
    return rf.pack(rf.Op.CALL, request, 0, 0, len(body)) + body


def test_an_owner_reads_a_request_and_its_payload_in_one_receive_and_keeps_the_next():
    # Two control messages pipelined, the second cut across two receives: three reads of
    # the stream would take five receives one by one (header, payload, ...).
    first, second = _call(1, b'{"method": "take"}'), _call(2, b'{"method": "ping"}')
    feed = _Feed(first + second[:10], second[10:])
    incoming = rf.Incoming(feed)
    assert rf.unpack(incoming.header(), rf.Op.REQUESTS).request == 1
    assert incoming.exact(18) == b'{"method": "take"}'
    assert feed.calls == 1
    assert rf.unpack(incoming.header(), rf.Op.REQUESTS).request == 2
    assert incoming.exact(18) == b'{"method": "ping"}'
    assert feed.calls == 2
    assert incoming.header() is None  # a clean end between requests


def test_an_owners_read_ahead_goes_into_the_region_before_the_rest_of_the_payload():
    payload = np.arange(40_000, dtype=np.uint32).view(np.uint8)  # more than one read ahead
    feed = _Feed(rf.pack(WRITE, 1, 0, 0, payload.nbytes) + payload.tobytes())
    incoming = rf.Incoming(feed)
    incoming.header()
    dst = np.zeros(payload.nbytes, np.uint8)
    incoming.into(dst[:100])  # from the bytes read ahead only
    incoming.into(dst[100:])  # the rest of them, then straight from the socket
    assert np.array_equal(dst, payload)
    assert incoming.header() is None


def test_an_owner_waits_for_an_idle_peer_but_not_for_one_stalled_in_a_request():
    head = _call(1, b"{}")
    incoming = rf.Incoming(_Feed(socket.timeout(), socket.timeout(), head + b"{}"))
    assert incoming.header() == head[:rf.HEADER_SIZE]  # idle twice: no stall
    stalled = rf.Incoming(_Feed(head[:7], socket.timeout()))
    with pytest.raises(socket.timeout):
        stalled.header()
    with pytest.raises(ConnectionResetError, match="after 7 of a header's"):
        rf.Incoming(_Feed(head[:7])).header()


_TABLE = [types.SimpleNamespace(name="a", nbytes=64), types.SimpleNamespace(name="b", nbytes=0)]


@pytest.mark.parametrize("op, region, offset, length, why", [
    (READ, 0, 0, 64, None), (WRITE, 0, 64, 0, None), (WRITE, 0, 3, 5, None),
    (ACC, 0, 8, 56, None), (READ, 1, 0, 0, None),
    (READ, 2, 0, 0, "no region #2"), (WRITE, 2**32 - 1, 0, 8, "no region"),
    (WRITE, 0, 60, 8, "outside"), (READ, 0, 65, 0, "outside"), (WRITE, 1, 0, 1, "outside"),
    (WRITE, 0, 2**63, 8, "outside"), (WRITE, 0, 8, 2**64 - 1, "outside"),
    (ACC, 0, 2**64 - 8, 16, "outside"), (ACC, 0, 4, 8, "aligned"), (ACC, 0, 8, 12, "aligned"),
])
def test_check_access(op, region, offset, length, why):
    got = rf.check_access(rf.Request(op, 1, region, offset, length), _TABLE, lambda r: 8)
    assert got is None if why is None else why in got


@pytest.mark.parametrize("lo, hi, start, want", [
    (0, 0, 0, []), (5, 5, 3, []), (10, 20, 7, [(10, 20)]), (0, 64, 1, [(0, 64)]),
    (60, 200, 0, [(60, 64), (64, 128), (128, 192), (192, 200)]),
    (60, 200, 1, [(64, 128), (128, 192), (192, 200), (60, 64)]),
    (60, 200, 6, [(128, 192), (192, 200), (60, 64), (64, 128)]),  # 6 mod the 4 stripes spanned
    (128, 256, 1, [(192, 256), (128, 192)]),
])
def test_stripes_cut_at_boundaries_and_rotate(lo, hi, start, want):
    assert Stripes(256, None, stripe=64).pieces(lo, hi, start) == want


# --- ranks as threads: owner and clients in this process ----------------------------------

@pytest.fixture
def job():
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    assert _leftovers(name) == [], "segments left in /dev/shm"


@pytest.fixture
def net(job):
    """Endpoint 0 owns regions; ``client(ident, direct)`` connects another endpoint to it."""
    owner = Endpoint(0, HOST, SECRET, job, expect=set(range(1, 10)), timeout=10)
    owner.on_call("echo", lambda peer, args: {"peer": peer, **args})
    made = []

    def client(ident: int, direct: bool = True):
        made.append(Endpoint(ident, HOST, SECRET, job, direct=direct, timeout=10))
        made.append(made[-1].connect(0, "127.0.0.1", owner.port, _soon(), label="owner"))
        return made[-1]

    yield owner, client
    for thing in reversed(made):
        thing.close()
    owner.close()


def _cases(n: int, per_stripe: int) -> list[tuple[int, int]]:
    """(first element, count): empty, one, uneven, stripe-crossing and whole, start to end."""
    mid = n // 2 + 1
    return [(0, 0), (0, 1), (mid, 0), (mid, 1), (mid, 1001), (n - 1, 1), (n, 0),
            (per_stripe - 5, per_stripe + 10), (0, n)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("kind", ["shm-direct", "shm-tcp", "registered"])
def test_access_matches_numpy(net, kind, dtype):
    owner, client = net
    per_stripe = STRIPE_BYTES // np.dtype(dtype).itemsize
    n = 3 * per_stripe + 3  # 3 MiB and 3 elements: four stripes, the last a stub
    if kind == "registered":
        array = owner.register("r", np.zeros(n, dtype)).array
    else:
        array = owner.allocate("r", (n,), dtype)
    region = client(1, direct=kind != "shm-tcp").region("r")
    assert (region.direct is not None) == (kind == "shm-direct")
    assert (region.nbytes, region.dtype, region.shape) == (array.nbytes, array.dtype, (n,))
    ref = np.zeros(n, dtype)
    for k, (first, count) in enumerate(_cases(n, per_stripe)):
        at, src = first * ref.itemsize, (np.arange(count) % 101 + k).astype(dtype)
        region.write(src, at)
        ref[first:first + count] = src
        region.accumulate(src % 7, at)
        ref[first:first + count] += src % 7
        out = np.full(count, -1, dtype)
        assert region.read(out, at) is out
        assert (out == ref[first:first + count]).all(), (first, count)
        assert (array == ref).all(), f"({first}, {count}) changed elements outside its range"


@pytest.mark.parametrize("direct", [True, False])
def test_async_requests_run_in_issue_order(net, direct):
    owner, client = net
    array = owner.allocate("r", (1000,), np.int64)
    peer = client(2, direct)
    region, a, out = peer.region("r"), np.arange(1000, dtype=np.int64), np.zeros(1000, np.int64)
    got = wait([region.write_async(a), region.accumulate_async(a[:500], 8 * 250),
                region.read_async(out), peer.call_async("echo", x=3)])
    ref = a.copy()
    ref[250:750] += a[:500]
    assert (out == ref).all() and (array == ref).all()
    assert got[2] is out and got[3] == {"peer": 2, "x": 3}


@pytest.mark.parametrize("direct", [True, False])
def test_client_refuses_out_of_range_before_sending(net, direct):
    owner, client = net
    array = owner.allocate("r", (10,), np.float64)
    region = client(1, direct).region("r")
    for op, buf, offset in [("write", np.ones(11), 0), ("read", np.ones(1), 80),
                            ("read", np.ones(0), 81), ("accumulate", np.ones(2), 72),
                            ("write", np.ones(1), -8), ("accumulate", np.ones(1), 4)]:
        with pytest.raises(ValueError):
            getattr(region, op)(buf, offset)
    with pytest.raises(TypeError, match="convert"):
        region.accumulate(np.ones(1, np.float32))
    assert (array == 0).all()


@pytest.mark.parametrize("direct", [True, False])
def test_owner_refuses_forged_requests_and_keeps_the_connection(net, direct):
    owner, client = net
    shm = [owner.allocate(name, (16,), np.int64) for name in ("left", "right")]
    joint = np.zeros(32, np.int64)  # two registered regions side by side in one buffer
    owner.register("lo", joint[:16])
    owner.register("hi", joint[16:])
    peer = client(1, direct)
    index = {name: peer.region(name).index for name in ("left", "lo")}
    u8 = np.full(16, 0xFF, np.uint8)
    for op, name, offset, payload, length in [
            (WRITE, "left", 120, u8, 0), (WRITE, "lo", 120, u8, 0), (ACC, "lo", 4, u8[:8], 0),
            (ACC, "lo", 8, u8[:12], 0), (WRITE, "lo", 2**63, u8[:8], 0), (WRITE, 99, 0, u8, 0),
            (READ, "lo", 0, None, 129), (READ, "left", 2**64 - 1, None, 1)]:
        with pytest.raises(RegionAccessError) as refused:
            peer.request(op, index.get(name, name), offset, payload, length=length,
                         into=None if payload is not None else np.zeros(length, np.uint8))
        assert isinstance(refused.value, ValueError)
        assert peer.call("echo", after=str(refused.value)[:20])["peer"] == 1  # still in step
        assert (joint == 0).all() and (shm[0] == 0).all() and (shm[1] == 0).all()
    peer.region("lo").write(np.arange(16, dtype=np.int64))
    assert (joint[:16] == np.arange(16)).all() and (joint[16:] == 0).all()


def test_wrong_secret_is_refused_and_the_owner_keeps_serving(net, job):
    owner, client = net
    array = owner.allocate("r", (4,), np.float32)
    intruder = Endpoint(5, HOST, b"x" * 32, job)
    try:
        with pytest.raises(AuthenticationError):
            intruder.connect(0, "127.0.0.1", owner.port, _soon(), label="owner")
    finally:
        intruder.close()
    client(5).region("r").write(np.ones(4, np.float32))  # the refusal did not use up id 5
    assert (array == 1).all()


@pytest.mark.parametrize("garbage", [
    b"\0" * rf.HEADER_SIZE, rf.pack(99, 1, 0, 0, 0), rf.pack(rf.Op.CALL, 1, 0, 0, 2**40),
    rf.pack(WRITE, 1, 0, 8, 2**62),  # refused, and too long to drain
], ids=["zeros", "op", "call-size", "undrainable"])
def test_garbage_drops_only_that_connection(net, garbage):
    owner, client = net
    array = owner.allocate("r", (4,), np.int64)
    lost = []
    owner.on_disconnect(lambda peer, error: lost.append((peer, error)))
    peer = client(1, direct=False)
    region = peer.region("r")
    peer.sock.sendall(garbage)
    peer.sock.settimeout(5)
    assert peer.sock.recv(1) == b"", "the owner kept a connection that sent garbage"
    assert _until(lambda: lost) and lost[0][0] == 1 and isinstance(lost[0][1], ProtocolError)
    with pytest.raises(PeerLostError):
        region.read(np.zeros(4, np.int64))
    other = client(2, direct=False)
    other.region("r").accumulate(np.full(4, 3, np.int64))
    assert (array == 3).all() and other.call("echo")["peer"] == 2


def test_a_peer_stalled_mid_request_is_dropped_and_frees_its_stripe(net):
    owner, client = net
    owner.timeout = 0.5  # how long the owner waits for the rest of a request it has begun
    array = owner.allocate("r", (8,), np.int64)
    lost = []
    owner.on_disconnect(lambda peer, error: lost.append((peer, error)))
    stalled, region = client(1, direct=False), client(2, direct=False).region("r")
    time.sleep(0.8)  # idle between requests for longer than that is fine
    stalled.sock.sendall(rf.pack(WRITE, 1, 0, 0, 64) + bytes(8))  # takes stripe 0, then stops
    region.write(np.arange(8, dtype=np.int64))  # waits for stripe 0, then gets it
    assert (array == np.arange(8)).all()
    assert _until(lambda: lost) and [(p, type(e)) for p, e in lost] == [(1, TimeoutError)]


def test_control_errors_reach_the_caller(net):
    owner, client = net
    owner.on_call("buggy", lambda peer, args: 1 / 0)
    peer = client(1)
    with pytest.raises(ValueError, match="no control method 'nope'") as e:
        peer.call("nope")
    assert type(e.value) is ValueError
    with pytest.raises(GradsyncError, match="division by zero"):  # a bug in a handler
        peer.call("buggy")
    assert peer.call("echo", x=1) == {"peer": 1, "x": 1}


def test_closing_the_owner_fails_a_blocked_peer_and_frees_segments(net, job):
    owner, client = net
    owner.allocate("r", (1 << 16,), np.float32)
    entered, release = threading.Event(), threading.Event()
    owner.on_call("block", lambda peer, args: (entered.set(), release.wait(10), {})[-1])
    peer = client(1)
    assert len(_leftovers(job)) == 1
    handle = peer.call_async("block")
    assert entered.wait(5)
    start = time.monotonic()
    owner.close()
    with pytest.raises(PeerLostError):
        handle.wait(5)  # TimeoutError here would mean the peer hangs
    assert time.monotonic() - start < 5 and _leftovers(job) == []
    with pytest.raises(PeerLostError):
        peer.call("echo")
    release.set()


# --- pipelined requests: several in flight on one connection ------------------------------

def _waiting_bytes(owner: Endpoint, peer: int) -> int:
    """Bytes of ``peer``'s requests that wait, unread, on the owner's end of its connection
    (a peek through a non-blocking duplicate, as ``slots.check_open`` looks)."""
    sock = owner._conns[peer]
    with socket.fromfd(sock.fileno(), sock.family, sock.type) as probe:
        probe.setblocking(False)
        try:
            return len(probe.recv(1 << 16, socket.MSG_PEEK))
        except BlockingIOError:
            return 0


def _holding(owner: Endpoint):
    """Adds the control method ``hold``, which answers ``{"held": x}`` once ``release`` is
    set; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def hold(peer, args):
        entered.set()
        assert release.wait(20)
        return {"held": args["x"]}

    owner.on_call("hold", hold)
    return entered, release


def test_posted_requests_are_in_flight_together_and_answered_in_order(net):
    owner, client = net
    array = owner.register("r", np.arange(64, dtype=np.int64)).array
    entered, release = _holding(owner)
    peer = client(1, direct=False)
    out = np.zeros(8, np.int64)
    first = peer.post_call("hold", x=1)
    assert entered.wait(5)  # the owner's serving thread holds the first request ...
    later = [peer.post_call("echo", x=2), peer.post(READ, peer.region("r").index, 8 * 8,
                                                    length=out.nbytes, into=out),
             peer.post_call_into("echo", lambda reply: np.empty(0, np.uint8), x=4)]
    # ... while the ones sent after it are on its connection already, unanswered.
    assert _until(lambda: _waiting_bytes(owner, 1) >= 3 * rf.HEADER_SIZE)
    assert not first.poll() and not any(p.poll() for p in later)
    # A blocking call behind them waits for their replies, then gets its own.
    behind = peer.call_async("echo", x=5)
    release.set()
    assert first.wait() == {"held": 1}
    assert later[0].wait() == {"peer": 1, "x": 2}
    assert later[1].wait() is None and (out == array[8:16]).all()
    assert later[2].wait() == ({"peer": 1, "x": 4}, None)
    assert behind.wait(5) == {"peer": 1, "x": 5}


def test_an_error_reply_between_posted_requests_fails_only_its_own(net):
    owner, client = net
    entered, release = _holding(owner)
    peer = client(1, direct=False)
    posted = [peer.post_call("hold", x=1), peer.post_call("nope"), peer.post_call("echo", x=3)]
    assert entered.wait(5)
    release.set()
    assert posted[0].wait() == {"held": 1}
    with pytest.raises(ValueError, match="no control method 'nope'"):
        posted[1].wait()
    assert posted[2].wait() == {"peer": 1, "x": 3}
    assert peer.call("echo", x=4) == {"peer": 1, "x": 4}  # the stream is still in step


def test_abandoning_a_peer_fails_every_request_in_flight_at_once(net):
    owner, client = net
    entered, release = _holding(owner)
    peer = client(1, direct=False)
    posted = [peer.post_call("hold", x=1), peer.post_call("echo", x=2),
              peer.post_call("echo", x=3)]
    assert entered.wait(5)
    start = time.monotonic()
    peer.abandon()
    for p in posted:  # no reply will come: each fails, though the owner still holds one
        with pytest.raises(PeerLostError):
            p.wait()
    assert time.monotonic() - start < 5
    with pytest.raises(PeerLostError, match="closed"):
        peer.post_call("echo", x=4)
    release.set()


def test_a_silent_owner_fails_every_request_in_flight_though_nobody_waits(job):
    owner = Endpoint(0, HOST, SECRET, job, expect={1}, timeout=60)
    entered, release = _holding(owner)
    owner.on_call("echo", lambda peer, args: args)
    client = Endpoint(1, HOST, SECRET, job, timeout=60, direct=False)
    try:
        peer = client.connect(0, "127.0.0.1", owner.port, _soon(), label="owner",
                              silence=0.5)
        start = time.monotonic()
        posted = [peer.post_call("hold", x=1), peer.post_call("echo", x=2)]
        # Nobody waits for them: the peer's own thread receives the replies as they come,
        # so the silence is judged all the same.
        assert _until(lambda: all(p.poll() for p in posted), 10)
        assert time.monotonic() - start < 10  # the endpoint's timeout is 60 s
        with pytest.raises(PeerLostError, match="owner has been silent for 0.5s"):
            posted[0].wait()
        with pytest.raises(PeerLostError, match="silent"):
            posted[1].wait()
        peer.close()
    finally:
        release.set()
        client.close()
        owner.close()


def _attaching(owner: Endpoint):
    """Adds the control method ``bytes``, whose reply carries ``n`` bytes; returns the list
    of the threads that make the buffers the replies' bytes are received into (``into``)."""
    owner.on_call("bytes", lambda peer, args: Attached({"n": args["n"]},
                                                       np.zeros(args["n"], np.uint8)))
    receivers: list[str] = []

    def into(reply: dict) -> np.ndarray:
        receivers.append(threading.current_thread().name)
        return np.empty(reply["attached"], np.uint8)

    return receivers, into


def test_posted_replies_are_received_by_the_thread_that_waits(net, monkeypatch):
    # The requester that waits receives the replies itself, a blocking call behind them
    # too: no other thread takes part (each reply was handed to the peer's own thread).
    monkeypatch.setattr(region_peer, "LOOK_S", 60.0)  # no look of the peer's thread meanwhile
    owner, client = net
    receivers, into = _attaching(owner)
    peer = client(1, direct=False)
    posted = [peer.post_call_into("bytes", into, n=n) for n in (10, 20, 30)]
    assert peer.call_into("bytes", into, n=40)[1].nbytes == 40
    assert all(p.poll() for p in posted)  # received on the way to the call's own reply
    assert [p.wait()[1].nbytes for p in posted] == [10, 20, 30]
    assert receivers == [threading.current_thread().name] * 4


def test_a_posted_reply_nobody_waits_for_is_received_by_the_peers_thread(net, monkeypatch):
    # 16 MiB: more than the kernel's buffers hold, so the owner's serving thread stays in its
    # send until someone receives. Nobody waits: the peer's thread receives it after two
    # looks, then stops looking; a request posted after that is watched again.
    monkeypatch.setattr(region_peer, "LOOK_S", 0.02)
    owner, client = net
    receivers, into = _attaching(owner)
    peer = client(1, direct=False)
    for _ in range(2):
        posted = peer.post_call_into("bytes", into, n=16 << 20)
        assert _until(posted.poll)
        assert _until(lambda: not peer._watching)
    assert receivers == [f"gradsync-regions-to{peer.ident}"] * 2
    assert posted.wait()[0] == {"n": 16 << 20, "attached": 16 << 20}
    assert peer.call("echo", x=1) == {"peer": 1, "x": 1}  # the owner serves on


def test_the_peers_thread_looks_at_unwaited_replies_between_queued_requests(net, monkeypatch):
    # The peer's thread is never idle (a queue of async jobs, each shorter than a look's
    # interval, one after another): its looks are due all the same, and receive the reply.
    monkeypatch.setattr(region_peer, "LOOK_S", 0.02)
    owner, client = net
    receivers, into = _attaching(owner)
    peer = client(1, direct=False)
    posted = peer.post_call_into("bytes", into, n=16 << 20)
    jobs = [peer.submit(lambda: time.sleep(0.005), "busy") for _ in range(200)]  # 1 s or more
    assert _until(posted.poll, 0.8)
    assert not jobs[-1].poll()  # received while jobs were still queued
    assert receivers == [f"gradsync-regions-to{peer.ident}"]
    wait(jobs)


def test_call_if_idle_does_not_ask_while_a_request_is_in_flight(net):
    owner, client = net
    entered, release = _holding(owner)
    peer = client(1, direct=False)
    posted = peer.post_call("hold", x=1)
    assert entered.wait(5)
    start = time.monotonic()
    assert peer.call_if_idle("echo", x=2) is None  # at once: the posted one is watched
    assert time.monotonic() - start < 1
    release.set()
    assert posted.wait() == {"held": 1}
    assert peer.call_if_idle("echo", x=3) == {"peer": 1, "x": 3}


# --- ranks as processes: stripe locks between processes -----------------------------------

class _Refusals:
    """``fcntl`` as the stripes see it, but an event is set whenever the kernel refuses a lock
    with EDEADLK: so the test knows that B has asked for the stripe, and been refused."""

    def __init__(self, refused):
        self.refused = refused

    def __getattr__(self, name):
        return getattr(fcntl, name)

    def lockf(self, *args):
        try:
            return fcntl.lockf(*args)
        except OSError as exc:
            if exc.errno == errno.EDEADLK:
                self.refused.set()
            raise


def _cross_waiter(path, holding, go, refused, results):
    """Process B: holds stripe 1, then asks for stripe 0 while A holds it and waits for 1."""
    faulthandler.dump_traceback_later(20, exit=True)
    region_memory.fcntl = _Refusals(refused)  # B is a forked process: A's module is untouched
    stripes = Stripes(128, os.open(path, os.O_RDWR), stripe=64)
    stripes.acquire(64)
    holding.set()
    go.wait(10)
    try:
        stripes.acquire(0)
        stripes.release(0)
        results.put("ok")
    except OSError as exc:
        results.put(repr(exc))
    stripes.release(64)


def _waits_for_lock(pid: int) -> bool:
    with open("/proc/locks") as f:
        return any("->" in line and f" {pid} " in line for line in f)


@pytest.mark.multiprocess
def test_a_wait_that_only_looks_like_a_deadlock_completes(tmp_path):
    # Thread 1 of A holds stripe 0 and thread 2 of A waits for stripe 1, which B holds; B then
    # asks for stripe 0. The kernel sees A and B wait for each other (EDEADLK), but thread 1
    # lets go of stripe 0 without waiting for anything, so B must simply get it next.
    path = tmp_path / "locks"
    path.write_bytes(bytes(128))
    ctx, fd = mp.get_context("fork"), os.open(path, os.O_RDWR)
    holding, go, refused, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    b = ctx.Process(target=_cross_waiter, args=(str(path), holding, go, refused, results),
                    daemon=True)
    stripes = Stripes(128, fd, stripe=64)
    stripes.acquire(0)
    b.start()
    try:
        assert holding.wait(10)
        waiter = threading.Thread(target=lambda: (stripes.acquire(64), stripes.release(64)),
                                  daemon=True)
        waiter.start()
        assert _until(lambda: _waits_for_lock(os.getpid())), "thread 2 never waited"
        go.set()
        # B has asked for stripe 0: refused as a deadlock (the case under test), or queued
        # behind A where a kernel does not look for deadlocks
        assert _until(lambda: refused.is_set() or _waits_for_lock(b.pid), 10), \
            "B never asked for stripe 0"
        assert results.empty(), "B's request for stripe 0 ended while A still held it"
        stripes.release(0)
        assert results.get(timeout=10) == "ok"
        waiter.join(10)
        assert not waiter.is_alive()
    finally:
        b.join(5)
        if b.is_alive():
            b.kill()
        os.close(fd)


# Accumulating processes, and accumulates each. Without the stripe locks an update is lost only
# where two adds overtake each other inside one stripe: with 50 rounds, 4 to 7 runs in 10 lost
# one; with 200, each of 36 runs lost some (under a second with the locks, on 2 busy cores).
P, R = 3, 200


def _accumulator(ident, direct, port, ready, go, job, n, results, timeout):
    faulthandler.dump_traceback_later(timeout, exit=True)  # a hung worker shows where
    try:
        assert ready.wait(timeout), "the owner never started"
        ep = Endpoint(ident, HOST, SECRET, job, direct=direct, timeout=timeout)
        peer = ep.connect(0, "127.0.0.1", port.value, time.monotonic() + timeout, "owner")
        region = peer.region("sum")
        assert (region.direct is not None) == direct, "direct mapping not as requested"
        mine = np.full(n, ident, np.float64)
        go.wait(timeout)  # all at once, so the accumulates overlap
        for _ in range(R):
            region.accumulate(mine)
        peer.close()
        ep.close()
        results.put((ident, "ok"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((ident, traceback.format_exc()))


@pytest.mark.multiprocess
def test_accumulates_from_processes_lose_no_update(job):
    # fcntl locks belong to a process, so each accumulator is a process of its own: two map
    # the region, one goes over TCP to the owner's serving thread.
    ctx, timeout = mp.get_context("fork"), 30.0
    n = (2 * STRIPE_BYTES + 104) // 8  # 2 MiB and 13 elements: three stripes
    port, ready, go, results = ctx.Value("i", 0), ctx.Event(), ctx.Barrier(P), ctx.Queue()
    workers = {ident: ctx.Process(target=_accumulator, daemon=True, args=(
        ident, ident != P, port, ready, go, job, n, results, timeout)) for ident in range(1, P + 1)}
    for w in workers.values():
        w.start()
    # The owner starts after the fork, so no worker inherits its threads, sockets or fds.
    owner = Endpoint(0, HOST, SECRET, job, expect=set(workers), timeout=timeout)
    try:
        total = owner.allocate("sum", (n,), np.float64)
        port.value = owner.port
        ready.set()
        done, deadline = {}, time.monotonic() + timeout + 3
        while len(done) < P and time.monotonic() < deadline:
            try:
                ident, status = results.get(timeout=0.5)
                done[ident] = status
            except queue.Empty:
                continue
        assert done == {i: "ok" for i in workers}, f"workers did not all finish: {done}"
        expected = R * sum(workers)
        wrong = np.flatnonzero(total != expected)
        assert wrong.size == 0, (f"{wrong.size} of {n} elements lost updates: element "
                                 f"{wrong[0]} is {total[wrong[0]]}, expected {expected}")
    finally:
        for w in workers.values():
            w.join(timeout=2)
            if w.is_alive():
                w.kill()
                w.join()
        owner.close()
