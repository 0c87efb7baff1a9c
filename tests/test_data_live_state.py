"""The data side of elastic mode without processes: the live state a recovery without
roll-back goes on from (``gradsync/data/elastic.py``), the elastic state's handler protocol
(``gradsync/elastic/state.py``), and a data server whose workers come and go.

The jobs with real ranks are tests/test_data_elastic.py.
"""

import time
import uuid

import numpy as np
import pytest

from gradsync.data import plan as P
from gradsync.data.cache import Cache
from gradsync.data.elastic import live_state
from gradsync.data.server import DataServer, Source
from gradsync.elastic import ObjectState
from gradsync.transport.regions import ANY_PEER, Endpoint

SAMPLES, BATCH, SEED, SERVERS = 50, 3, 5, 2


def _position(epoch, workers, place, acked, hand=True, start=None):
    """A survivor's ``Loader.position()`` after ``acked`` batches of its plan, holding the next
    one (``hand``)."""
    mine = P.worker_batches(P.plan(SAMPLES, BATCH, SEED, epoch, SERVERS, workers, start), place)
    delivered = np.zeros(SAMPLES, bool)
    for b in mine[:acked]:
        delivered[b.ids] = True
    return {"epoch": epoch, "acked": acked, "delivered": P.pack_mask(delivered),
            "hand": mine[acked].ids.tolist() if hand and acked < len(mine) else None,
            "start": P.pack_mask(start) if start is not None else None,
            "workers": workers, "place": place}


def _done(state):
    return P.unpack_mask(state["done"], SAMPLES) if state["done"] else np.zeros(SAMPLES, bool)


def _first(epoch, workers, place, n, start=None):
    mine = P.worker_batches(P.plan(SAMPLES, BATCH, SEED, epoch, SERVERS, workers, start), place)
    return set(np.concatenate([b.ids for b in mine[:n]]).tolist()) if n else set()


def test_a_lost_worker_is_credited_with_the_batches_of_the_updates_applied():
    # 3 workers, 4 updates applied on each; worker 1 is lost, 0 and 2 hold their 5th batch
    # (in flight, not applied): batches 1-4 of every worker were trained, the 5th of none.
    views = [_position(0, 3, 0, 4), None, _position(0, 3, 2, 4)]  # None: a new worker
    state = live_state(SAMPLES, BATCH, SEED, SERVERS, views)
    assert state["epoch"] == 0
    assert set(np.flatnonzero(_done(state))) == (_first(0, 3, 0, 4) | _first(0, 3, 1, 4)
                                                 | _first(0, 3, 2, 4))


def test_survivors_one_update_apart_credit_the_batch_in_hand_of_the_one_behind():
    # Worker 0 applied update 5 (and holds its 6th batch); worker 2 failed before applying
    # it and holds its 5th: that batch was trained (update 5 held it). Worker 1 was lost.
    views = [_position(0, 3, 0, 5), _position(0, 3, 2, 4)]
    done = set(np.flatnonzero(_done(live_state(SAMPLES, BATCH, SEED, SERVERS, views))))
    assert done == _first(0, 3, 0, 5) | _first(0, 3, 1, 5) | _first(0, 3, 2, 5)
    # Without the in-hand rule worker 2's 5th batch would be served again.
    assert _first(0, 3, 2, 5) - _first(0, 3, 2, 4) <= done


def test_a_generation_planned_from_a_done_mask_keeps_it_and_the_rest_is_exactly_once():
    start = np.zeros(SAMPLES, bool)
    start[P.order(SAMPLES, SEED, 1)[:12]] = True  # the commit that this generation began at
    views = [_position(1, 2, 0, 2, start=start)]  # worker 1 of 2 was lost
    state = live_state(SAMPLES, BATCH, SEED, SERVERS, views)
    done = _done(state)
    assert state["epoch"] == 1 and done[start].all()
    assert set(np.flatnonzero(done & ~start)) == _first(1, 2, 0, 2, start) | \
        _first(1, 2, 1, 2, start)
    # The new generation (3 workers) is served exactly the rest.
    rest = np.concatenate([b.ids for b in P.plan(SAMPLES, BATCH, SEED, 1, SERVERS, 3, done)])
    assert sorted(rest.tolist() + np.flatnonzero(done).tolist()) == list(range(SAMPLES))


