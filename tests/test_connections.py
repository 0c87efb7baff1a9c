"""Connections on demand, the O(N) rendezvous and the one listener per process.

Two kinds of tests. In-process ones drive ``tcp.Listener``, ``tcp.Route`` and lazy
``TcpPair``s directly, one thread per rank, and force the interleavings that matter (both ends
dialing at once, in either order) deterministically. Multi-process ones start real ranks, each
on a host of its own (``GRADSYNC_HOSTNAME``, which tests/ranks/connections.py sets), so that
every pair is a TCP pair, and count from inside the ranks what they hold (/proc/self/fd) and
what they asked of the store (``rendezvous.request_counts``). tests/ranks/connections.py is the
rank side. The default tier's jobs of 4 and 3 ranks start their ranks as torchrun does,
forked from one process that imported torch once (``forked_jobs.spawn``); the slow tier's
jobs of 2 to 16 ranks fork them from one process that has imported torch
(``scale_jobs.forked``: what is counted is the same, the interpreters' start-up shared), and
the 64 ranks' count is the first entry of the 64-rank job that test_scale.py's checks share
(``scale_jobs.sixty_four``).
"""

import collections
import functools
import json
import math
import re
import socket
import threading
import time

import numpy as np
import pytest

from gradsync.errors import AuthenticationError, GradsyncError, PeerLostError
from gradsync.transport import frame, tcp
from gradsync.transport.comm import Comm
import loopback
from forked_jobs import spawn
from harness import run_ranks
from scale_jobs import entry_logs, forked, ran, sixty_four

SECRET = b"s" * 32


# ----------------------------------------------------------------------------- in process
class Rank:
    """One rank of an in-process job: a listener, its route, lazy pairs to the others."""

    def __init__(self, rank: int, size: int, secret: bytes = SECRET, job: str = "job"):
        self.rank, self.size, self.secret, self.job = rank, size, secret, job
        self.listener = tcp.Listener("127.0.0.1", rank, secret, None)
        self.route = self.listener.route(job, rank, set(range(size)) - {rank})
        self.hold = {}  # peer -> threading.Event the dial waits on first (to force orders)
        # peer -> threading.Event set once a held dial is waiting: the route has marked the
        # pair as dialing (``Route.open`` does before it dials), so a test knows the order
        # it forces is in place without sleeping for it.
        self.held = collections.defaultdict(threading.Event)

    def dial(self, peer: "Rank") -> "socket.socket | None":
        event = self.hold.get(peer.rank)
        if event is not None:
            self.held[peer.rank].set()
            assert event.wait(10)
        return tcp.connect("127.0.0.1", peer.listener.port, self.rank, peer.rank, self.secret,
                           self.job, time.monotonic() + 10, crossing=True)

    def open(self, peer: "Rank") -> "socket.socket | None":
        return self.route.open(peer.rank, lambda: self.dial(peer))

    def comm(self, ranks: "list[Rank]") -> Comm:
        pairs = {p.rank: tcp.TcpPair(p.rank, None, opener=lambda p=p: self.open(p))
                 for p in ranks if p is not self}
        return Comm(self.rank, self.size, pairs, 10.0)

    def close(self) -> None:
        self.listener.close()


