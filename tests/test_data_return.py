"""A data server started again, taken back by every worker at one agreed epoch, without
processes (``gradsync/data/returns.py``): the agreement, the choice of servers it makes each
epoch on every worker, the reports read from the store, and a worker dialling a replacement
served by a real DataServer in this process.

The job with real ranks is tests/test_data_elastic.py
(``test_a_data_server_started_again_serves_the_workers_that_lost_it_from_the_next_epoch``).
"""

import json
import threading
import uuid

import numpy as np
import pytest
from torch.distributed import HashStore

from gradsync.cluster.rendezvous import Store
from gradsync.connect.server_links import publish
from gradsync.data import plan as P
from gradsync.data.cache import Cache
from gradsync.data.loader import Loader
from gradsync.data.returns import Return, agree, ready_key, ready_record, wanted
from gradsync.data.server import DataServer, Source
from gradsync.transport.regions import ANY_PEER, Endpoint

REPLACEMENT = Return(2, "d", 202, 3)


def _report(returns=None, ready=None):
    return {"returns": dict(returns or {}), "ready": dict(ready or {})}


# ------------------------------------------------------------------ the agreement
def test_a_ready_replacement_reported_by_one_worker_serves_every_worker_from_the_epoch_given():
    reports = [_report(ready={0: (2, "d", 202)}), _report(), _report()]
    assert agree(reports, 3) == {0: REPLACEMENT}
    assert agree([_report(), _report()], 3) == {}  # nothing reported, nothing back


def test_an_agreed_return_is_kept_as_it_was_whatever_the_later_collective():
    # A member that missed the commit that agreed it (it failed there, or is new) has none:
    # the others' entry wins, with its epoch, not the later collective's.
    reports = [_report(), _report(returns={0: REPLACEMENT}), _report(ready={0: (2, "d", 202)})]
    assert agree(reports, 7) == {0: REPLACEMENT}
    # The same process reported again (not newer than the entry) changes nothing.
    assert agree([_report(returns={0: REPLACEMENT}, ready={0: (2, "d", 202)})], 9) == \
        {0: REPLACEMENT}


def test_a_newer_process_replaces_the_entry_and_the_newest_reported_wins():
    reports = [_report(returns={0: REPLACEMENT}, ready={0: (3, "d", 303)}),
               _report(returns={0: REPLACEMENT}, ready={0: (4, "d", 404), 1: (2, "e", 5)})]
    assert agree(reports, 6) == {0: Return(4, "d", 404, 6), 1: Return(2, "e", 5, 6)}
    # The first incarnation is the one every worker uses without an entry: never "back".
    assert agree([_report(ready={0: (1, "d", 101)})], 1) == {}


def test_every_member_computes_the_same_table_from_the_same_reports():
    reports = [_report(returns={1: Return(2, "e", 5, 1)}), _report(ready={0: (2, "d", 202)}),
               _report(ready={0: (3, "d", 303)})]
    tables = [agree(list(reports), 4) for _ in reports]
    assert tables[0] == tables[1] == tables[2] == {0: Return(3, "d", 303, 4),
                                                  1: Return(2, "e", 5, 1)}


def test_the_process_wanted_in_an_epoch():
    table = {0: REPLACEMENT}
    assert [wanted(table, 0, e) for e in range(5)] == [None, None, None, 2, 2]
    assert [wanted(table, 1, e) for e in range(3)] == [1, 1, 1]  # never came back


# ------------------------------------------------------------------ a worker's choice
class _Peer:
    def __init__(self, pid):
        self.host, self.pid = "d", pid

    def abandon(self):
        pass

    def close(self):
        pass


