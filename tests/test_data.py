"""Data servers without processes: the plan's exactly-once rule, the layout, the cache, and one
``DataServer`` with its workers as threads (credits, order, cache hits, augmentation).

The launcher-level checks (real ranks, resume across jobs) are tests/test_data_multiprocess.py.
"""

import itertools
import time
import uuid

import numpy as np
import pytest
import torch

from gradsync.cluster.launch_env import detect
from gradsync.data import plan as P
from gradsync.data import server as server_module
from gradsync.data.cache import Cache
from gradsync.data.layout import Layout, leaves_of
from gradsync.data.server import DataServer, Source
from gradsync.errors import CollectiveMismatchError, ConfigError, GradsyncError
from gradsync.transport.regions import Endpoint

SECRET = b"s" * 32


# --- the plan --------------------------------------------------------------------------------

def _ids(batches):
    return np.concatenate([b.ids for b in batches]) if batches else np.array([], np.int64)


def test_every_sample_is_in_exactly_one_batch_of_exactly_one_worker():
    for samples, servers, workers, batch_size in itertools.product(
            [0, 1, 7, 103, 256], [1, 2, 3], [1, 2, 3, 4], [1, 4, 10]):
        batches = P.plan(samples, batch_size, seed=3, epoch=1, servers=servers, workers=workers)
        assert sorted(_ids(batches).tolist()) == list(range(samples))
        assert [b.index for b in batches] == list(range(len(batches)))
        per_worker = [P.worker_batches(batches, w) for w in range(workers)]
        assert sorted(_ids([b for bs in per_worker for b in bs]).tolist()) == \
            list(range(samples))
        for b in batches:
            assert 0 < len(b.ids) <= batch_size
            assert (b.ids % servers == b.server).all()  # a server serves only its own samples
            assert b.worker == b.index % workers
        counts = [len(bs) for bs in per_worker]
        assert max(counts) - min(counts) <= 1


def test_the_worked_example_of_the_module_docstring(monkeypatch):
    monkeypatch.setattr(P, "order", lambda n, seed, epoch: np.array([7, 2, 9, 4, 0, 5, 3, 8, 1, 6]))
    batches = P.plan(10, 2, 0, 0, servers=2, workers=2)
    assert [(b.ids.tolist(), b.server, b.worker) for b in batches] == [
        ([2, 4], 0, 0), ([7, 9], 1, 1), ([0, 8], 0, 0), ([5, 3], 1, 1), ([6], 0, 0),
        ([1], 1, 1)]


def test_the_order_is_fixed_by_the_seed_and_differs_between_epochs_and_seeds():
    a = P.plan(50, 4, seed=1, epoch=0, servers=2, workers=3)
    b = P.plan(50, 4, seed=1, epoch=0, servers=2, workers=3)
    assert [x.ids.tolist() for x in a] == [x.ids.tolist() for x in b]
    other_epoch = P.plan(50, 4, seed=1, epoch=1, servers=2, workers=3)
    other_seed = P.plan(50, 4, seed=2, epoch=0, servers=2, workers=3)
    assert _ids(a).tolist() != _ids(other_epoch).tolist()
    assert _ids(a).tolist() != _ids(other_seed).tolist()
    # The number of workers deals the same batches differently; it does not change them.
    one = P.plan(50, 4, seed=1, epoch=0, servers=2, workers=1)
    assert [x.ids.tolist() for x in one] == [x.ids.tolist() for x in a]


@pytest.mark.parametrize("servers, workers", [(1, 1), (2, 3), (3, 2)])
def test_a_done_mask_leaves_exactly_the_rest_in_the_same_order(servers, workers):
    full = P.plan(60, 4, seed=5, epoch=2, servers=servers, workers=workers)
    done = np.zeros(60, bool)
    done[_ids(full[:7])] = True
    rest = P.plan(60, 4, seed=5, epoch=2, servers=servers, workers=workers, done=done)
    assert sorted(_ids(rest).tolist()) == sorted(set(range(60)) - set(np.flatnonzero(done)))
    # Each server's remaining samples come in the order they had in the full plan.
    for s in range(servers):
        before = [i for i in _ids([b for b in full if b.server == s]).tolist() if not done[i]]
        assert _ids([b for b in rest if b.server == s]).tolist() == before
    # Resumed on another number of servers and workers: still exactly the rest.
    other = P.plan(60, 4, seed=5, epoch=2, servers=servers + 1, workers=workers + 2, done=done)
    assert sorted(_ids(other).tolist()) == sorted(_ids(rest).tolist())


