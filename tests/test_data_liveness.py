"""A stopped or cut-off data server is a lost one; a slow one is not (gradsync/data/liveness.py).

Without processes: a ``take`` that answers "pending" while its batch is slow; a connection
whose owner stops answering found silent; the watch's judgement of a same-host server's beat,
on an injected clock. Through the launcher (tests/ranks/data_check.py, ``stopserver``): a data
server SIGSTOPped mid-epoch is given up by every worker within the chaos bench's bound, on
both roads, its share served by the others with every sample exactly once; a server that is
slow at the same time is not given up. The stopped server on the poll road and the servers that
hold their GIL share one job of 2 workers and 2 data servers (tests/service_jobs.py), each
scenario a job of its own under its own job id in the same ranks; the slow server beside a
stopped one over TCP (2 workers, 3 data servers) is a scenario of test_data_multiprocess.py's
job of that shape (tests/data_jobs.py).
"""

import json
import threading
import time
import uuid

import numpy as np
import pytest

from gradsync.data import plan as P
from gradsync.data.liveness import Watch
from gradsync.data.slots import Poller, SlotTable, table_words
from gradsync.errors import PeerLostError
from gradsync.transport.regions import Endpoint

from test_data import SECRET, Numbers, _hello, _wait_for, server  # noqa: F401 (fixture)

import data_jobs
import harness
import service_jobs as S

HEARTBEAT_TIMEOUT, HEARTBEAT_INTERVAL = 2.0, 0.25  # the defaults, which the jobs run with
BOUND = 3.0  # gradsync bench chaos's default detection bound


# --- without processes -----------------------------------------------------------------------

class _Gate:
    """A transform that holds every sample the producer prepares until the test opens the
    gate: a slow server. (Its first call is the server's look at sample 0's layout.)"""

    def __init__(self):
        self.open, self.calls = threading.Event(), 0

    def __call__(self, sample, rng):
        self.calls += 1
        if self.calls > 1:
            assert self.open.wait(20)
        return sample


def test_a_take_whose_batch_is_slow_answers_pending_within_its_wait_and_then_the_item(server):
    gate = _Gate()
    srv, peers = server(Numbers(8), workers=1, transform=gate)
    _hello(peers[0], 8)
    peers[0].call("start", epoch=0, done=None)
    start = time.monotonic()
    info = peers[0].call("take", seq=0, wait=0.2)
    # Answered within the wait (a broken server would hold it until the batch is ready).
    assert info["pending"] and time.monotonic() - start < 5
    # ``waited`` counts from the moment the server holds the worker's stream, the wait's 0.2 s
    # from the request's arrival, a moment earlier (0.19988 s once, on 3 busy pytest workers).
    assert info["waited"] >= 0.15
    assert peers[0].call("stats")["takes"] == 0  # a pending answer is no take
    gate.open.set()
    info = peers[0].call("take", seq=0, wait=5)
    assert not info.get("pending") and info["index"] == 0
    assert peers[0].call("stats")["takes"] == 1


def test_a_new_generations_start_behind_a_slow_batch_answers_pending_and_changes_nothing(
        server):
    # An elastic re-formation's start cuts the worker's stream, which must wait while the
    # producer writes into it: with a slow batch that is longer than the heartbeat timeout.
    gate = _Gate()
    srv, peers = server(Numbers(16), workers=1, transform=gate)
    _hello(peers[0], 16)
    peers[0].call("start", epoch=0, done=None)
    stream = srv.streams[0]
    assert _wait_for(lambda: stream.busy)  # the producer holds item 0, behind the gate
    again = {"epoch": 0, "done": None, "generation": 1, "workers": 1, "index": 0, "seq": 0}
    assert peers[0].call("start", wait=0.2, **again) == {"pending": True}
    assert stream.generation == 0 and len(stream.items) == 4  # nothing changed
    gate.open.set()
    assert peers[0].call("start", wait=5, **again) == {"batches": 4}
    assert stream.generation == 1


def test_a_connection_whose_owner_stops_answering_is_found_silent():
    job = f"t{uuid.uuid4().hex[:10]}"
    owner = Endpoint(100, "h", SECRET, job, expect={0, 1}, timeout=60)
    hold = threading.Event()
    owner.on_call("hang", lambda worker, args: hold.wait(30) and {})
    owner.on_call("ping", lambda worker, args: {})
    clients = [Endpoint(w, "h", SECRET, job, timeout=60) for w in (0, 1)]
    try:
        silent = clients[0].connect(100, "127.0.0.1", owner.port, time.monotonic() + 10,
                                    "data server 0", silence=0.5)
        assert silent.call("ping") == {}
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="data server 0 has been silent for 0.5s"):
            silent.call("hang")
        assert time.monotonic() - start < 10  # the endpoint's timeout is 60 s
        with pytest.raises(PeerLostError):  # nothing more goes on a connection found silent
            silent.call("ping")
        # Without ``silence`` a slow reply is waited for (the endpoint's timeout).
        patient = clients[1].connect(100, "127.0.0.1", owner.port, time.monotonic() + 10)
        waiting = patient.call_async("hang")
        hold.set()
        assert waiting.wait(20) == {}
    finally:
        hold.set()
        for ep in clients + [owner]:
            ep.close()


