"""A worker's epoch (``loader._Epoch``) against real data servers in this process: the two roads.

On one host the training loop's own ``next()`` polls the slot tables (no fetch thread) and,
with ``Loader(copy=False)``, lends the loop the slot itself until the next batch; over TCP
the worker asks each server for its next items while it uses the current one, and the bytes
ride on the ``take``'s reply: taken by the loop's own ``next()`` when a window of batches is
small (``INLINE_REPLY_BYTES``; these tests' batches are), else by a fetch thread
(``thread=True`` forces it here). The ``Loader`` here is wired by hand to the ``server``
fixture's connections (``_loader``): its epochs, plan and loss handling are the real code;
only ``Loader(...)``'s job set-up (the store, ``init()``) is skipped.
"""

import collections
import threading

import numpy as np
import pytest

from gradsync.data import plan as P
from gradsync.data.layout import Layout
from gradsync.data.loader import Loader
from gradsync.data.slots import poller
from gradsync.errors import PeerLostError
from gradsync.transport import regions
from gradsync.transport import rma_frame as rf
from gradsync.transport.regions import Attached

from test_data import Numbers, _hello, _wait_for, server  # noqa: F401 (fixture)

SAMPLES, BATCH = 40, 4


def _loader(peers: list, reply: dict, prefetch=2, copy=True, poll=True, window=1,
            takes=1, thread=False) -> Loader:
    """Worker 0 of 1, connected to the data servers of ``peers`` (its peer of each, after the
    hello whose ``reply`` describes the batches), as ``Loader.__init__`` would leave it
    (``thread``: over TCP, a fetch thread whatever the batches' size)."""
    loader = Loader.__new__(Loader)
    if thread:
        loader.inline_reply_bytes = 0
    loader.samples, loader.batch_size, loader.seed = SAMPLES, BATCH, 1
    loader.order, loader.collate, loader.copy = "servers", None, copy
    loader.prefetch, loader.window, loader.takes = prefetch, window, takes
    loader.rank, loader.workers, loader.servers = 0, 1, len(peers)
    loader.elastic, loader.generation, loader.epoch = False, 0, 0
    loader._resume, loader._active, loader._finished = {}, None, None
    loader._seq = [0] * len(peers)
    loader.lost = set()
    loader._transfers = collections.deque(maxlen=100)
    loader._closed, loader._timeout = False, 20.0
    loader._lost_lock = threading.Lock()
    loader._silence = loader._take_wait = loader._watch = None
    loader.peers = peers
    loader.slots = [p.region("slots.0") for p in peers]
    loader.pollers = [poller(p, 0, prefetch, BATCH, reply["slot_bytes"]) if poll else None
                      for p in peers]
    loader.spec, loader.slot_bytes = reply["layout"], reply["slot_bytes"]
    loader.layout = Layout(reply["layout"])
    return loader


def _planned(servers, epoch=0):
    return [b.ids.tolist() for b in P.worker_batches(P.plan(SAMPLES, BATCH, 1, epoch, servers,
                                                            1), 0)]


def test_on_one_host_the_loop_polls_itself_and_a_borrowed_batch_is_the_slot_until_the_next(
        server):
    srv, peers = server(Numbers(SAMPLES), workers=1)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=2), copy=False)
    slots = loader.pollers[0].slots
    low, high = slots.ctypes.data, slots.ctypes.data + slots.nbytes
    batches = iter(loader)
    assert batches._thread is None  # no fetch thread between the servers and the loop
    got = []
    for k, (x, ids) in enumerate(batches):
        # The tensors view the stream's slot: nothing was copied on the worker ...
        assert low <= x.data_ptr() < high and low <= ids.data_ptr() < high
        # ... and the slot stays the worker's (unacked) while the loop holds the batch.
        assert loader.pollers[0].table.acked() == k
        assert srv.streams[0].released <= k
        got.append(ids.tolist())
    assert got == _planned(1)
    assert loader.pollers[0].table.acked() == len(got)  # the last released at the epoch's end


