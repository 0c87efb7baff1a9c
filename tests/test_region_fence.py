"""Fenced regions (``transport/regions.py``): a write carries its writer's epoch, and the owner
refuses one below its fence before a byte of it is stored.

The header's fence field and its validation, the owner's check, the ``Fence`` that admits
stores a stripe at a time, and an owner with peers in this process: a write of an older epoch
refused whole, over TCP and from a peer that maps the region, and a fence raised while a
write's bytes are still arriving (which must not wait for the writer). The parameter server's
use of it, a stale primary woken mid-forward, is tested in tests/test_ps_replicas.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
import types
import uuid

import numpy as np
import pytest

from gradsync.errors import ProtocolError
from gradsync.transport import rma_frame as rf
from gradsync.transport.region_memory import Fence
from gradsync.transport.regions import (STRIPE_BYTES, Endpoint, RegionAccessError,
                                        StaleWriteError)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

SECRET = b"f" * 32
HOST = "h"  # every endpoint claims the same host, so allocated regions are mapped directly
READ, WRITE, ACC = rf.Op.READ, rf.Op.WRITE, rf.Op.ACCUMULATE


# --- pure logic ---------------------------------------------------------------------------

def test_a_fence_travels_in_the_header_of_a_write_or_an_accumulate_only():
    for op in (WRITE, ACC):
        req = rf.unpack(rf.pack(op, 9, 2, 16, 8, fence=rf.MAX_FENCE), rf.Op.REQUESTS)
        assert (req.op, req.request, req.region, req.offset, req.length, req.fence) == \
            (op, 9, 2, 16, 8, rf.MAX_FENCE)
    assert rf.unpack(rf.pack(WRITE, 1, 0, 0, 8, fence=0), rf.Op.REQUESTS).fence == 0
    assert rf.unpack(rf.pack(WRITE, 1, 0, 0, 8), rf.Op.REQUESTS).fence is None
    with pytest.raises(ValueError, match="only a write or an accumulate"):
        rf.pack(READ, 1, 0, 0, 8, fence=1)
    for bad in (-1, rf.MAX_FENCE + 1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="a fence is an epoch"):
            rf.pack(WRITE, 1, 0, 0, 8, fence=bad)


def _header(op, flags, fence):
    return rf.HEADER.pack(rf.MAGIC, rf.VERSION, op, flags, 1, 0, fence, 0, 8)


@pytest.mark.parametrize("raw, match", [
    (_header(READ, rf.FENCED, 1), "a read carries a fence"),
    (_header(rf.Op.CALL, rf.FENCED, 0), "a call carries a fence"),
    (_header(WRITE, 2, 0), "unknown region request flags 0x2"),
    (_header(WRITE, rf.FENCED | 4, 1), "unknown region request flags 0x5"),
    (_header(WRITE, 0, 3), "fence field 3 without the FENCED flag"),
    (_header(READ, 0, 3), "fence field 3"),
])
def test_untrustworthy_fences_drop_the_stream(raw, match):
    with pytest.raises(ProtocolError, match=match):
        rf.unpack(raw, rf.Op.REQUESTS)


_FENCED = types.SimpleNamespace(name="u", nbytes=64, fenced=True)
_OPEN = types.SimpleNamespace(name="g", nbytes=64, fenced=False)


@pytest.mark.parametrize("region, op, fence, level, refused", [
    (_FENCED, WRITE, 3, 3, None), (_FENCED, ACC, 4, 3, None), (_FENCED, WRITE, 0, 0, None),
    (_FENCED, WRITE, 2, 3, StaleWriteError), (_FENCED, ACC, 0, 1, StaleWriteError),
    (_FENCED, WRITE, None, 0, RegionAccessError),  # a fenced region takes no unfenced write
    (_OPEN, WRITE, None, 5, None),                 # an open one ignores the owner's fence
    (_OPEN, ACC, 5, 5, RegionAccessError),         # and takes no fence
])
def test_check_fence(region, op, fence, level, refused):
    got = rf.check_fence(rf.Request(op, 1, 0, 0, 8, fence), region, level, "owner 3")
    assert type(got) is (type(None) if refused is None else refused)
    if refused is StaleWriteError:
        assert (got.fence, got.level) == (fence, level)
        assert f"owner 3 refused a {rf.Op.NAMES[op]} into region 'u' of epoch {fence}: it " \
               f"is fenced at epoch {level}" in str(got)


def test_a_refusal_keeps_its_epochs_across_the_wire_and_drops_hostile_ones():
    exc = StaleWriteError.refusing("server 2", "write into region 'update.1'", 0, 4)
    back = rf.error_from(json.loads(rf.error_payload(exc)), peer=3)
    assert type(back) is StaleWriteError and (back.fence, back.level) == (0, 4)
    assert str(back) == str(exc)
    hostile = {"kind": "StaleWriteError", "message": "m", "fence": "0; rm", "level": 2**40}
    back = rf.error_from(hostile, peer=3)
    assert type(back) is StaleWriteError and (back.fence, back.level) == (None, None)


def test_raising_the_fence_refuses_at_once_and_waits_for_admitted_stores():
    fence = Fence()
    assert fence.enter(0)  # a store of epoch 0 is under way
    raised = threading.Event()
    riser = threading.Thread(target=lambda: (fence.raise_to(2), raised.set()))
    riser.start()
    deadline = time.monotonic() + 10
    while fence.level != 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert fence.level == 2
    assert not fence.enter(1)  # refused while the older store still runs
    assert not raised.is_set()  # raise_to has not returned: a store of epoch 0 is in flight
    assert fence.enter(2)       # the new epoch's stores go on meanwhile
    fence.leave()
    fence.leave()               # the store of epoch 0 ends
    assert raised.wait(10)
    riser.join(10)
    fence.raise_to(1)           # a fence never goes down
    assert fence.level == 2 and not fence.enter(1) and fence.enter(5)
    fence.leave()


# --- an owner and its peers in this process -------------------------------------------------

@pytest.fixture
def net():
    """Endpoint 0 owns regions; ``client(ident, direct)`` connects another endpoint to it."""
    job = f"t{uuid.uuid4().hex[:10]}"
    owner = Endpoint(0, HOST, SECRET, job, expect=set(range(1, 10)), timeout=10,
                     label="owner 0")
    made = []

    def client(ident: int, direct: bool = True):
        made.append(Endpoint(ident, HOST, SECRET, job, direct=direct, timeout=10))
        made.append(made[-1].connect(0, "127.0.0.1", owner.port, time.monotonic() + 5,
                                     label="owner"))
        return made[-1]

    yield owner, client
    for thing in reversed(made):
        thing.close()
    owner.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"gradsync-{job}-")]


@pytest.mark.parametrize("direct", [True, False])
def test_a_write_of_an_older_epoch_is_refused_whole_and_stores_nothing(net, direct):
    owner, client = net
    fenced = owner.allocate("u", (1000,), np.float32, fenced=True)
    open_ = owner.allocate("g", (1000,), np.float32)
    peer = client(1, direct)
    u, g = peer.region("u"), peer.region("g")
    assert u.fenced and not g.fenced
    assert (u.direct is not None) is direct  # mapped for reads all the same

    u.write(np.ones(1000, np.float32), fence=0)
    assert (fenced == 1).all()
    owner.raise_fence(2)
    for write in (lambda: u.write(np.full(1000, 7, np.float32), fence=1),
                  lambda: u.write(np.full(10, 7, np.float32), 400, fence=0),
                  lambda: u.accumulate(np.full(1000, 7, np.float32), fence=1)):
        with pytest.raises(StaleWriteError, match="fenced at epoch 2") as e:
            write()
        assert e.value.level == 2 and e.value.fence in (0, 1)
        assert (fenced == 1).all()  # not a byte of it
    u.write(np.full(1000, 3, np.float32), fence=2)
    u.accumulate(np.ones(1000, np.float32), fence=5)  # a writer ahead of the owner: taken
    assert (fenced == 4).all() and (u.read(np.zeros(1000, np.float32)) == 4).all()

    # A caller's mistakes are refused before anything is sent ...
    with pytest.raises(ValueError, match="is fenced: a write must carry"):
        u.write(np.zeros(1000, np.float32))
    with pytest.raises(ValueError, match="is not fenced"):
        g.write(np.zeros(1000, np.float32), fence=2)
    # ... and by the owner, from a peer that skips the check (the connection stays usable).
    with pytest.raises(RegionAccessError, match="carries no fence, but the region is fenced"):
        peer.request(WRITE, u.index, 0, np.zeros(1000, np.float32))
    with pytest.raises(RegionAccessError, match="carries fence 2, but the region is not"):
        peer.request(WRITE, g.index, 0, np.zeros(1000, np.float32), fence=2)
    assert (fenced == 4).all()
    g.write(np.full(1000, 9, np.float32))  # workers' writes need no epoch
    assert (open_ == 9).all()


def test_the_fence_rises_mid_write_without_waiting_for_the_writer(net):
    """A write of two stripes stops after its first: the owner stores that stripe (its fence
    still admits the write), then the fence rises at once, although the writer holds the
    request open, and the second stripe, arriving after, is refused and not stored."""
    owner, client = net
    fenced = owner.allocate("u", (2 * STRIPE_BYTES,), np.uint8, fenced=True)
    peer = client(1, direct=False)
    peer.sock.sendall(rf.pack(WRITE, 77, 0, 0, 2 * STRIPE_BYTES, fence=0) +
                      np.ones(STRIPE_BYTES, np.uint8).tobytes())
    deadline = time.monotonic() + 10
    while not (fenced[:STRIPE_BYTES] == 1).all() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (fenced[:STRIPE_BYTES] == 1).all()  # stored before the fence rose
    raised = threading.Event()
    threading.Thread(target=lambda: (owner.raise_fence(1), raised.set()), daemon=True).start()
    assert raised.wait(10), "raising the fence waited for the writer's bytes"
    peer.sock.sendall(np.full(STRIPE_BYTES, 2, np.uint8).tobytes())
    reply = rf.unpack(rf.recv_exact(peer.sock, rf.HEADER_SIZE), rf.Op.REPLIES)
    assert (reply.op, reply.request) == (rf.Op.ERROR, 77)
    error = rf.error_from(json.loads(rf.recv_exact(peer.sock, reply.length)), peer=0)
    assert type(error) is StaleWriteError and (error.fence, error.level) == (0, 1)
    assert (fenced[STRIPE_BYTES:] == 0).all()
    # The stream is still in step: the next write, of the new epoch, lands.
    peer.region("u").write(np.full(2 * STRIPE_BYTES, 5, np.uint8), fence=1)
    assert (fenced == 5).all()
