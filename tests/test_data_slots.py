"""The slot table: a same-host worker takes its batches by polling shared memory, no message.

Pure logic (the table's words, the seqlock, the poll's deadline and liveness check) and one
``DataServer`` with its worker as a thread polling it (``slots.poller``); the launcher-level
checks (no ``take`` counted on a whole job's servers) are in tests/test_data_multiprocess.py.
"""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gradsync.data import plan as P
from gradsync.data.layout import Layout
from gradsync.data.slots import ACK_WORD, Poller, SlotTable, poller, table_words
from gradsync.errors import GradsyncError, GradsyncTimeoutError, PeerLostError
from gradsync.transport import shm

from test_data import (Numbers, Unreadable, _hello, _Looks, _wait_for,  # noqa: F401
                       server)  # (fixture)


def _table(prefetch=2, batch_size=3):
    return SlotTable(np.zeros(table_words(prefetch, batch_size), np.int64), prefetch,
                     batch_size)


def test_an_item_is_seen_only_once_published_and_until_the_table_is_cleared():
    table = _table()
    assert table.poll(0) is None
    table.publish(0, generation=4, epoch=1, index=7, nbytes=96, ids=np.array([5, 2]))
    h = table.poll(0)
    assert (h.seq, h.generation, h.epoch, h.index, h.nbytes, h.ids.tolist()) == \
        (0, 4, 1, 7, 96, [5, 2])
    assert table.poll(2) is None  # the same slot, a later item: not yet
    table.publish(1, 4, 1, 8, 144, np.array([1, 0, 3]))
    assert table.poll(1).ids.tolist() == [1, 0, 3]
    table.ack(1)
    assert table.acked() == 2 and table.words[ACK_WORD] == 2
    table.clear()
    assert table.poll(0) is None and table.poll(1) is None
    assert not table.failed()
    table.fail()
    assert table.failed()


def test_a_header_rewritten_while_it_is_read_is_not_taken(monkeypatch):
    # The seqlock: the published word read after the metadata must still name the item.
    from gradsync.data import slots

    table = _table()
    table.publish(0, 0, 0, 3, 10, np.array([1]))

    class Rewriting:
        """NumPy, but the server rewrites slot 0 (item 2) while the ids are copied."""

        def __getattr__(self, name):
            return getattr(np, name)

        def array(self, *args, **kwargs):
            table.words[2 * 8] = 3
            return np.array(*args, **kwargs)

    monkeypatch.setattr(slots, "np", Rewriting())
    assert table.poll(0) is None
    monkeypatch.undo()
    table.publish(0, 0, 0, 3, 10, np.array([1]))
    assert table.poll(0).ids.tolist() == [1]


def test_a_table_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="int64 words"):
        SlotTable(np.zeros(5, np.int64), 2, 3)


def _sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _wait_for(lambda: shm.process_start_time(proc.pid) is not None)
    return proc


def test_a_server_killed_while_the_worker_polls_is_named_within_the_deadline():
    proc = _sleeper()
    try:
        road = Poller(_table(), np.zeros(64, np.uint8), 32, proc.pid,
                      shm.process_start_time(proc.pid), "data server 0 (rank 3)", 3)
        caught = []

        def poll():
            try:
                road.wait(0, timeout=30, stopping=lambda: False)
            except BaseException as exc:
                caught.append((exc, time.monotonic()))

        # The poll has begun to wait (past its first looks, checking the server's life)
        # before the server is killed.
        checking = threading.Event()
        check_alive = road.check_alive
        road.check_alive = lambda: (checking.set(), check_alive())
        thread = threading.Thread(target=poll)
        thread.start()
        assert checking.wait(10)
        assert thread.is_alive()  # nothing published: it waits
        proc.kill()
        killed = time.monotonic()
        thread.join(5)
        assert not thread.is_alive()
    finally:
        proc.kill()
        proc.wait()
    exc, when = caught[0]
    assert isinstance(exc, PeerLostError) and exc.peer == 3
    assert "data server 0 (rank 3)" in str(exc) and "exited or was killed" in str(exc)
    assert when - killed < 1.0  # the liveness check runs every 50 ms of waiting


def test_a_poll_ends_at_its_deadline_or_when_stopped_or_when_the_server_failed():
    road = Poller(_table(), np.zeros(64, np.uint8), 32, 1, shm.process_start_time(1) or 0,
                  "data server 0", 0)
    road.check_alive = lambda: None  # pid 1 may be hidden from this process
    start = time.monotonic()
    with pytest.raises(GradsyncTimeoutError, match="item 0 within"):
        road.wait(0, timeout=0.2, stopping=lambda: False)
    assert time.monotonic() - start < 2
    assert road.wait(0, timeout=30, stopping=lambda: True)[0] is None
    road.table.fail()
    assert road.wait(0, timeout=30, stopping=lambda: False)[0] is None


def _road(srv, peer, worker):
    """Worker ``worker``'s poll road (after its hello, before its first start, which unlinks
    the regions' names: as the Loader maps them)."""
    road = poller(peer, worker, srv.streams[worker].prefetch, srv.batch_size, srv.slot_bytes)
    assert road is not None
    return road


def test_a_sleeping_poll_is_woken_by_the_publish_and_says_how_long_the_batch_was_prepared():
    road = Poller(_table(), np.zeros(64, np.uint8), 32, 1, 0, "data server 0", 0)
    road.check_alive = lambda: None
    start = time.perf_counter()
    timer = threading.Timer(0.3, road.table.publish, (0, 0, 0, 1, 8, np.array([4])))
    timer.start()
    header, waited = road.wait(0, timeout=30, stopping=lambda: False)
    elapsed = time.perf_counter() - start
    timer.join()
    assert header.ids.tolist() == [4]
    # ``waited``: from the poll's start to the publish (the preparation), not to the wake-up.
    assert 0.25 < waited <= elapsed


