"""Batches of samples whose shapes vary (``gradsync/data/collate.py``): padding and packing
round trips without processes, a data server with a collate and its workers as threads, and
the launcher-level check (2 workers, 2 data servers, packed token sequences, every sample
exactly once) in tests/test_data_multiprocess.py.
"""

import time
import uuid

import numpy as np
import pytest
import torch

from gradsync.data import Pack, Pad
from gradsync.data import plan as P
from gradsync.data.cache import Cache
from gradsync.data.server import DataServer, Source
from gradsync.transport.regions import Endpoint


def _round_trip(collate, samples, batch_size=None):
    """What a worker gets for ``samples``: packed as a server does into a slot of the
    collate's size, unpacked from a copy."""
    spec = collate.learn(samples[0])
    slot = np.full(collate.slot_bytes(spec, batch_size or len(samples)), 0xAB, np.uint8)
    nbytes = collate.pack(spec, samples, list(range(len(samples))), slot)
    assert 0 < nbytes <= len(slot)
    return collate.unpack(spec, slot[:nbytes].copy(), len(samples))


def test_padding_goes_to_the_batchs_longest_and_its_lengths_undo_it():
    rng = np.random.default_rng(0)
    lengths = [3, 0, 7, 1, 7, 2]
    samples = [{"tokens": rng.integers(0, 50_000, n).astype(np.int32),
                "vectors": rng.random((n, 2), dtype=np.float32), "label": i}
               for i, n in enumerate(lengths)]
    batch, got = _round_trip(Pad(16, value=-1), samples, batch_size=8)
    assert got.tolist() == lengths
    assert batch["tokens"].shape == (6, 7) and batch["tokens"].dtype == torch.int32
    assert batch["vectors"].shape == (6, 7, 2) and batch["label"].tolist() == list(range(6))
    mask = torch.arange(7)[None, :] < got[:, None]
    assert (batch["tokens"][~mask] == -1).all() and (batch["vectors"][~mask] == -1).all()
    for sample, leaves in zip(samples, Pad.split(batch, got)):
        # The leaves in the sample's order: tokens, vectors, label.
        np.testing.assert_array_equal(leaves[0], sample["tokens"])
        np.testing.assert_array_equal(leaves[1], sample["vectors"])
        assert leaves[2] == sample["label"]


def test_padding_refuses_a_sample_too_long_or_of_another_kind():
    pad = Pad(4)
    spec = pad.learn(np.arange(2))
    slot = np.zeros(pad.slot_bytes(spec, 2), np.uint8)
    with pytest.raises(ValueError, match="sample 11 is 5 long, more than Pad's max_length 4"):
        pad.pack(spec, [np.arange(2), np.arange(5)], [10, 11], slot)
    with pytest.raises(ValueError, match="sample 11 has leaves"):
        pad.pack(spec, [np.arange(2), np.arange(2.0)], [10, 11], slot)
    two = pad.learn((np.arange(2), np.arange(2)))
    with pytest.raises(ValueError, match="one length per sample"):
        pad.pack(two, [(np.arange(2), np.arange(3))], [7], np.zeros(pad.slot_bytes(two, 1),
                                                                        np.uint8))


def test_the_worked_example_of_packing():
    batch = _round_trip(Pack(5, separator=0, value=9),
                        [np.array([1, 2]), np.array([3, 4, 5]), np.array([], np.int64),
                         np.array([6])])
    assert batch["tokens"].tolist() == [[1, 2, 0, 9, 9], [3, 4, 5, 0, 0], [6, 0, 9, 9, 9]]
    assert batch["row"].tolist() == [0, 1, 1, 2]
    assert batch["start"].tolist() == [0, 0, 4, 0]
    assert batch["length"].tolist() == [2, 3, 0, 1]