def test_a_copied_batch_polled_by_the_loop_is_its_own_buffer(server):
    srv, peers = server(Numbers(SAMPLES), workers=1)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=2))
    slots = loader.pollers[0].slots
    batches = iter(loader)
    assert batches._thread is None
    x, ids = next(batches)
    assert not slots.ctypes.data <= x.data_ptr() < slots.ctypes.data + slots.nbytes
    assert loader.pollers[0].table.acked() == 1  # read, so released at once
    assert [ids.tolist()] + [i.tolist() for _, i in batches] == _planned(1)


def test_over_tcp_the_next_take_is_asked_while_the_batch_in_hand_is_read(server):
    # The fetch thread, prefetch 1 (the worker's queue holds one batch): the loop holds batch
    # 0, the queue batch 1, the fetch thread batch 2 (waiting to queue it). Without asking
    # ahead the server has been asked for items 0-2; asking ahead, for item 3 too (which
    # releases 2).
    srv, peers = server(Numbers(SAMPLES), workers=1, direct=False)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=2), prefetch=1,
                     thread=True)
    assert loader.slots[0].direct is None and loader.pollers[0] is None  # the TCP road
    batches = iter(loader)
    assert batches._thread is not None
    x, ids = next(batches)
    assert _wait_for(lambda: srv.streams[0].released == 3)
    got = [ids.tolist()] + [i.tolist() for _, i in batches]
    assert got == _planned(1)
    stats = peers[0].call("stats")
    # Every batch crossed the connection once, on its take's reply (no READ after it).
    assert stats["takes"] == stats["sent"] == len(got)


def test_over_tcp_small_batches_are_taken_by_the_loop_with_the_next_take_in_flight(server):
    # No fetch thread: the loop's own next() receives each reply, and before it returns a
    # batch the take for the server's next items is on the connection (sent as the reply
    # came in), so their round trip runs while the loop uses the batch.
    srv, peers = server(Numbers(SAMPLES), workers=1, direct=False)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=4, window=4)
    batches = iter(loader)
    assert batches._thread is None
    got = []
    for k, (_, ids) in enumerate(batches):
        got.append(ids.tolist())
        if k < len(_planned(1)) - 1:  # more to come: here already, or asked for
            assert batches._got[0] or len(batches._posted[0]) == 1, k
    assert got == _planned(1)
    assert not any(t.name == "gradsync-data-fetch" for t in threading.enumerate())
    stats = peers[0].call("stats")
    assert stats["sent"] == len(got) and stats["takes"] < len(got)


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
@pytest.mark.parametrize("takes", [1, 2])
def test_a_server_lost_with_takes_in_flight_has_its_batches_served_once_by_the_other(
        server, takes, thread):
    # Two data servers over TCP; server 0's sample ``slow`` (in its second batch) waits for
    # a gate, so the take asked ahead for that batch (and with 2 takes, the one behind it)
    # is in flight when server 0 is closed.
    gate = threading.Event()
    slow = _planned(2)[2][0]  # the plan deals batches to the servers in turn: 0, 1, 0, ...

    class Gated(Numbers):
        def __getitem__(self, i):
            if i == slow:
                gate.wait(20)
            return super().__getitem__(i)

    srv0, peers0 = server(Gated(SAMPLES), workers=1, servers=2, index=0, direct=False)
    srv1, peers1 = server(Numbers(SAMPLES), workers=1, servers=2, index=1, direct=False)
    reply = _hello(peers0[0], SAMPLES, prefetch=2)
    _hello(peers1[0], SAMPLES, prefetch=2)
    loader = _loader([peers0[0], peers1[0]], reply, prefetch=1, window=takes, takes=takes,
                     thread=thread)
    batches = iter(loader)
    first = next(batches)[1].tolist()
    # Server 0's first batch taken (the plan's first), its next are asked for at once.
    assert _wait_for(lambda: loader._seq[0] == 1 and len(batches._posted[0]) == takes)
    assert not any(take.poll() for _, take in batches._posted[0])  # the server waits
    srv0.endpoint.close()
    got = [first] + [ids.tolist() for _, ids in batches]
    gate.set()
    assert loader.lost == {0}
    ids = sorted(i for batch in got for i in batch)
    assert ids == list(range(SAMPLES))  # each sample once, server 0's rest from server 1