class _Loader:
    """What the watch reads of a Loader: one same-host data server, polled."""

    def __init__(self, road):
        self.peers, self.pollers, self.lost, self.losses = [object()], [road], set(), []

    def _lose(self, d, error):
        self.lost.add(d)
        self.losses.append((d, error))


def _road():
    table = SlotTable(np.zeros(table_words(2, 3), np.int64), 2, 3)
    return Poller(table, np.zeros(64, np.uint8), 32, 1, 0, "data server 0 (rank 3)", 3)


def test_the_watch_gives_up_a_server_whose_beat_stands_still_and_not_a_late_watcher():
    road = _road()
    loader = _Loader(road)
    now = [100.0]
    watch = Watch(loader, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, clock=lambda: now[0])

    def looks(seconds, beating):
        end = now[0] + seconds
        while now[0] < end:
            if beating:
                road.table.beat()
            now[0] += HEARTBEAT_INTERVAL
            watch.look()

    looks(10, beating=True)  # a server that beats is never silent, however long
    assert not loader.lost
    looks(HEARTBEAT_TIMEOUT - HEARTBEAT_INTERVAL, beating=False)
    assert not loader.lost  # not yet: silent for less than the timeout
    # The watcher itself stalled for 5 s (this worker was stopped): its gap is no evidence.
    now[0] += 5
    watch.look()
    assert not loader.lost
    looks(HEARTBEAT_TIMEOUT - HEARTBEAT_INTERVAL, beating=False)
    assert not loader.lost
    looks(2 * HEARTBEAT_INTERVAL, beating=False)
    assert [d for d, _ in loader.losses] == [0]
    error = loader.losses[0][1]
    assert isinstance(error, PeerLostError) and error.peer == 3
    assert "data server 0 (rank 3)" in str(error) and "beat stood still" in str(error)
    # A poll waiting on that server raises it at its next check.
    with pytest.raises(PeerLostError, match="beat stood still"):
        road.check_alive()


# --- through the launcher --------------------------------------------------------------------

SAMPLES, BATCH, SEED = 400, 4, 7  # 25 batches per worker and server and epoch: mid-epoch


TIMEOUT = 240
"""The shared job's deadline: its two scenarios' own (120 s each alone, mostly start-up) and
room for a loaded machine."""


@pytest.fixture(scope="module")
def two_two(tmp_path_factory):
    """2 workers, 2 data servers on this host (the poll road): ``stopserver`` (server 0
    SIGSTOPped, SIGCONTed at its end: it finds its workers gone and ends, so its rank goes on),
    then ``holdserver`` (each server holds its GIL for 1.5 heartbeat timeouts). Both ended
    with status 0 in jobs of their own."""
    hold = {"GS_DATA_SAMPLES": str(SAMPLES), "GS_DATA_HOLD": str(1.5 * HEARTBEAT_TIMEOUT)}
    return S.DataJob(tmp_path_factory.mktemp("liveness-2-2"), 2, 2, [
        S.data_entry("stopserver", "stopserver", 2, env={"GS_DATA_SAMPLES": str(SAMPLES)}),
        S.data_entry("holdserver", "holdserver", 1, env=hold)], timeout=TIMEOUT)