def test_a_finished_epoch_goes_on_with_the_next_and_no_survivor_is_an_error():
    views = [_position(0, 1, 0, len(P.worker_batches(
        P.plan(SAMPLES, BATCH, SEED, 0, SERVERS, 1), 0)), hand=False)]
    state = live_state(SAMPLES, BATCH, SEED, SERVERS, views)
    assert (state["epoch"], state["done"]) == (1, None)
    # A survivor that already started the next epoch (0 batches acked) outranks one that
    # has not, and neither has a batch of it done.
    views = [_position(1, 2, 0, 0), _position(0, 2, 1, 0, hand=False)]
    assert live_state(SAMPLES, BATCH, SEED, SERVERS, views)["epoch"] == 1
    with pytest.raises(ValueError, match="no survivor"):
        live_state(SAMPLES, BATCH, SEED, SERVERS, [None, None])


# --- the handler protocol of ObjectState -----------------------------------------------------

class _Value:
    """A value that brings its own handler; a deep copy of it would fail."""

    def __init__(self):
        self.calls = []

    def __deepcopy__(self, memo):
        raise AssertionError("a handled value must not be copied")

    def elastic_handler(self):
        value = self

        class Handler:
            def save(self):
                value.calls.append("save")

            def restore(self):
                value.calls.append("restore")

            def sync(self):
                value.calls.append("sync")

            def sync_from(self, root):
                value.calls.append(f"sync_from {root}")

        return Handler()


def test_a_loader_that_lost_a_data_server_makes_the_torch_state_no_resume_point(monkeypatch):
    import types

    import torch

    from gradsync.data.elastic import LoaderState
    from gradsync.torch.elastic import TorchState

    dead = set()  # data servers whose process has ended, found by a look

    loader = types.SimpleNamespace(lost=set(), local_state=lambda: {},
                                   look_at_servers=lambda: loader.lost.update(dead))
    loader.elastic_handler = lambda: LoaderState(loader)
    model = torch.nn.Linear(2, 1)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), loader=loader)
    # a failure inside a gradient round: a resume point, as far as the optimizer goes
    monkeypatch.setattr(type(state._optimizers()[0]), "in_round", lambda self: True)
    assert state.resumable()
    loader.lost.add(1)  # its batches now come at the end of each epoch, out of plan order
    assert not state.resumable()
    # A data server that died while this worker still read what it had published: the lost
    # worker may have found it first, so the state looks at the servers before it answers.
    loader.lost.clear()
    dead.add(0)
    assert not state.resumable() and loader.lost == {0}


def test_an_object_state_hands_a_value_with_a_handler_to_it_at_every_step():
    value = _Value()
    state = ObjectState(lambda obj, root_rank, name: obj, lambda: 0, loader=value, epoch=3)
    assert state.loader is value and state.epoch == 3
    state.epoch = 4
    state.save()
    state.epoch = 5
    state.restore()
    state.sync()
    state.sync_from(2)
    assert state.epoch == 4 and state.loader is value
    assert value.calls == ["save", "restore", "sync", "sync_from 2"]


# --- a data server whose workers come and go -------------------------------------------------

class Numbers:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return (np.full(2, i, np.float32), i)