def _worker(incarnations, lost=(), returns=None, store=None):
    """A Loader as ``__init__`` leaves an elastic worker, connected to the processes of the
    given incarnations (0: none reached); ``lost``: those it gave up."""
    loader = Loader.__new__(Loader)
    loader.rank = loader.ident = 0
    loader.servers = len(incarnations)
    loader.incarnations = list(incarnations)
    loader.peers = [_Peer(100 * k + d) if k else None for d, k in enumerate(incarnations)]
    loader.lost, loader._pending, loader._lost_lock = set(lost), set(), threading.Lock()
    loader.returns = dict(returns or {})
    loader._losses = store if store is not None else Store.over(HashStore(), "job", 5.0)
    loader.redialled = []

    def redial(server, back):  # as Loader._redial when the wanted process answers
        loader.redialled.append(server)
        loader.incarnations[server] = back.incarnation
        loader.lost.discard(server)

    loader._redial = redial
    return loader


def _uses(loader, epoch):
    loader._choose_servers(epoch)
    return [d for d in range(loader.servers) if d not in loader.lost]


def test_every_worker_uses_the_same_servers_each_epoch_whatever_it_is_connected_to():
    # Data server 0's first process died in epoch 0; its replacement (incarnation 2) is
    # agreed from epoch 3. Worker a gave the first process up; worker b has not noticed its
    # end (still connected to it); worker c is new, connected to the replacement since it
    # started. Each epoch, all three use the same servers.
    table = {0: REPLACEMENT}
    a, b, c = _worker([1, 1], lost={0}), _worker([1, 1]), _worker([2, 1])
    for loader in (a, b, c):
        loader.returns = dict(table)
    for epoch in range(3):
        assert _uses(a, epoch) == _uses(b, epoch) == _uses(c, epoch) == [1], epoch
    assert c._pending == {0} and b._pending == {0}  # alive, only left out: no loss written
    assert _uses(a, 3) == _uses(b, 3) == _uses(c, 3) == [0, 1]
    assert (a.redialled, b.redialled, c.redialled) == ([0], [0], [])  # c had it already
    # A roll-back to a commit of epoch 2 leaves it out again, and takes it back at 3.
    assert _uses(a, 2) == _uses(c, 2) == [1] and _uses(a, 3) == _uses(c, 3) == [0, 1]
    assert a.redialled == [0]
    # Without a table entry the first process serves, and a replacement nobody agreed on
    # (a new worker's) is left out.
    assert _uses(_worker([1, 1]), 0) == [0, 1] and _uses(_worker([2, 1]), 0) == [1]


def test_a_process_given_up_is_not_used_again_and_a_newer_one_waits_for_its_own_entry():
    table = {0: REPLACEMENT}
    given_up = _worker([2, 1], lost={0}, returns=table)  # lost the replacement itself
    assert _uses(given_up, 3) == [1] and given_up.redialled == []
    newer = _worker([3, 1], returns=table)  # the replacement exited, a third one came
    assert _uses(newer, 3) == [1] and newer._pending == {0}
    newer.returns = {0: Return(3, "d", 303, 5)}
    assert _uses(newer, 4) == [1] and _uses(newer, 5) == [0, 1]


def test_a_report_names_a_newer_process_of_a_server_not_used_unless_given_up():
    store = Store.over(HashStore(), "job", 5.0)
    worker = _worker([1, 1], lost={0}, store=store)
    assert worker.server_report() == _report()  # no ready record yet
    store.set(ready_key(0), ready_record(1, "d", 101))
    assert worker.server_report() == _report()  # the first process: not a return
    store.set(ready_key(0), ready_record(2, "d", 202))
    assert worker.server_report() == _report(ready={0: (2, "d", 202)})
    using = _worker([1, 1], store=store)  # a worker that uses server 0 reads nothing
    assert using.server_report() == _report()
    worker.returns = {0: REPLACEMENT}  # agreed already: not newer than the entry
    assert worker.server_report() == _report(returns={0: REPLACEMENT})
    worker.returns = {}
    store.set("data/lost/0/d/202", "7")  # another worker gave the replacement up
    assert worker.server_report() == _report()
    static = _worker([1, 1], lost={0})
    static._losses = None  # a job that is not elastic has no store to read, nor a return
    assert static.server_report() == _report()


# ------------------------------------------------------------------ dialling a replacement
class _Numbers:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return (np.full(2, i, np.float32), i)


