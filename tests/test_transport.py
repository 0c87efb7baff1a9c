"""Frames and the TCP transport, in one process: handshake, authentication, hostile input."""

import select
import socket
import threading
import time

import numpy as np
import pytest

from gradsync.errors import (AuthenticationError, CollectiveMismatchError, PeerLostError,
                             ProtocolError)
from gradsync.transport import frame
from gradsync.transport.comm import Comm
from gradsync.transport.tcp import Listener, TcpPair, connect

SECRET = b"s" * 32


def test_frame_round_trip_and_validation():
    raw = frame.pack(frame.Kind.DATA, 7, 2, 0xABC, 100)
    h = frame.unpack(raw)
    assert (h.kind, h.seq, h.step, h.signature, h.length) == (1, 7, 2, 0xABC, 100)
    with pytest.raises(ProtocolError, match="magic"):
        frame.unpack(b"XXXX" + raw[4:])
    with pytest.raises(ProtocolError, match="version"):
        frame.unpack(raw[:4] + b"\x09" + raw[5:])
    with pytest.raises(ProtocolError, match="kind"):
        frame.unpack(raw[:5] + b"\x63" + raw[6:])
    assert frame.signature_of("a") == frame.signature_of("a") != frame.signature_of("b")


@pytest.fixture
def pair_of_comms():
    listener = Listener("127.0.0.1", 0, SECRET, "job", {1})
    s1 = connect("127.0.0.1", listener.port, 1, 0, SECRET, "job", time.monotonic() + 5)
    s0 = listener.wait_for({1}, time.monotonic() + 5)[1]
    comms = [Comm(0, 2, {1: TcpPair(1, s0)}, 5.0), Comm(1, 2, {0: TcpPair(0, s1)}, 5.0)]
    yield listener, comms
    for c in comms:
        c.close()
    listener.close()


def _both(comms, fn):
    errors = [None, None]

    def run(i):
        try:
            fn(comms[i])
        except BaseException as exc:  # collected for the assertion below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "exchange hung"
    return errors


@pytest.mark.parametrize("count", [0, 1, 1000, 3 << 20])
def test_exchange_streams_into_the_destination(pair_of_comms, count):
    _, comms = pair_of_comms
    got = [np.empty(count, np.float32), np.empty(count, np.float32)]

    def fn(c):
        c.begin("x")
        c.exchange([(1 - c.rank, np.full(count, c.rank + 1, np.float32))], [(1 - c.rank, got[c.rank])])

    assert _both(comms, fn) == [None, None]
    assert (got[0] == 2).all() and (got[1] == 1).all()


def test_a_payload_on_its_way_wakes_its_wait_only_for_a_useful_amount():
    """A slow link brings a payload a packet at a time: the wait must not wake for each (it
    did, 1,400 times a step per rank at 25 Mbit/s, 3x gloo's CPU time). Inside a payload the
    socket's low-water mark is the payload's rest, capped (``_WAKE_BYTES``); between frames,
    1 byte, so that a header or an ACK still wakes it."""
    from gradsync.transport import tcp
    from gradsync.transport.base import Expect, Recv

    listener = Listener("127.0.0.1", 0, SECRET, "job", {1})
    raw = connect("127.0.0.1", listener.port, 1, 0, SECRET, "job", time.monotonic() + 5)
    pair = TcpPair(1, listener.wait_for({1}, time.monotonic() + 5)[1])
    lowat = lambda: pair.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)  # noqa: E731
    try:
        for size, sent_first in ((1 << 20, 1000), (5000, 1000)):
            payload = np.arange(size, dtype=np.uint8)
            into = np.zeros(size, np.uint8)
            op = Recv(pair, Expect(3, 0, 7, lambda: "x", size), memoryview(into))
            raw.sendall(frame.pack(frame.Kind.DATA, 3, 0, 7, size) + payload[:sent_first].tobytes())
            deadline = time.monotonic() + 5
            while op.offset < sent_first:  # until all that was sent has been taken in
                assert not op.advance() and time.monotonic() < deadline
                select.select([pair.fileno], [], [], 0.01)
            assert lowat() == min(size - sent_first, tcp._WAKE_BYTES)
            # Not readable below the mark: the wait sleeps through the next packet.
            raw.sendall(payload[sent_first:sent_first + 100].tobytes())
            assert select.select([pair.fileno], [], [], 0.05)[0] == []
            raw.sendall(payload[sent_first + 100:].tobytes())
            assert select.select([pair.fileno], [], [], 5)[0] == [pair.fileno]
            deadline = time.monotonic() + 5
            while not op.advance():
                assert time.monotonic() < deadline
            assert (into == payload).all() and lowat() == 1
    finally:
        pair.close()
        raw.close()
        listener.close()