@pytest.mark.parametrize("separator", [None, -1])
def test_packing_delivers_every_token_once_and_no_sample_spans_rows(separator):
    rng = np.random.default_rng(1)
    width = 16
    top = width - (separator is not None)
    lengths = rng.integers(0, top + 1, 40).tolist() + [0, top, 0]
    samples = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]
    batch = _round_trip(Pack(width, separator=separator), samples)
    tokens = batch["tokens"]
    assert tokens.shape[1] == width and tokens.shape[0] <= len(samples)
    back = Pack.split(batch)
    assert [t.tolist() for t in back] == [s.tolist() for s in samples]
    # Each sample's room (with its separator) lies in one row, and no two overlap.
    taken = torch.zeros_like(tokens, dtype=torch.bool)
    for r, s, n in zip(batch["row"].tolist(), batch["start"].tolist(),
                       batch["length"].tolist()):
        end = s + n + (separator is not None)
        assert end <= width
        assert not taken[r, s:end].any()
        taken[r, s:end] = True
        if separator is not None:
            assert tokens[r, s + n] == separator
    # Every sample's tokens once, and nothing but padding elsewhere.
    assert int(taken.sum()) == sum(lengths) + len(lengths) * (separator is not None)
    assert (tokens[~taken] == 0).all()


def test_packing_refuses_a_sample_longer_than_a_row():
    pack = Pack(4, separator=-1)
    spec = pack.learn([1, 2])  # a list of ints is a sequence too
    slot = np.zeros(pack.slot_bytes(spec, 2), np.uint8)
    with pytest.raises(ValueError, match="sample 3 has 4 tokens and a separator, more than a "
                                         "row of 4: Pack never splits"):
        pack.pack(spec, [[1, 2], [1, 2, 3, 4]], [2, 3], slot)
    with pytest.raises(TypeError, match="tokens"):
        pack.learn(np.zeros(3, np.float32))


class Texts:
    """Sample i: ``i % 6`` tokens (0 .. 5), ``10 * i + k``."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        return np.arange(i % 6) + 10 * i


def test_a_data_server_serves_packed_batches_of_whole_samples():
    # One DataServer with the collate, its worker a thread: the slot is the collate's size,
    # each take's ids are the plan's batch and its rows hold exactly those samples.
    job = f"t{uuid.uuid4().hex[:10]}"
    ep = Endpoint(100, "h", b"s" * 32, job, expect={0}, timeout=20)
    pack = Pack(8, separator=-1)
    srv = DataServer(0, 1, 1, ep, Source(Texts(), None, 1, Cache(1 << 20), pack), 4, 1, 20)
    client = Endpoint(0, "h", b"s" * 32, job, timeout=20)
    peer = client.connect(100, "127.0.0.1", ep.port, time.monotonic() + 10)
    try:
        with pytest.raises(Exception, match="collate"):  # a worker without the collate
            peer.call("hello", batch_size=4, seed=1, samples=30, prefetch=2)
        hello = peer.call("hello", batch_size=4, seed=1, samples=30, prefetch=2,
                          collate=pack.describe())
        assert hello["slot_bytes"] == pack.slot_bytes(hello["layout"], 4)
        planned = P.plan(30, 4, 1, 0, 1, 1)
        assert peer.call("start", epoch=0)["batches"] == len(planned)
        seen = []
        for seq, b in enumerate(planned):
            info = peer.call("take", seq=seq)
            assert info["ids"] == b.ids.tolist()
            buf = np.empty(info["nbytes"], np.uint8)
            peer.region("slots.0").read(buf, info["slot"] * hello["slot_bytes"])
            batch = pack.unpack(hello["layout"], buf, len(info["ids"]))
            for i, tokens in zip(info["ids"], Pack.split(batch)):
                assert tokens.tolist() == (np.arange(i % 6) + 10 * i).tolist()
            seen += info["ids"]
        assert sorted(seen) == list(range(30))
    finally:
        peer.close()
        client.close()
        srv.close()
        ep.close()