def _until(condition, what: str, timeout: float = 10.0) -> None:
    """Waits until ``condition()`` holds; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.005)


@pytest.fixture
def job():
    made = []

    def make(size, **kw):
        made.extend(Rank(r, size, **kw) for r in range(size))
        return made[-size:]

    yield make
    for r in made:
        r.close()


def test_a_pair_holds_no_socket_until_first_used(job):
    ranks = job(3)
    comms = [r.comm(ranks) for r in ranks]
    assert not any(p.connected for c in comms for p in c.pairs.values())
    assert all(p.is_socket and p.fileno == -1 for c in comms for p in c.pairs.values())

    def ring(c):
        right, left = (c.rank + 1) % 3, (c.rank - 1) % 3
        got = np.empty(4)
        c.begin("ring step")
        c.exchange(sends=[(right, np.full(4, float(c.rank)))], recvs=[(left, got)])
        return got[0]

    comms_pairs = [dict(c.pairs) for c in comms]
    assert run_ranks(comms, ring) == [2.0, 0.0, 1.0]
    for r in range(3):
        for p, pair in comms_pairs[r].items():
            assert pair.connected or p not in ((r + 1) % 3, (r - 1) % 3)


@pytest.mark.parametrize("first", ["send", "receive"])
def test_first_use_by_one_end_only(job, first):
    # One end's first use is a receive (or a send) while the other has not touched the pair:
    # whichever end it is, it dials, and the other's later use takes that connection.
    for lower_first in (True, False):
        ranks = job(2)
        comms = [r.comm(ranks) for r in ranks]
        early = 0 if lower_first else 1
        buf = np.empty(8)

        def use(c):
            if c.rank != early:
                # Only once the early end's connection has reached this end's listener:
                # this end then takes it, and never dials.
                _until(lambda: isinstance(ranks[c.rank].route.slots.get(early),
                                          socket.socket), "the early end's connection")
            c.begin("one way")
            sends = (c.rank == early) == (first == "send")
            if sends:
                c.exchange(sends=[(1 - c.rank, np.full(8, 7.0))])
            else:
                c.exchange(recvs=[(1 - c.rank, buf)])

        run_ranks(comms, use)
        assert buf[0] == 7.0
        assert ranks[0].listener.busy + ranks[1].listener.busy == 0


def test_both_ends_sending_first_do_not_wait_for_each_other(job):
    # Sends that complete before either end posts a receive (the point-to-point pattern
    # send-then-receive on both sides): a scheme where one end only waits would deadlock.
    ranks = job(2)
    comms = [r.comm(ranks) for r in ranks]
    start = threading.Barrier(2)
    got = [np.empty(16), np.empty(16)]

    def swap(c):
        c.begin("swap")
        start.wait()
        c.exchange(sends=[(1 - c.rank, np.full(16, float(c.rank)))])
        c.exchange(recvs=[(1 - c.rank, got[c.rank])])

    run_ranks(comms, swap)
    assert got[0][0] == 1.0 and got[1][0] == 0.0


def test_simultaneous_first_use_makes_one_connection_per_pair(job):
    # Many pairs used for the first time at the same instant from both ends: each ends with
    # exactly one connection (the same one at both ends), whatever the interleaving.
    n = 4
    for _ in range(5):
        ranks = job(n)
        comms = [r.comm(ranks) for r in ranks]
        start = threading.Barrier(n)

        def everyone(c):
            got = [np.empty(4) for _ in range(n)]
            c.begin("all to all")
            start.wait()
            peers = [p for p in range(n) if p != c.rank]
            c.exchange(sends=[(p, np.full(4, float(c.rank))) for p in peers],
                       recvs=[(p, got[p]) for p in peers])
            ends = {p: (c.pairs[p].sock.getsockname(), c.pairs[p].sock.getpeername())
                    for p in peers}
            return [got[p][0] for p in peers], ends

        results = run_ranks(comms, everyone)
        for r, (row, _) in enumerate(results):
            assert row == [float(p) for p in range(n) if p != r]
        for a in range(n):
            for b in range(a + 1, n):  # a's end of the pair is the far end of b's
                assert results[a][1][b][0] == results[b][1][a][1], (a, b)


def test_crossing_dials_keep_the_higher_ranks_connection(job):
    # Order 1: the lower rank is dialing (held before it connects) when the higher rank's
    # dial arrives: its listener welcomes the higher's; then the lower's own dial is
    # answered busy and it takes the higher's connection.
    low, high = job(2)
    low.hold[1] = threading.Event()
    taken = {}
    t = threading.Thread(target=lambda: taken.setdefault("low", low.open(high)))
    t.start()
    assert low.held[1].wait(10)  # the lower rank is dialing
    taken["high"] = high.open(low)
    low.hold[1].set()
    t.join(10)
    assert taken["low"] is not None and taken["high"] is not None
    assert taken["low"].getsockname() == taken["high"].getpeername()
    assert high.listener.busy == 1 and low.listener.busy == 0

    # Order 2: the higher rank is dialing (held) when the lower's dial arrives: the higher's
    # listener answers busy, the lower waits without blocking, then takes the higher's.
    low, high = job(2)
    high.hold[0] = threading.Event()
    t = threading.Thread(target=lambda: taken.__setitem__("high", high.open(low)))
    t.start()
    assert high.held[0].wait(10)  # the higher rank is dialing
    assert low.open(high) is None  # busy: the higher rank's connection is on its way
    assert low.open(high) is None  # still waiting: does not dial again
    high.hold[0].set()
    t.join(10)
    deadline = time.monotonic() + 5
    while (sock := low.open(high)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sock.getsockname() == taken["high"].getpeername()
    assert high.listener.busy == 1


def test_a_peer_that_is_gone_is_a_lost_peer_not_a_timeout(job):
    low, high = job(2)
    low.close()  # the peer exited: its port refuses connections
    start = time.monotonic()
    with pytest.raises(PeerLostError) as err:
        high.open(low)
    assert err.value.peer == 0
    assert time.monotonic() - start < tcp.REFUSED_GRACE + 2


def test_a_peer_lost_after_answering_busy_is_a_lost_peer(job):
    # The higher rank answers the lower one busy (it is dialing), then dies before its own
    # connection arrives: the lower rank, waiting, dials again after a while and finds it gone.
    low, high = job(2)
    high.hold[0] = threading.Event()

    def dead_dial():
        try:
            high.open(low)
        except GradsyncError:
            pass  # a dead rank's dial: whatever it meets does not matter

    t = threading.Thread(target=dead_dial, daemon=True)
    t.start()
    assert high.held[0].wait(10)  # the higher rank is dialing
    assert low.open(high) is None  # busy
    high.listener.close()
    start = time.monotonic()
    with pytest.raises(PeerLostError) as err:
        while low.open(high) is None:
            assert time.monotonic() - start < 30, "still waiting for a rank that is gone"
            time.sleep(0.01)
    assert err.value.peer == 1
    assert time.monotonic() - start < tcp.BUSY_RECHECK + tcp.REFUSED_GRACE + 2
    high.hold[0].set()
    t.join(15)


def test_a_peer_lost_during_the_handshake_is_a_lost_peer():
    # A "peer" that accepts, says HELLO, then dies mid-handshake.
    server = socket.create_server(("127.0.0.1", 0))

    def die():
        sock, _ = server.accept()
        tcp._send_frame(sock, frame.Kind.HELLO, b"n" * 32)
        sock.recv(4096)
        sock.close()

    threading.Thread(target=die, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="handshake with rank 0"):
        tcp.connect("127.0.0.1", server.getsockname()[1], 1, 0, SECRET, "job",
                    time.monotonic() + 30, crossing=True)
    assert time.monotonic() - start < 5
    server.close()


class SlowListener(tcp.Listener):
    """A listener whose handshake threads start a second late (a busy or swapped-out host)."""

    def _handshake(self, sock, address):
        time.sleep(1.0)
        super()._handshake(sock, address)


def test_a_slow_peer_is_waited_for():
    slow = SlowListener("127.0.0.1", 0, SECRET, "job", {1})
    try:
        start = time.monotonic()
        sock = tcp.connect("127.0.0.1", slow.port, 1, 0, SECRET, "job",
                           time.monotonic() + 30, crossing=True)
        assert sock is not None and time.monotonic() - start >= 0.9
        assert slow.first.open(1, lambda: None) is not None  # the peer's end has it too
        sock.close()
    finally:
        slow.close()


def test_wrong_secret_is_refused_and_the_job_goes_on(job):
    low, high = job(2)
    intruder = Rank(1, 2, secret=b"x" * 32)
    try:
        with pytest.raises(AuthenticationError):
            intruder.open(low)
    finally:
        intruder.close()
    assert low.listener.rejected == 1
    # The real rank 1 still connects: the intruder took no slot.
    comms = [r.comm([low, high]) for r in (low, high)]
    got = np.empty(2)

    def one_way(c):
        c.begin("after the intruder")
        if c.rank:
            c.exchange(sends=[(0, np.full(2, 5.0))])
        else:
            c.exchange(recvs=[(1, got)])

    run_ranks(comms, one_way)
    assert got[0] == 5.0


def test_garbage_on_the_port_is_dropped(job):
    low, high = job(2)
    with socket.create_connection(("127.0.0.1", low.listener.port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while s.recv(4096):
            pass
    deadline = time.monotonic() + 5
    while low.listener.rejected < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert high.open(low) is not None


def test_routes_share_a_listener_and_keep_their_jobs_apart(job):
    # Two Worlds of one process (a job and its sub-world) on one listener: a connection
    # proven for the sub-world's job lands on its route; one for a job with no route (an
    # older elastic generation, say) is dropped, as is one after the route closed.
    low, high = job(2, job="gen1")
    sub_low = low.listener.route("gen1/sub", 0, {1})
    sub_high = Rank.__new__(Rank)
    sub_high.__dict__.update(high.__dict__, job="gen1/sub", hold={})
    sub_high.route = high.listener.route("gen1/sub", 1, {0})
    sock = sub_low.open(1, lambda: sub_high.dial(low))
    assert sock is not None and 1 in sub_low.slots and 1 not in low.route.slots
    stale = Rank.__new__(Rank)
    stale.__dict__.update(high.__dict__, job="gen0", hold={})
    with pytest.raises(AuthenticationError):
        stale.dial(low)
    sub_low.close()
    with pytest.raises(AuthenticationError):
        sub_high.dial(low)
    assert low.listener.rejected == 2
    assert high.open(low) is not None  # the job's own route is untouched


@pytest.mark.parametrize("n", [2, 8, 32])
def test_the_address_table_costs_a_few_requests_per_rank(n):
    # n ranks as threads, each with its own client of one store: the table costs 3 requests
    # per rank and one more (the last arrival's), where every rank reading every entry
    # would cost n per rank.
    from gradsync.cluster import rendezvous

    server = loopback.store(30)  # no DNS wait for each client (tests/loopback.py)
    stores = [rendezvous.Store.over(server.clone(), f"table{n}", 30) for _ in range(n)]
    before = sum(rendezvous.request_counts().values())
    tables = [None] * n

    def rank(r):
        tables[r] = stores[r].gather_table("peers", r, n, f"entry {r}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert tables == [[f"entry {r}" for r in range(n)]] * n
    assert sum(rendezvous.request_counts().values()) - before == 3 * n + 1


def _world_entry(rank: int, per_host: int, rng) -> str:
    """An address-table entry as ``World._connect`` writes it: host, address, port, pid."""
    host = rank // per_host
    return json.dumps([f"node{host:05d}", f"10.0.{host // 256}.{host % 256}",
                       rng.randint(32768, 60999), rng.randint(1000, 4_000_000)],
                      separators=(",", ":"))


def _table_bytes(clients, n: int, per_host: int) -> int:
    """The bytes the store serves to ``get`` for one address table of ``n`` ranks (threads,
    each with one of ``clients``), counted by ``rendezvous.served_bytes``: the table, read by
    each rank but 0, and rank 0's one-byte flag (not its ``multi_get`` of the n entries,
    40·n bytes). Asserts the table every rank read back too."""
    import random

    from gradsync.cluster import rendezvous

    rng = random.Random(n)
    entries = [_world_entry(r, per_host, rng) for r in range(n)]
    stores = [rendezvous.Store.over(client, f"bytes{n}.{per_host}", 30)
              for client in clients[:n]]
    tables = [None] * n
    before = rendezvous.served_bytes().get("get", 0)

    def rank(r):
        tables[r] = stores[r].gather_table("peers", r, n, entries[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert tables == [entries] * n
    return rendezvous.served_bytes().get("get", 0) - before


def test_the_address_table_is_served_compressed():
    # Every rank reads the whole table, so the store serves c·N(N - 1) bytes: c was about 40
    # (the entries' text), and is about 13 (one rank per host) or 10 (8 per host) compressed.
    # The growth stays quadratic (docs/scale.md): doubling N about quadruples the bytes.
    server = loopback.store(30)  # no DNS wait for each client (tests/loopback.py)
    clients = [server.clone() for _ in range(32)]  # made once, for every table below
    for per_host, bound in ((1, 15), (8, 12)):
        served = {n: _table_bytes(clients, n, per_host) for n in (16, 32)}
        for n, total in served.items():
            assert total <= bound * n * (n - 1), (per_host, n, total)
        assert 3 <= served[32] / served[16] <= 5, (per_host, served)  # quadratic


# -------------------------------------------------------------------------- multi-process
def _results(outputs: dict, mode: str, status=lambda rank: None) -> dict:
    """Each rank's RESULT object of ``mode`` (tests/ranks/connections.py), from each rank's
    output (``outputs``: rank -> text); ``status(rank)`` its exit status, for the message."""
    out = {}
    for rank, text in outputs.items():
        found = [json.loads(m) for m in re.findall(r"RESULT rank=\d+ (.*)", text)]
        found = [g for g in found if g["mode"] == mode]
        assert found, f"rank {rank}: no {mode} result, exit {status(rank)}\n{text[-3000:]}"
        out[rank] = found[0]
    return out


def _spawned(ranks) -> dict:
    return {r.rank: r.output for r in ranks}


def _sockets_job(n: int, timeout: float, env: "dict | None" = None) -> dict:
    job = forked(n, 1, "connections.py", "sockets", timeout=timeout, env=env)
    return _results(job.logs, "sockets", job.status)


@functools.lru_cache(maxsize=None)
def _four_ranks():
    """One job of 4 ranks for the sockets' count, then the first uses' patterns in a fresh
    ``init()`` (the sockets first: nothing before them to count): one start-up for both
    tests. Run once per pytest process."""
    return spawn(4, "connections.py", "sockets,patterns", timeout=90, lean=True)


def _check_sockets(n: int, got: dict) -> None:
    bound = 2 * int(math.log2(n)) + 4  # the issue's: store clients and listener included
    for r, g in got.items():
        # The ring: its two neighbours, nothing else.
        assert len(g["ring"]["tcp"]) == 2, (r, g)
        assert g["ring"]["sockets"] <= bound + 1, (r, g)  # (+1: as below)
        # Recursive doubling adds its log2 N partners (some may be ring neighbours already).
        partners = {r ^ (1 << k) for k in range(int(math.log2(n)))}
        assert partners <= set(g["doubling"]["tcp"]), (r, g)
        assert set(g["doubling"]["tcp"]) <= partners | set(g["ring"]["tcp"]), (r, g)
        # (+1: the heartbeat's listener, open until rank - 1 has linked, or a crossed dial
        # still closing: both transient, counted below.)
        assert g["doubling"]["sockets"] <= bound + 1, (r, g)
        # Exactly: store client + the abort watch's store client + listener + the TCP pairs
        # + the heartbeat's links to its ring neighbours (heartbeat.py).
        links = len({(r - 1) % n, (r + 1) % n} - {r})
        # (A dial that crossed another may still be closing when counted, or the heartbeat's
        # listener still open: one more at most. One fewer: the abort watch's store client or
        # a heartbeat link, each made by a thread of its own, not up yet on a loaded machine.)
        expected = 3 + len(g["doubling"]["tcp"]) + links
        assert expected - 1 <= g["doubling"]["sockets"] <= expected + 1, (r, g)
        # A sub-world adds its own TCP pairs (and its heartbeat's store client), no listener.
        sub = g["subworld"]
        assert sub["shares_listener"], (r, g)
        assert len(sub["tcp"]) == 2, (r, g)
        # ... and its abort watch's store client (abort_watch.py): no listener, no links.
        # (made by the watch's thread, so it may not be there yet when counted).
        # Counted from the parent's whole set: a socket of the parent's threads that was not
        # up at the parent's count (one fewer, above) is there by the sub-world's, and is not
        # the sub-world's (a busy machine's run counted 7 then 11 sockets on rank 0: 8 + 3).
        extra = sub["sockets"] - max(g["doubling"]["sockets"], expected)
        # (A dial that crossed another may still be open when the parent's count is taken.)
        assert extra <= 2 + sub["heartbeat"], (r, g)


def _init_requests(got: dict) -> dict:
    return {r: sum(g["init"].values()) for r, g in got.items()}


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow),
                               pytest.param(16, marks=pytest.mark.slow),
                               pytest.param(64, marks=[pytest.mark.slow, pytest.mark.alone])])
def test_sockets_per_rank_after_allreduces(n):
    if n == 4:
        got = _results(_spawned(_four_ranks()), "sockets")
    elif n == 64:  # the first entry of the 64-rank job that test_scale.py's checks share
        job = sixty_four()
        assert ran(job, "connections.py:sockets"), job
        got = _results(entry_logs(job, "connections.py:sockets"), "sockets", job.status)
    else:
        got = _sockets_job(n, timeout=60 + 3 * n)
    _check_sockets(n, got)
    # No rank reads the address table key by key: at most the secret, the table and the
    # barrier's key (rank 0: the entries' arrival instead of the table, and one multi_get),
    # where the old rendezvous read N + 2 keys per rank.
    for r, g in got.items():
        # (+2: the heartbeat's reads of its neighbours' link addresses, when its thread is
        # still at it as init() returns.)
        assert g["init"].get("get", 0) <= 5 and g["init"].get("multi_get", 0) <= (r == 0), g


@pytest.mark.slow
def test_store_requests_for_init_grow_linearly():
    # Without heartbeats, whose beats would add requests by the second, the counts are exact.
    quiet = {"GRADSYNC_HEARTBEAT_TIMEOUT": "0"}
    totals = {}
    for n in (2, 4, 8):
        totals[n] = sum(_init_requests(_sockets_job(n, timeout=90, env=quiet)).values())
    # Linear, a·N + b (6N + 3 here): equal steps per rank added, and a small a. The old
    # rendezvous, N(N + 4) + 3, steps 10 per rank added from 2 to 4 ranks, 16 from 4 to 8.
    slope_low, slope_high = (totals[4] - totals[2]) / 2, (totals[8] - totals[4]) / 4
    assert abs(slope_high - slope_low) <= 0.5, totals
    assert slope_high <= 8, totals


def test_first_uses_that_send_only_or_receive_only():
    got = _results(_spawned(_four_ranks()), "patterns")  # after the sockets' count, own init()
    for r, g in got.items():
        assert g["tcp"] == sorted({r ^ 1, r ^ 2}), got


def test_a_rank_killed_before_its_pairs_connect_is_a_lost_peer():
    ranks = spawn(3, "connections.py", "killed", "1", timeout=60, lean=True)
    assert ranks[1].returncode == -9
    for r, g in _results(_spawned([ranks[0], ranks[2]]), "killed").items():
        assert g["error"].startswith("PeerLostError") and "rank 1" in g["error"], g
        assert g["elapsed"] < 5, g