def _server_items(servers, server):
    """The sample ids of data server ``server``'s items for worker 0 of 1, in stream order."""
    return [b.ids.tolist() for b in P.worker_batches(P.plan(SAMPLES, BATCH, 1, 0, servers, 1), 0)
            if b.server == server]


class _Gates(Numbers):
    """``Numbers`` whose first sample of item ``k`` of the server's stream waits for
    ``gates[k]`` (its first but sample 0, which the server also reads when it starts, for
    the layout): with two producer threads the server prepares the items after a gated one
    while that one waits."""

    def __init__(self, n, items, gates):
        super().__init__(n)
        self.gated = {next(i for i in items[k] if i != 0): gate for k, gate in gates.items()}

    def __getitem__(self, i):
        if i in self.gated:
            self.gated[i].wait(20)
        return super().__getitem__(i)


def test_over_tcp_one_take_brings_every_ready_batch_of_the_window(server):
    # Window 4, prefetch 4: item 0 waits for a gate while the server's second producer
    # prepares items 1-3. The take asked for item 0 then answers with items 0-3, their bytes
    # one after the other on its reply: one round trip, four batches (with a window of one
    # batch: four takes).
    first = threading.Event()
    items = _server_items(1, 0)
    srv, peers = server(_Gates(SAMPLES, items, {0: first}), workers=1, direct=False,
                        producers=2, producer="thread")
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=4, window=4,
                     takes=1)
    batches = iter(loader)
    assert _wait_for(lambda: srv.streams[0].finished == {1, 2, 3})  # item 0 still gated
    first.set()
    got = [ids.tolist() for _, ids in batches]
    assert got == _planned(1)
    stats = peers[0].call("stats")
    assert stats["sent"] == len(got)  # each batch's bytes crossed once
    assert stats["takes"] <= len(got) - 3  # the first take brought 4


class _Until:
    """A gate (for ``_Gates``) that opens once ``ready()`` holds (polled, within 20 s)."""

    def __init__(self, ready):
        self.ready = ready

    def wait(self, seconds):
        return _wait_for(self.ready, seconds)


def test_over_tcp_a_take_sent_ahead_waits_until_several_batches_are_ready(server):
    # Window 4, one producer that makes the items in turn. The first take, which the worker
    # waits for with nothing in hand, is answered with item 0 alone (item 1 waits for a
    # gate). The take sent ahead (items 1-4) waits on the server until 3 of its items are
    # ready and brings them on one reply: item 2 is made only once that take waits for more
    # than item 1, or has answered. Answered as soon as item 1 was ready, as before, it
    # brought item 1 alone, and every later batch paid a take of its own.
    gate = threading.Event()
    srv = None

    def ahead() -> bool:
        stream = srv.streams[0]
        return getattr(stream, "awaited", 0) > 2 or srv.takes >= 2

    srv, peers = server(_Gates(SAMPLES, _server_items(1, 0), {1: gate, 2: _Until(ahead)}),
                        workers=1, direct=False)
    answers = []  # (the item a take named, or None; the items its reply brought)
    take = srv._take

    def recording(worker, args):
        reply = take(worker, args)
        info = reply.reply if isinstance(reply, Attached) else reply
        answers.append((args.get("seq"), [info["seq"] + k for k in
                                           range(1 + len(info.get("more", [])))]))
        return reply

    srv.endpoint.on_call("take", recording)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=4, window=4,
                     takes=1)
    batches = iter(loader)
    first = next(batches)[1].tolist()
    gate.set()
    got = [first] + [ids.tolist() for _, ids in batches]
    assert got == _planned(1)
    assert answers[0] == (0, [0])
    assert len(answers[1][1]) >= 3, answers  # items 1-3 (and 4 if ready) on one reply
    assert [k for _, brought in answers for k in brought] == list(range(len(got)))
    stats = peers[0].call("stats")
    assert stats["sent"] == len(got) and stats["takes"] == len(answers)