def test_an_elastic_data_server_admits_new_ids_and_outlives_its_workers():
    job = f"t{uuid.uuid4().hex[:10]}"
    owner = Endpoint(7, "h", b"s" * 32, job, expect=ANY_PEER, timeout=20)
    srv = DataServer(0, 1, 2, owner, Source(Numbers(), None, 1, Cache(1 << 20)), 4, 1, 20,
                     elastic=True)
    made = []
    try:
        def join(ident):
            client = Endpoint(ident, "h", b"s" * 32, job, timeout=20)
            peer = client.connect(7, "127.0.0.1", owner.port, time.monotonic() + 10)
            made.extend([peer, client])
            peer.call("hello", batch_size=4, seed=1, samples=20, prefetch=2)
            return peer

        first = [join(0), join(1)]
        for place, peer in enumerate(first):
            peer.call("start", epoch=0, done=None, generation=0, workers=2, index=place, seq=0)
        for peer in first:
            peer.close()
        # The server has taken both ends: its handler, which a fixed job's server ends in
        # (``done``), has run to its end once its lock is free.
        deadline = time.monotonic() + 10
        while not all(s.gone for s in srv.streams.values()):
            assert time.monotonic() < deadline, "the server never saw its workers go"
            time.sleep(0.01)
        with srv._cv:
            assert not srv.done.is_set()  # every worker it knew has gone: it still serves
        # A worker of a later generation, with an id beyond the first workers'.
        late = join(12345)
        reply = late.call("start", epoch=0, done=None, generation=3, workers=1, index=0, seq=0)
        assert reply["batches"] == len(P.plan(20, 4, 1, 0, 1, 1))
        assert late.call("take", seq=0)["ids"] == P.plan(20, 4, 1, 0, 1, 1)[0].ids.tolist()
        with pytest.raises(Exception):
            join(12345)  # an id connects once
    finally:
        for thing in reversed(made):
            thing.close()
        srv.close()
        owner.close()


def test_a_loss_is_recorded_before_it_takes_effect_and_a_recovery_look_finds_it():
    # A worker of an elastic job that gives up a data server (dead, stopped or cut off)
    # writes it to the job's store first, then takes batches out of its plan's order; a
    # survivor's look at a recovery (``Loader.look_at_servers``) finds the record even where
    # the server's process lives and its connections are open (a stopped one), as long as
    # it is connected to the same process: a data server started again in its place is not
    # the lost one.
    import threading
    import types

    from torch.distributed import HashStore

    from gradsync.cluster.rendezvous import Store
    from gradsync.data.loader import Loader
    from gradsync.errors import PeerLostError

    store = Store.over(HashStore(), "job", 5.0)
    seen_lost = []  # what the writer's `lost` held when the record was written

    class Watched(Store):
        def set(self, key, value):
            seen_lost.append((key, set(writer.lost)))
            super().set(key, value)

    def worker(pids, losses=store, connected=True):
        loader = Loader.__new__(Loader)  # as Loader.__init__ leaves an elastic worker
        loader.rank = loader.ident = len(pids)
        loader.servers, loader.lost, loader._lost_lock = 2, set(), threading.Lock()
        loader._losses = losses
        if connected:  # (before the connections are made there is no ``peers``)
            loader.peers = [types.SimpleNamespace(host="d", pid=p, abandon=lambda: None)
                            for p in pids]
            loader.pollers = [types.SimpleNamespace(check_alive=lambda: None)] * 2
        return loader

    writer = worker([101, 102], losses=Watched.over(store.base, "job", 5.0))
    same, replaced = worker([101, 102]), worker([201, 102])
    writer._lose(0, PeerLostError("data server 0 has been silent for 2.0s", peer=None))
    assert seen_lost == [("data/lost/0/d/101", set())] and writer.lost == {0}
    same.look_at_servers()
    replaced.look_at_servers()
    assert same.lost == {0} and replaced.lost == set()
    # lost before it was reached (no connection to name a process): every process of that
    # index is given up at the next look
    worker([], connected=False)._lose(1, PeerLostError("refused", peer=None))
    replaced.look_at_servers()
    assert replaced.lost == {1}
    # a static job's Loader writes nothing (no recovery reads it)
    static = worker([101, 102], losses=None)
    static._lose(0, PeerLostError("gone", peer=None))
    assert static.lost == {0} and not store.check("data/lost/0/any")