def _served_worker(store, client, old_peer):
    """A Loader as ``__init__`` leaves a worker that gave data server 0 up."""
    loader = Loader.__new__(Loader)
    loader.rank, loader.ident, loader.servers = 0, 5, 1
    loader.samples, loader.batch_size, loader.seed, loader.order = 20, 4, 1, "servers"
    loader.collate, loader.prefetch = None, 2
    loader.endpoint, loader.peers = client, [old_peer]
    loader.slots, loader.pollers, loader.incarnations, loader._seq = [None], [None], [1], [3]
    loader.lost, loader._pending, loader._lost_lock = {0}, set(), threading.Lock()
    loader._losses, loader._connect_timeout, loader._silence, loader._watch = store, 10, None, \
        None
    return loader


@pytest.mark.parametrize("incarnation", [2, 3])
def test_a_worker_dials_the_replacement_it_wants_and_gives_up_one_that_exited(incarnation):
    # The replacement the table wants answers: the worker takes it back, its stream new.
    # The address names a newer process (the wanted one exited too): the worker writes the
    # wanted one's loss and leaves the server out for the epoch.
    job = f"t{uuid.uuid4().hex[:10]}"
    store = Store.over(HashStore(), job, 5.0)
    owner = Endpoint(7, "h", b"s" * 32, f"{job}.data", expect=ANY_PEER, timeout=20)
    srv = DataServer(0, 1, 1, owner, Source(_Numbers(), None, 1, Cache(1 << 20)), 4, 1, 20,
                     elastic=True)
    srv.incarnation = incarnation
    publish(store, "data", 0, owner)
    client = Endpoint(5, "h", b"s" * 32, f"{job}.data", timeout=20)
    loader = _served_worker(store, client, None)
    wanted_one = Return(2, "h", 4242, 1)
    loader.returns = {0: wanted_one}
    try:
        loader._choose_servers(0)
        assert loader.lost == {0} and loader.peers == [None]  # not before its epoch
        loader._choose_servers(1)
        if incarnation == 2:
            assert loader.lost == set() and loader.incarnations == [2] and loader._seq == [0]
            reply = loader.peers[0].call("start", epoch=1, done=None, generation=0, workers=1,
                                         index=0, seq=0)
            assert reply["batches"] == len(P.plan(20, 4, 1, 1, 1, 1))
            taken = loader.peers[0].call("take", seq=0)
            assert taken["ids"] == P.plan(20, 4, 1, 1, 1, 1)[0].ids.tolist()
            assert not store.check("data/lost/0/h/4242")
        else:
            assert loader.lost == {0} and loader._pending == {0}
            assert loader.incarnations == [3]
            assert store.check("data/lost/0/h/4242")  # the wanted process, given up
            loader._choose_servers(2)  # and not dialled again
            assert loader.incarnations == [3] and loader.lost == {0}
    finally:
        if loader.peers[0] is not None:
            loader.peers[0].close()
        client.close()
        srv.close()
        owner.close()


def test_a_worker_that_cannot_reach_the_replacement_writes_its_loss_and_stops_dialling():
    job = f"t{uuid.uuid4().hex[:10]}"
    store = Store.over(HashStore(), job, 5.0)
    gone = Endpoint(7, "h", b"s" * 32, f"{job}.data", expect=ANY_PEER, timeout=20)
    publish(store, "data", 0, gone)
    gone.close()  # published, then exited: its port refuses
    client = Endpoint(5, "h", b"s" * 32, f"{job}.data", timeout=20)
    loader = _served_worker(store, client, None)
    loader._connect_timeout = 5
    loader.returns = {0: Return(2, "h", 4242, 0)}
    dials = []

    def connect(*args, **kwargs):
        dials.append(args[0])
        return Endpoint.connect(client, *args, **kwargs)

    client.connect = connect
    try:
        loader._choose_servers(0)
        assert dials == [7] and loader.lost == {0} and loader._pending == set()
        assert json.loads(store.get("data/lost/0/h/4242")) == 5  # written by worker id 5
        assert loader.incarnations == [2]
        loader._choose_servers(1)  # given up: not dialled again
        assert dials == [7] and loader.lost == {0}
    finally:
        client.close()