def test_masks_pack_and_unpack_and_bad_plans_are_refused():
    mask = np.random.default_rng(0).random(1001) < 0.3
    assert (P.unpack_mask(P.pack_mask(mask), 1001) == mask).all()
    with pytest.raises(ValueError):
        P.plan(10, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="done mask"):
        P.plan(10, 2, 0, 0, 1, 1, done=np.zeros(9, bool))


# --- the layout and the cache ----------------------------------------------------------------

def test_a_batch_packs_leaf_major_and_unpacks_into_tensors_that_view_the_buffer():
    samples = [{"x": torch.full((2, 3), float(i)), "y": (i, 0.5 * i, np.int16(i))}
               for i in range(3)]
    layout = Layout.of(samples[0])
    assert layout.sample_bytes == 24 + 8 + 8 + 2
    again = Layout(layout.describe())
    buf = np.zeros(5 * layout.sample_bytes, np.uint8)
    n = again.pack([leaves_of(s) for s in samples], buf)
    assert n == 3 * layout.sample_bytes
    assert (buf[:72].view(np.float32) == np.repeat([0, 1, 2], 6)).all()  # leaf x, 3 rows
    batch = again.unpack(buf[:n], 3)
    assert batch["x"].shape == (3, 2, 3) and batch["x"].dtype == torch.float32
    assert batch["y"][0].tolist() == [0, 1, 2] and batch["y"][0].dtype == torch.int64
    assert batch["y"][1].tolist() == [0, 0.5, 1.0] and batch["y"][2].dtype == torch.int16
    buf[:4] = np.frombuffer(np.float32(9).tobytes(), np.uint8)
    assert batch["x"][0, 0, 0] == 9  # a view, not a copy


def test_a_sample_that_does_not_fit_the_layout_is_named():
    layout = Layout.of((np.zeros(3, np.float32), 1))
    with pytest.raises(ValueError, match="sample 17"):
        layout.check(leaves_of((np.zeros(4, np.float32), 1)), 17)
    with pytest.raises(TypeError):
        Layout.of({"x": "text"})


def test_a_transform_of_one_argument_is_given_no_generator():
    # transform(sample) (a torchvision transform's call) skips the generator, whose seeding
    # is most of a cheap sample's cost; transform(sample, rng) gets it, as before.
    class Flip:
        def __call__(self, sample):
            return -sample

    def draws(sample, rng=None):
        return sample + rng.integers(0, 1000)

    one = Source([np.float32(3)], Flip(), 1, Cache(0))
    two = Source([np.float32(3)], draws, 1, Cache(0))
    assert (one.rng, two.rng) == (False, True)
    assert one.served(np.float32(3), 0, 2) == -3
    assert two.served(np.float32(3), 0, 2) == 3 + np.random.default_rng([1, 2, 0]).integers(
        0, 1000)
    assert server_module.takes_rng(lambda *args: args) and server_module.takes_rng(np.add)
    assert not server_module.takes_rng(lambda sample: sample)


def test_the_cache_keeps_until_full_and_counts():
    cache = Cache(100)
    assert cache.get(1) is None
    sample = np.zeros(10, np.float32)  # 40 bytes
    assert cache.put(1, sample, 40) and cache.put(2, sample, 40)
    assert not cache.put(3, sample, 40)  # over budget: not kept, nothing evicted
    sample[:] = 5  # the dataset reuses its buffer: the cache kept a copy
    assert (cache.get(1) == 0).all() and cache.get(3) is None
    assert cache.counters() == {"hits": 1, "misses": 2, "samples": 2, "bytes": 80,
                                "budget": 100}
    assert not Cache(0).put(1, sample, 40)


# --- the role in the launcher's variables -----------------------------------------------------

def _env(rank, size, **more):
    return {"GRADSYNC_RANK": str(rank), "GRADSYNC_SIZE": str(size),
            "GRADSYNC_STORE_ADDR": "127.0.0.1", "GRADSYNC_STORE_PORT": "29500", **more}