def _stopped_files(directory):
    """What a ``stopserver`` scenario left in ``directory``: when server 0 was stopped, the
    servers each worker gave up; checks that both epochs reached the workers exactly once."""
    stopped = json.loads((directory / "stopped.json").read_text())["wall"]
    lost = [json.loads((directory / f"lost-{w}.json").read_text()) for w in range(2)]
    got = [json.loads((directory / f"stopped-{w}.json").read_text()) for w in range(2)]
    for epoch in (0, 1):
        ids = [i for w in got for i in w[str(epoch)]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
    return stopped, lost


def _stopped_job(tmp_path, servers, env):
    r = harness.launch(2, "data_check.py", "stopserver", str(tmp_path), "2", timeout=120,
                       env={"GS_DATA_SAMPLES": str(SAMPLES), **env},
                       launcher_args=("--data-servers", str(servers)))
    # The stopped server, continued at the end, finds its workers gone and ends cleanly.
    assert r.returncode == 0, str(r)
    return _stopped_files(tmp_path)


def _given_up_in_time(stopped, lost, why):
    for w, mine in enumerate(lost):
        assert sorted(mine) == ["0"], (w, mine)  # server 0, and only it
        wall, error = mine["0"]
        # Not before it was silent for a good part of the timeout (its last beat, or a take
        # it held, may have begun before the stop), and within the bound.
        assert HEARTBEAT_TIMEOUT / 2 <= wall - stopped < BOUND, (w, mine)
        assert why in error, (w, error)


@pytest.mark.multiprocess
def test_a_stopped_data_server_is_given_up_within_the_bound_and_its_share_served_once(two_two):
    # 2 workers, 2 data servers on this host (the poll road: no message): worker 0 stops
    # data server 0 after its third batch. Its pid lives and its sockets stay open; only its
    # beat stands still. The stopped server, continued at the end, finds its workers gone and
    # ends cleanly (the scenario returned on every rank, its server's too: ``ran``).
    directory = two_two.ran("stopserver")
    stopped, lost = _stopped_files(directory)
    _given_up_in_time(stopped, lost, "silent")
    # Worker 0, polling server 0's table in the middle of the epoch, finds its beat still; but
    # a worker with a call to that server in flight when the 2 s run out (its epoch's start;
    # on a loaded machine, beside two CPU burners, worker 0 too) finds the call silent first.
    # Both roads give the server up within the bound (above); which one wins is a race, so
    # this job asserts either, and the beat road's verdict is checked on its own, clock in
    # hand, by test_the_watch_gives_up_a_server_whose_beat_stands_still_and_not_a_late_watcher.
    error = lost[0]["0"][1]
    assert "beat stood still" in error or "(stopped, or its host cut off?)" in error, lost
    # Epoch 1 was served by server 1 alone, each worker's share in its planned order.
    got = [json.loads((directory / f"stopped-{w}.json").read_text()) for w in range(2)]
    for w in range(2):
        planned = P.worker_batches(P.plan(SAMPLES, BATCH, SEED, 1, 2, 2), w)
        mine = [i for b in planned if b.server == 1 for i in b.ids.tolist()]
        assert got[w]["1"][:len(mine)] == mine


@pytest.mark.multiprocess
def test_a_data_server_that_holds_its_gil_longer_than_the_timeout_is_not_given_up(two_two):
    # 2 workers, 2 data servers on this host (the poll road). Once every worker has its first
    # batch (no call in flight), each server holds its GIL for 1.5 timeouts in one C call, as
    # a long ``import torch`` does on a loaded machine. Its beats come from the native beater,
    # which needs no GIL; before it, its Python beater stood still and the workers gave both
    # servers up.
    directory = two_two.ran("holdserver")  # its job's status 0
    held = [json.loads(path.read_text()) for path in directory.glob("gil-*.json")]
    assert len(held) == 2 and min(held) >= HEARTBEAT_TIMEOUT, held  # both held, that long
    lost = [json.loads((directory / f"lost-{w}.json").read_text()) for w in range(2)]
    assert lost == [{}, {}], lost
    got = [json.loads((directory / f"holdserver-{w}.json").read_text()) for w in range(2)]
    assert sorted(i for w in got for i in w["0"]) == list(range(SAMPLES))


@pytest.mark.multiprocess
@pytest.mark.parametrize("road", ["tcp", pytest.param("poll", marks=pytest.mark.slow)])
def test_a_slow_data_server_is_not_given_up_beside_a_stopped_one(tmp_path, road,
                                                                tmp_path_factory):
    # 2 workers, 3 data servers. Server 1 takes 2.5 s, more than the heartbeat timeout, to
    # read a sample of its first batch (batch 1, worker 1's first from it; worker 0's next
    # one from it waits behind it), and server 0 is stopped after worker 0's third batch.
    # Over TCP a take that waited for the batch without a word would pass for silence: it
    # answers "pending" instead; on the poll road the beat goes on while the producer reads.
    # tcp: the ``slow`` scenario of the shared job of 2 workers and 3 data servers
    # (tests/data_jobs.py, with test_data_multiprocess.py's); poll: a job of its own.
    if road == "tcp":
        stopped, lost = _stopped_files(data_jobs.two_three(tmp_path_factory).ran("slow"))
    else:
        stopped, lost = _stopped_job(tmp_path, 3, data_jobs.slow_env(3, road))
    _given_up_in_time(stopped, lost, "silent")