def test_several_frames_to_one_peer_in_one_exchange_keep_their_order(pair_of_comms):
    # The ring's allreduce posts a reduce-scatter and an allgather segment each way in one
    # exchange. Each frame must land in its own buffer, in posting order, even when the first
    # is larger than the socket buffers (so the second is posted while the first is under way).
    _, comms = pair_of_comms
    sizes = [(12 << 20) + 5, 0, 300, 1]
    got = [[np.empty(k, np.uint8) for k in sizes] for _ in range(2)]

    def sent(rank, i):
        return ((np.arange(sizes[i]) * 7 + 31 * i + rank) % 251).astype(np.uint8)

    def fn(c):
        c.begin("several")
        peer = 1 - c.rank
        c.exchange([(peer, sent(c.rank, i)) for i in range(len(sizes))],
                   [(peer, buf) for buf in got[c.rank]])

    assert _both(comms, fn) == [None, None]
    for rank in range(2):
        for i, buf in enumerate(got[rank]):
            np.testing.assert_array_equal(buf, sent(1 - rank, i), err_msg=f"frame {i}")


def test_different_collectives_are_caught_at_the_first_frame(pair_of_comms):
    _, comms = pair_of_comms

    def fn(c):
        c.begin(f"allreduce float32[{10 + c.rank}]")
        c.exchange([(1 - c.rank, np.zeros(4))], [(1 - c.rank, np.zeros(4))])

    errors = _both(comms, fn)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors


def test_a_pair_peeks_at_a_whole_header_without_taking_it(pair_of_comms):
    _, comms = pair_of_comms
    a, b = comms[0].pairs[1], comms[1].pairs[0]
    assert b.peek_header() is None  # nothing sent
    header = frame.pack(frame.Kind.DATA, 4, 0, 9, 3)

    def arrived(nbytes):  # until the socket holds ``nbytes`` (loopback: at once, in practice)
        deadline = time.monotonic() + 5
        while True:
            select.select([b.sock], [], [], 0.1)
            try:
                if len(b.sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= nbytes:
                    return
            except BlockingIOError:
                pass
            assert time.monotonic() < deadline, f"{nbytes} bytes never arrived"

    a.sock.sendall(header[:10])
    arrived(10)
    assert b.peek_header() is None  # half a header
    a.sock.sendall(header[10:] + b"xyz")
    arrived(len(header) + 3)
    for _ in range(2):  # looking twice sees the same, and takes nothing
        h = b.peek_header()
        assert (h.kind, h.seq, h.signature, h.length) == (frame.Kind.DATA, 4, 9, 3)
    comms[1].seq = 3
    comms[1].begin_signed("the peeked collective", 9)  # collective #4
    out = np.zeros(3, np.uint8)
    comms[1].exchange(recvs=[(0, out)])
    assert out.tobytes() == b"xyz" and b.peek_header() is None


def test_closed_peer_is_a_lost_peer(pair_of_comms):
    _, comms = pair_of_comms
    comms[1].close()
    comms[0].begin("x")
    with pytest.raises(PeerLostError, match="rank 1") as info:
        comms[0].exchange([], [(1, np.zeros(4))])
    assert info.value.peer == 1


def test_wrong_secret_is_refused_and_the_listener_survives():
    listener = Listener("127.0.0.1", 0, SECRET, "job", {1, 2})
    with pytest.raises(AuthenticationError, match="GRADSYNC_SECRET"):
        connect("127.0.0.1", listener.port, 1, 0, b"w" * 32, "job", time.monotonic() + 5)
    with pytest.raises(AuthenticationError):  # right secret, another job
        connect("127.0.0.1", listener.port, 1, 0, SECRET, "other-job", time.monotonic() + 5)
    connect("127.0.0.1", listener.port, 2, 0, SECRET, "job", time.monotonic() + 5)
    assert listener.wait_for({2}, time.monotonic() + 5)
    assert listener.rejected == 2
    listener.close()


@pytest.mark.parametrize("payload", [
    b"\x16\x03\x01 hello tls" * 10,
    frame.pack(frame.Kind.PROOF, 0, 0, 0, 1 << 40),
    frame.pack(frame.Kind.PROOF, 0, 0, 0, 80)[:17],
    frame.pack(frame.Kind.DATA, 0, 0, 0, 8) + b"\0" * 8,
], ids=["not-gradsync", "absurd-length", "truncated", "data-before-handshake"])
def test_garbage_is_dropped_and_logged(payload, caplog):
    listener = Listener("127.0.0.1", 0, SECRET, "job", {1})
    with socket.create_connection(("127.0.0.1", listener.port)) as s:
        s.settimeout(5)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError:  # reset, or already disconnected (ENOTCONN): dropped before EOF
            pass
    deadline = time.monotonic() + 5
    while listener.rejected == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.rejected == 1
    assert "dropped a connection" in caplog.text
    # the rank still accepts its real peer
    connect("127.0.0.1", listener.port, 1, 0, SECRET, "job", time.monotonic() + 5)
    assert listener.wait_for({1}, time.monotonic() + 5)
    listener.close()


def test_silent_connection_does_not_block_others(monkeypatch):
    from gradsync.transport import tcp

    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT", 0.5)
    listener = Listener("127.0.0.1", 0, SECRET, "job", {1})
    silent = socket.create_connection(("127.0.0.1", listener.port))
    connect("127.0.0.1", listener.port, 1, 0, SECRET, "job", time.monotonic() + 5)
    assert listener.wait_for({1}, time.monotonic() + 5)
    deadline = time.monotonic() + 5
    while listener.rejected == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.rejected == 1  # timed out and dropped
    silent.close()
    listener.close()