def test_data_servers_are_the_last_ranks_and_outside_the_training_job():
    worker = detect(_env(1, 6, GRADSYNC_SERVERS="1", GRADSYNC_DATA_SERVERS="2"))
    assert (worker.size, worker.workers, worker.data_servers) == (4, 3, 2)
    assert not worker.is_server and not worker.is_data_server
    ps = detect(_env(3, 6, GRADSYNC_SERVERS="1", GRADSYNC_DATA_SERVERS="2"))
    assert ps.is_server and ps.server_rank == 0 and not ps.is_data_server
    data = detect(_env(5, 6, GRADSYNC_SERVERS="1", GRADSYNC_DATA_SERVERS="2"), data_server=True)
    assert data.is_data_server and data.data_server_rank == 1 and not data.is_server
    with pytest.raises(ConfigError, match="build the Loader before gradsync.init"):
        detect(_env(4, 6, GRADSYNC_DATA_SERVERS="2"))
    for bad in ("6", "-1", "x"):
        with pytest.raises(ConfigError, match="GRADSYNC_DATA_SERVERS"):
            detect(_env(0, 6, GRADSYNC_DATA_SERVERS=bad))
    with pytest.raises(ConfigError, match="GRADSYNC_DATA_SERVERS"):
        detect(_env(0, 6, GRADSYNC_SERVERS="3", GRADSYNC_DATA_SERVERS="3"))
    torchrun = detect({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                       "GRADSYNC_DATA_SERVERS": "1"})
    assert (torchrun.size, torchrun.data_servers) == (2, 1)


def test_the_run_command_starts_data_servers_after_every_other_rank():
    from gradsync.run.cli import _spec, build_parser

    parser = build_parser()
    args = parser.parse_args(["run", "-np", "2", "--servers", "1", "--data-servers", "3",
                              "python", "x.py"])
    spec = _spec(args.run_parser, args)
    assert (spec.num_proc, spec.servers, spec.data_servers, spec.size) == (2, 1, 3, 6)
    with pytest.raises(SystemExit):
        _spec(args.run_parser, parser.parse_args(["run", "-np", "2", "--data-servers", "-1",
                                                  "python", "x.py"]))


# --- one data server, workers as threads -----------------------------------------------------

class Numbers:
    """Sample i is ``(i as 2 float32, i)``; counts how often each is decoded."""

    def __init__(self, n):
        self.n, self.decoded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.decoded.append(i)
        return (np.full(2, i, np.float32), i)


class Unreadable(Numbers):
    """``Numbers`` whose sample 5 cannot be read."""

    def __getitem__(self, i):
        if i == 5:
            raise OSError("unreadable file")
        return super().__getitem__(i)


def _shift(sample, rng):
    return (sample[0] + np.float32(rng.integers(1, 1000)), sample[1])


@pytest.fixture
def server():
    """``make(dataset, **kw)`` -> (server, {worker: peer}); torn down after the test."""
    job = f"t{uuid.uuid4().hex[:10]}"
    made = []
    idents = itertools.count(100)  # one endpoint id (and shared-memory names) per server

    def make(dataset, workers=2, batch_size=4, seed=1, servers=1, index=0, cache=1 << 20,
             transform=_shift, producers=1, producer="process", direct=True):
        # ``direct=False``: the workers read over TCP, as from another host.
        ident = next(idents)
        ep = Endpoint(ident, "h", SECRET, job, expect=set(range(workers)), timeout=20)
        made.append(ep)
        srv = DataServer(index, servers, workers, ep, Source(dataset, transform, seed,
                                                              Cache(cache)), batch_size, seed, 20,
                         producers=producers, producer=producer)
        made.append(srv)
        peers = {}
        for w in range(workers):
            client = Endpoint(w, "h", SECRET, job, timeout=20, direct=direct)
            made.append(client)
            peers[w] = client.connect(ident, "127.0.0.1", ep.port, time.monotonic() + 10)
            made.append(peers[w])
        return srv, peers

    yield make
    for thing in reversed(made):
        thing.close()


def _hello(peer, n, batch_size=4, seed=1, prefetch=2):
    return peer.call("hello", batch_size=batch_size, seed=seed, samples=n, prefetch=prefetch)


def _take(peer, worker, seq, slot_bytes, layout):
    info = peer.call("take", seq=seq)
    buf = np.empty(info["nbytes"], np.uint8)
    peer.region(f"slots.{worker}").read(buf, info["slot"] * slot_bytes)
    return info, layout.unpack(buf, len(info["ids"]))