@pytest.mark.parametrize("thread", [False, True], ids=["loop", "thread"])
def test_over_tcp_a_lost_servers_batches_received_in_a_window_are_not_served_again(server,
                                                                                    thread):
    # Two data servers, window 4: server 0's first take brings its items 0-3 (item 0 gated
    # until items 1-3 are ready); the take asked ahead for item 4 waits on a gate when server
    # 0 is closed and given up. Items 1-3 were received: they are handed on, not served
    # again; server 0's items from 4 on come from server 1, each sample once.
    first, never = threading.Event(), threading.Event()
    items = _server_items(2, 0)
    srv0, peers0 = server(_Gates(SAMPLES, items, {0: first, 4: never}), workers=1, servers=2,
                          index=0, direct=False, producers=2, producer="thread")
    srv1, peers1 = server(Numbers(SAMPLES), workers=1, servers=2, index=1, direct=False)
    reply = _hello(peers0[0], SAMPLES, prefetch=4)
    _hello(peers1[0], SAMPLES, prefetch=4)
    loader = _loader([peers0[0], peers1[0]], reply, prefetch=1, window=4, takes=1,
                     thread=thread)
    batches = iter(loader)
    assert _wait_for(lambda: srv0.streams[0].finished == {1, 2, 3})
    first.set()
    got = [next(batches)[1].tolist()]
    # Items 0-3 are here, and the take for item 4 is in flight.
    assert _wait_for(lambda: loader._seq[0] == 4 and len(batches._posted[0]) == 1)
    srv0.endpoint.close()
    # Given up while items 1-3 wait to be handed on (as the liveness watch would).
    loader._lose(0, PeerLostError("data server 0 was given up", peer=0))
    got += [ids.tolist() for _, ids in batches]
    never.set()
    assert loader.lost == {0}
    assert sorted(i for batch in got for i in batch) == list(range(SAMPLES))
    # Server 1 served its own items and server 0's from item 4 on: not items 1-3 again.
    own = len(_server_items(2, 1))
    assert peers1[0].call("stats")["sent"] == own + len(items) - 4


def test_a_mapped_slot_reached_by_take_is_read_before_the_next_take_releases_it(server):
    # A same-host server whose slot table is not polled (``poll=False``): the take's reply
    # names the slot, and the worker reads it through its own mapping. The take asked ahead
    # for the next item releases this one, so the server may write the slot again: it must
    # be asked only once the slot is read (it was asked first, so a batch could be read
    # while the server already rewrote its slot).
    srv, peers = server(Numbers(SAMPLES), workers=1)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=2), poll=False)
    assert loader.slots[0].direct is not None and loader.pollers[0] is None
    region, reads, early = loader.slots[0], [], []
    read = region.read

    def read_late(buf, offset=0):
        k = len(reads)
        reads.append(k)
        if k == 0:  # give a take already asked for item 1 the time to release item 0
            _wait_for(lambda: srv.streams[0].released > 0, 0.3)
        if srv.streams[0].released > k:
            early.append((k, srv.streams[0].released))
        return read(buf, offset)

    region.read = read_late
    got = [ids.tolist() for _, ids in iter(loader)]
    assert got == _planned(1)
    assert reads and not early, early  # (item, released) read after their release


def _readings(monkeypatch) -> list:
    """The ``Incoming`` of each connection that an endpoint serves from now on, as it makes
    them (``regions.Endpoint._serve``): the requests a server has read ahead are in it."""
    readings = []

    class Recorded(rf.Incoming):
        def __init__(self, sock):
            super().__init__(sock)
            readings.append(self)

    monkeypatch.setattr(regions, "Incoming", Recorded)
    return readings


def _unserved(srv, worker: int, readings: list) -> int:
    """Bytes of ``worker``'s requests that data server ``srv`` has not served yet, beyond
    the one it serves: read ahead with that one (its ``Incoming``, of ``readings``), or
    waiting, unread, on its end of the connection (``test_regions._waiting_bytes``). Exact
    only while its serving thread is held in a request's handler."""
    from test_regions import _waiting_bytes

    sock = srv.endpoint._conns[worker]
    reading = next(r for r in readings if r.sock is sock)
    return reading.end - reading.start + _waiting_bytes(srv.endpoint, worker)


