"""A data server with several producers (``gradsync/data/producers.py``): helper processes or
threads that prepare items at once, with the server's one cache, serve the same bytes as one
producer, each item once.

One ``DataServer`` in this process, its workers as connections taking items (the ``server``
fixture of tests/test_data.py); the launcher-level job with a data server killed is in
tests/test_data_multiprocess.py.
"""

import os

import numpy as np
import pytest

from gradsync.data import plan as P
from gradsync.data import producers as producers_module
from gradsync.errors import GradsyncError

from test_data import Numbers, Unreadable, _hello, server  # noqa: F401 (fixture)

SAMPLES, BATCH = 40, 4


def _serve_two_epochs(server, producers, producer):
    """Every item of both workers' streams over two epochs: {worker: [(ids, bytes)]}, the
    dataset and the server's counters."""
    data = Numbers(SAMPLES)
    srv, peers = server(data, workers=2, producers=producers, producer=producer)
    for p in peers.values():
        _hello(p, SAMPLES, prefetch=3)
    got = {w: [] for w in peers}
    for epoch in (0, 1):
        counts = {w: p.call("start", epoch=epoch, done=None)["batches"]
                  for w, p in peers.items()}
        for w, p in peers.items():
            first = len(got[w])
            for seq in range(first, first + counts[w]):
                info = p.call("take", seq=seq)
                buf = np.empty(info["nbytes"], np.uint8)
                p.region(f"slots.{w}").read(buf, info["slot"] * srv.slot_bytes)
                got[w].append((info["epoch"], info["ids"], buf.tobytes()))
    return got, data, peers[0].call("stats"), srv


@pytest.mark.parametrize("producer", ["process", "thread"])
def test_two_producers_serve_the_bytes_of_one_each_item_once_with_one_cache(server, producer):
    one, _, _, _ = _serve_two_epochs(server, 1, "process")
    two, data, stats, srv = _serve_two_epochs(server, 2, producer)
    assert two == one  # the same items, in the same order, byte for byte
    for epoch in (0, 1):
        for w in (0, 1):
            planned = P.worker_batches(P.plan(SAMPLES, BATCH, 1, epoch, 1, 2), w)
            assert [ids for e, ids, _ in two[w] if e == epoch] == [b.ids.tolist()
                                                                  for b in planned]
    # One cache for both producers: each sample decoded once, epoch 1 all hits.
    assert (stats["misses"], stats["hits"], stats["samples"]) == (SAMPLES, SAMPLES, SAMPLES)
    assert len(srv._producers) == 2
    if producer == "process":
        # Decoded in the helper processes (two of them); the server's own process read only
        # sample 0, for the batch's layout.
        assert data.decoded == [0]
        pids = {h.process.pid for h in srv._helpers}
        assert len(pids) == 2 and os.getpid() not in pids
    else:
        assert sorted(data.decoded) == [0] + list(range(SAMPLES))


def test_a_sample_that_fails_in_a_producer_process_fails_the_take_and_names_it(server):
    srv, peers = server(Unreadable(12), workers=1, batch_size=4, producers=2)
    _hello(peers[0], 12)
    peers[0].call("start", epoch=0, done=None)
    with pytest.raises(GradsyncError, match="OSError: unreadable file"):
        for seq in range(3):
            peers[0].call("take", seq=seq)


def test_a_producer_process_ends_when_its_pipe_does(server):
    srv, peers = server(Numbers(SAMPLES), workers=1, producers=2)
    helper = srv._helpers[0]
    helper.conn.close()  # as a killed server's end of the pipe
    helper.process.join(10)
    assert helper.process.exitcode == 0


def test_the_producers_are_checked():
    from gradsync.data.server import DataServer

    with pytest.raises(ValueError, match="at least 1 producer"):
        DataServer(0, 1, 1, None, None, 4, 0, producers=0)
    with pytest.raises(ValueError, match="producer must be one of"):
        DataServer(0, 1, 1, None, None, 4, 0, producers=2, producer="fiber")
    assert producers_module.KINDS == ("process", "thread")