def _wait_for(cond, seconds=5.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


class _Looks:
    """Every look of a data server's producer at a stream (``_Stream.can_produce``), with
    whether it found the stream waiting for credit. A test that asserts the producer did
    *not* go on waits until the producer has looked, after a point, and found no credit,
    instead of sleeping and hoping it had looked."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = server_module._Stream.can_produce

        def look(stream):
            ready = original(stream)
            self.calls.append((stream, not ready and stream.waits_for_credit()))
            return ready

        monkeypatch.setattr(server_module._Stream, "can_produce", look)

    def mark(self) -> int:
        return len(self.calls)

    def out_of_credit(self, streams, since: int) -> bool:
        """Waits until, after look number ``since``, the producer has found each of
        ``streams`` out of credit; whether it did within 5 s."""
        return _wait_for(lambda: all(any(s is stream and short
                                          for s, short in self.calls[since:])
                                     for stream in streams))


def test_a_server_runs_at_most_prefetch_batches_ahead_of_each_worker(server, monkeypatch):
    looks = _Looks(monkeypatch)
    srv, peers = server(Numbers(40), workers=2)
    replies = {w: _hello(p, 40, prefetch=2) for w, p in peers.items()}
    layout = Layout(replies[0]["layout"])
    for w, p in peers.items():
        assert p.call("start", epoch=0, done=None)["batches"] == 5
    assert _wait_for(lambda: all(s.produced == 2 for s in srv.streams.values()))
    assert looks.out_of_credit(srv.streams.values(), looks.mark())
    assert [s.produced for s in srv.streams.values()] == [2, 2]  # no credit: it waits
    _take(peers[0], 0, 0, srv.slot_bytes, layout)
    assert looks.out_of_credit([srv.streams[0]], looks.mark())
    assert srv.streams[0].produced == 2  # item 0 is still being read
    _take(peers[0], 0, 1, srv.slot_bytes, layout)  # releases item 0: one more credit
    assert _wait_for(lambda: srv.streams[0].produced == 3)
    time.sleep(0.1)
    assert srv.streams[0].produced == 3 and srv.streams[1].produced == 2


def test_a_stream_taken_over_the_connection_is_not_looked_at_for_an_ack(server):
    # A polling worker's ack wakes nobody, so the producer naps and looks again while a
    # stream waits for one (0.1-2 ms naps). A worker that takes the bytes over TCP frees its
    # slots with its next take, which wakes the producer: out of credit, its stream makes
    # the producer nap no more (a nap and the GIL taken back for nothing).
    srv, peers = server(Numbers(40), workers=2, direct=False)
    for peer in peers.values():
        _hello(peer, 40, prefetch=2)
        peer.call("start", epoch=0, done=None)
    assert _wait_for(lambda: all(s.produced == 2 for s in srv.streams.values()))
    info, _ = peers[0].call_into("take", lambda r: np.empty(r["attached"], np.uint8), seq=0,
                                 send=True)
    assert info["seq"] == 0
    assert _wait_for(lambda: srv.streams[0].produced == 2 and srv.streams[0].claimed == 2)
    assert not srv.streams[0].waits_for_credit()  # item 0 is held: freed by the next take
    assert srv.streams[1].waits_for_credit()  # no take yet: an ack in its table may come


def test_batches_follow_the_plan_with_augmentation_after_the_cache(server):
    data = Numbers(21)
    srv, peers = server(data, workers=2)
    layout = Layout(_hello(peers[0], 21)["layout"])
    _hello(peers[1], 21)
    seen = {0: [], 1: []}
    values = {}
    for epoch in range(2):
        batches = P.plan(21, 4, seed=1, epoch=epoch, servers=1, workers=2)
        for w, p in peers.items():
            p.call("start", epoch=epoch, done=None)
        for w in (0, 1):
            mine = P.worker_batches(batches, w)
            for b in mine:
                info, (x, ids) = _take(peers[w], w, len(seen[w]), srv.slot_bytes, layout)
                seen[w].append(info["index"])
                assert info["index"] == b.index and ids.tolist() == b.ids.tolist()
                bump = [np.random.default_rng([1, epoch, i]).integers(1, 1000) for i in b.ids]
                assert (x[:, 0].numpy() == b.ids + np.asarray(bump, np.float32)).all()
                for i, v in zip(ids.tolist(), x[:, 0].tolist()):
                    values.setdefault(i, []).append(v)
    stats = peers[0].call("stats")
    # Epoch 0 decoded every sample once (plus sample 0 for the layout); epoch 1 hit the cache.
    assert stats["misses"] == 21 and stats["hits"] == 21 and stats["batches"] == 12
    assert sorted(data.decoded) == sorted(list(range(21)) + [0])
    assert all(len(set(v)) == 2 for v in values.values())  # augmentation differs per epoch


def test_a_small_cache_budget_holds_what_fits_and_misses_the_rest(server):
    srv, peers = server(Numbers(20), workers=1, cache=5 * 16)  # a sample is 16 bytes
    layout = Layout(_hello(peers[0], 20)["layout"])
    for epoch in range(2):
        peers[0].call("start", epoch=epoch, done=None)
    for seq in range(10):
        _take(peers[0], 0, seq, srv.slot_bytes, layout)
    c = peers[0].call("stats")
    assert (c["samples"], c["bytes"], c["hits"], c["misses"]) == (5, 80, 5, 35)


def test_workers_that_disagree_are_refused(server):
    srv, peers = server(Numbers(10), workers=2)
    with pytest.raises(CollectiveMismatchError, match="batch_size"):
        _hello(peers[0], 10, batch_size=5)
    with pytest.raises(CollectiveMismatchError, match="order"):  # the server cuts "servers"
        peers[0].call("hello", batch_size=4, seed=1, samples=10, prefetch=2, order="global")
    _hello(peers[0], 10)
    _hello(peers[1], 10)
    done = np.zeros(10, bool)
    done[3] = True
    peers[0].call("start", epoch=0, done=P.pack_mask(done))
    with pytest.raises(CollectiveMismatchError, match="another state"):
        peers[1].call("start", epoch=0, done=None)
    with pytest.raises(ValueError, match="item 7"):
        peers[0].call("take", seq=7)


def test_a_failing_sample_fails_the_take_and_names_the_batch(server):
    srv, peers = server(Unreadable(12), workers=1, batch_size=12)
    _hello(peers[0], 12, batch_size=12)
    peers[0].call("start", epoch=0, done=None)
    with pytest.raises(GradsyncError, match="unreadable file"):
        peers[0].call("take", seq=0)


def test_the_server_is_done_once_every_worker_has_gone(server):
    srv, peers = server(Numbers(10), workers=2)
    _hello(peers[0], 10)
    peers[0].close()
    # The server has taken worker 0's end: its handler, which sets ``done`` when the
    # server is done, has run to its end once its lock is free.
    assert _wait_for(lambda: srv.streams[0].gone)
    with srv._cv:
        assert not srv.done.is_set()  # worker 1 has not even come yet
    peers[1].close()
    assert srv.done.wait(5)


def test_batches_handed_over_from_a_lost_server_join_the_end_of_the_stream(server):
    srv, peers = server(Numbers(30), workers=1, servers=2, index=1)
    layout = Layout(_hello(peers[0], 30)["layout"])
    own = peers[0].call("start", epoch=0, done=None)["batches"]
    # Server 0's batches (even sample ids) handed to this server by the worker.
    assert peers[0].call("start", epoch=0, items=[[100, [0, 2, 4]], [101, [6]]])["batches"] == 2
    with pytest.raises(ValueError, match="outside"):
        peers[0].call("start", epoch=0, items=[[102, [30]]])
    got = [_take(peers[0], 0, seq, srv.slot_bytes, layout)[0] for seq in range(own + 2)]
    assert [g["index"] for g in got[own:]] == [100, 101]
    assert got[own]["ids"] == [0, 2, 4] and got[-1]["ids"] == [6]


def test_a_new_generation_drops_the_untaken_items_and_replans_for_its_workers(server):
    # 2 workers; worker 0 takes 2 of its batches of epoch 0 (the server has prepared more),
    # then the job re-forms with worker 0 alone: its stream goes on at item 2 with the plan of
    # one worker over the samples not in those 2 batches (worker 1's share included).
    srv, peers = server(Numbers(40), workers=2)
    layout = Layout(_hello(peers[0], 40, prefetch=3)["layout"])
    _hello(peers[1], 40, prefetch=3)
    for p in peers.values():
        p.call("start", epoch=0, done=None)
    old = P.worker_batches(P.plan(40, 4, 1, 0, 1, 2), 0)
    taken = [_take(peers[0], 0, seq, srv.slot_bytes, layout)[0]["ids"] for seq in (0, 1)]
    assert taken == [old[0].ids.tolist(), old[1].ids.tolist()]
    assert _wait_for(lambda: srv.streams[0].produced == 4)  # items 2 and 3 of the old plan
    done = np.zeros(40, bool)
    done[taken[0] + taken[1]] = True
    mask = P.pack_mask(done)
    with pytest.raises(ValueError, match="at item 5"):  # past the items it holds
        peers[0].call("start", epoch=0, done=mask, generation=1, workers=1, index=0, seq=5)
    reply = peers[0].call("start", epoch=0, done=mask, generation=1, workers=1, index=0, seq=2)
    new = P.worker_batches(P.plan(40, 4, 1, 0, 1, 1, done), 0)
    assert reply["batches"] == len(new) == 8
    got = [_take(peers[0], 0, 2 + k, srv.slot_bytes, layout)[0]["ids"] for k in range(8)]
    assert got == [b.ids.tolist() for b in new]
    assert sorted(sum(taken + got, [])) == list(range(40))