def test_over_tcp_the_next_take_waits_on_the_server_before_its_batch_is_ready(server,
                                                                                monkeypatch):
    # Window 2 in 2 takes of one batch each: while the server holds the take for item 1 (its
    # first sample waits for a gate), the take for item 2 is at the server already, so the
    # server answers it the moment item 2 is ready (with one take in flight, the worker
    # would send it only once item 1's reply is in: a round trip later). It waits on the
    # connection, or in the server's read-ahead (``rma_frame.Incoming``): when the worker
    # had item 0's reply and sent it before the server's next receive, that one receive
    # took both takes.
    readings = _readings(monkeypatch)
    gate = threading.Event()
    srv, peers = server(_Gates(SAMPLES, _server_items(1, 0), {1: gate}), workers=1,
                        direct=False)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=4, window=2,
                     takes=2)
    batches = iter(loader)
    first = next(batches)[1].tolist()
    # The take for item 1 waits in its handler (``awaited``: until 2 items are made) ...
    assert _wait_for(lambda: srv.streams[0].awaited == 2)
    # ... and, as it cannot return before the gate opens, the bytes behind it stay put.
    assert _wait_for(lambda: _unserved(srv, 0, readings) >= rf.HEADER_SIZE)
    assert srv.streams[0].produced == 1  # item 1 is still behind its gate
    gate.set()
    got = [first] + [ids.tolist() for _, ids in batches]
    assert got == _planned(1)
    stats = peers[0].call("stats")
    assert stats["takes"] == stats["sent"] == len(got)  # each batch crossed once


def test_over_tcp_a_pending_take_is_asked_again_in_order_by_the_take_behind_it(server):
    # Item 1 is slow: its take answers "pending" after 0.2 s while the next take is already
    # on the connection. That one, sent without an item number, asks for item 1 (not item
    # 2), and the stream goes on in order, each batch once.
    gate = threading.Event()
    srv, peers = server(_Gates(SAMPLES, _server_items(1, 0), {1: gate}), workers=1,
                        direct=False)
    answers = []  # (the item a take named, or None; the item answered, or "pending")
    take = srv._take

    def recording(worker, args):
        reply = take(worker, args)
        info = reply.reply if isinstance(reply, Attached) else reply
        answers.append((args.get("seq"), "pending" if info.get("pending") else info["seq"]))
        if info.get("pending"):
            gate.set()
        return reply

    srv.endpoint.on_call("take", recording)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=4, window=2,
                     takes=2)
    loader._take_wait = 0.2
    got = [ids.tolist() for _, ids in iter(loader)]
    assert got == _planned(1)
    pending = [k for k, (_, answer) in enumerate(answers) if answer == "pending"]
    assert pending and answers[pending[0]][0] is None  # the take for item 1 was pipelined
    assert answers[pending[0] + 1][0] is None  # and so was the one behind it
    assert [answer for _, answer in answers if answer != "pending"] == list(range(len(got)))


def test_a_reset_with_takes_in_flight_cuts_the_stream_where_the_worker_stands(server):
    # Two takes in flight when the worker resets (an elastic re-formation): they released
    # only the items received before them, so the new generation's start cuts the stream
    # there, and the rest of the epoch is served once, in the new plan's order.
    srv, peers = server(Numbers(SAMPLES), workers=1, direct=False)
    loader = _loader([peers[0]], _hello(peers[0], SAMPLES, prefetch=4), prefetch=1, window=4,
                     takes=2)
    batches = iter(loader)
    held = [next(batches)[1].tolist() for _ in range(2)]
    assert _wait_for(lambda: len(batches._posted[0]) == 2)
    done = np.zeros(SAMPLES, dtype=bool)
    done[[i for batch in held for i in batch]] = True
    state = {"version": P.STATE_VERSION, "samples": SAMPLES, "batch_size": BATCH, "seed": 1,
             "epoch": 0, "done": P.pack_mask(done)}
    loader.reset(0, 1, state, generation=1)
    rest = [ids.tolist() for _, ids in iter(loader)]
    assert rest == [b.ids.tolist() for b in P.worker_batches(
        P.plan(SAMPLES, BATCH, 1, 0, 1, 1, done), 0)]
    assert sorted(i for batch in held + rest for i in batch) == list(range(SAMPLES))