def _poll_all(road, layout, items, first=0):
    """Polls ``items`` items of a stream from ``first`` (no take); returns their headers and
    tensors."""
    got = []
    for seq in range(first, first + items):
        header, _ = road.wait(seq, timeout=10, stopping=lambda: False)
        buf = np.empty(header.nbytes, np.uint8)
        road.read(header, buf)
        got.append((header, layout.unpack(buf, len(header.ids))))
    return got


def test_a_polling_worker_gets_every_batch_with_no_take_and_its_acks_are_the_credit(
        server, monkeypatch):
    looks = _Looks(monkeypatch)
    srv, peers = server(Numbers(40), workers=2)
    layout = Layout(_hello(peers[0], 40, prefetch=2)["layout"])
    _hello(peers[1], 40, prefetch=2)
    road = _road(srv, peers[0], 0)
    for p in peers.values():
        assert p.call("start", epoch=0, done=None)["batches"] == 5
    assert _wait_for(lambda: all(s.produced == 2 for s in srv.streams.values()))
    assert looks.out_of_credit(srv.streams.values(), looks.mark())
    assert [s.produced for s in srv.streams.values()] == [2, 2]  # out of credit
    got = _poll_all(road, layout, 1)
    # The ack of item 0, a store to shared memory, is worker 0's credit: no message.
    assert _wait_for(lambda: srv.streams[0].produced == 3)
    assert looks.out_of_credit(srv.streams.values(), looks.mark())
    assert srv.streams[0].produced == 3 and srv.streams[1].produced == 2
    got += _poll_all(road, layout, 4, first=1)
    mine = P.worker_batches(P.plan(40, 4, seed=1, epoch=0, servers=1, workers=2), 0)
    assert [h.index for h, _ in got] == [b.index for b in mine]
    for (h, (x, ids)), b in zip(got, mine):
        assert ids.tolist() == h.ids.tolist() == b.ids.tolist()
        bump = [np.random.default_rng([1, 0, i]).integers(1, 1000) for i in b.ids]
        assert (x[:, 0].numpy() == b.ids + np.asarray(bump, np.float32)).all()
    stats = peers[0].call("stats")
    assert stats["takes"] == 0 and stats["batches"] == 5 + 2


def test_a_batch_is_counted_before_a_worker_can_see_it(server, monkeypatch):
    # A worker that has read its last batch and asks for the stats must find it counted (CI:
    # 179 of 180, the server's thread descheduled between the publish and the count).
    srv, peers = server(Numbers(40), workers=1)
    _hello(peers[0], 40, prefetch=2)
    seen, publish = [], SlotTable.publish

    def counting(table, seq, *args):
        seen.append((seq, srv.batches_served))
        publish(table, seq, *args)

    monkeypatch.setattr(SlotTable, "publish", counting)
    peers[0].call("start", epoch=0, done=None)
    assert _wait_for(lambda: len(seen) == 2)
    assert seen == [(0, 1), (1, 2)]


def test_a_server_that_closes_the_connection_while_the_worker_polls_is_named(server):
    # The server's process lives (it is this one) but its end of the connection is gone,
    # as a take's reply would have said.
    srv, peers = server(Numbers(40), workers=1)
    _hello(peers[0], 40, prefetch=2)
    road = _road(srv, peers[0], 0)
    srv.endpoint.close()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="closed its connection"):
        road.wait(0, timeout=30, stopping=lambda: False)
    assert time.monotonic() - start < 1.0


def test_a_failing_sample_is_flagged_in_the_table_and_its_take_names_it(server):
    srv, peers = server(Unreadable(12), workers=1, batch_size=12)
    _hello(peers[0], 12, batch_size=12)
    road = _road(srv, peers[0], 0)
    peers[0].call("start", epoch=0, done=None)
    header, _ = road.wait(0, timeout=10, stopping=lambda: False)
    assert header is None and road.table.failed()
    with pytest.raises(GradsyncError, match="unreadable file"):
        peers[0].call("take", seq=0)


def test_a_new_generation_clears_the_table_so_no_old_item_is_polled(server):
    # As test_data's re-planning test, on the poll road: the items of the old plan that
    # were published and not read must never reach the worker.
    srv, peers = server(Numbers(40), workers=2)
    layout = Layout(_hello(peers[0], 40, prefetch=3)["layout"])
    _hello(peers[1], 40, prefetch=3)
    road = _road(srv, peers[0], 0)
    for p in peers.values():
        p.call("start", epoch=0, done=None)
    old = P.worker_batches(P.plan(40, 4, 1, 0, 1, 2), 0)
    taken = [h.ids.tolist() for h, _ in _poll_all(road, layout, 2)]
    assert taken == [old[0].ids.tolist(), old[1].ids.tolist()]
    assert _wait_for(lambda: srv.streams[0].produced == 5)  # items 2-4 of the old plan
    done = np.zeros(40, bool)
    done[taken[0] + taken[1]] = True
    peers[0].call("start", epoch=0, done=P.pack_mask(done), generation=1, workers=1, index=0,
                  seq=2)
    new = P.worker_batches(P.plan(40, 4, 1, 0, 1, 1, done), 0)
    got = _poll_all(road, layout, 8, first=2)
    assert [h.ids.tolist() for h, _ in got] == [b.ids.tolist() for b in new]
    assert all(h.generation == 1 for h, _ in got)
    assert sorted(sum(taken, []) + [i for h, _ in got for i in h.ids.tolist()]) == \
        list(range(40))
