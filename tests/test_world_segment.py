"""The questions the front doors ask ``World`` about the host's shared segment, in one
process: answered from the segment (a real one-rank ``ShmGroup``), and all "no" without one.
Whole jobs that take these answers run in test_express, test_torch_optimizer, test_negotiation
and test_shm_shared."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from gradsync.collectives.ops import ReduceOp
from gradsync.connect.world import World
from gradsync.transport import host_segment

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")


@pytest.fixture
def group():
    name = f"gradsync-test-world-{os.getpid()}"
    segment = host_segment.create_group_segment(name, 1, 4096)
    host_segment.unlink_segment(name)
    group = host_segment.ShmGroup(segment, 0, small_bytes=1024)
    yield group
    group.close()


def _world(group):
    """A stand-in with what World's questions read: its handle on the segment."""
    return types.SimpleNamespace(shm_group=group)


def test_the_small_road_is_the_segments_compiled_call_within_its_one_step_size(group):
    world, f32 = _world(group), np.dtype(np.float32)
    road = World.small_road(world, ReduceOp.SUM, f32, 1024)
    if not group.fast:  # no compiler here: the compiled road is not built
        assert road is None
        return
    assert road is not None
    run, code = road
    assert run == group.allreduce_express and code == group.fast_code(ReduceOp.SUM, f32)
    assert World.small_road(world, ReduceOp.SUM, f32, 1025) is None  # past the one-step road
    assert World.small_road(world, ReduceOp.SUM, f32, 0) is None
    assert World.small_road(world, ReduceOp.SUM, np.dtype(np.float16), 8) is None  # no kernel
    assert World.small_road(world, ReduceOp.ADASUM, f32, 8) is None


def test_sharing_is_answered_by_the_segment(group):
    world = _world(group)
    assert World.shared_above(world) == group.small_bytes == 1024
    # One local rank: nobody to share with, so no shared buffer, and nothing is shared.
    assert World.shared_buffer(world, 64) is None
    assert not World.is_shared(world, np.zeros(16, np.uint8))
    World.release_shared(world, 12345)  # an address never handed out: nothing to forget
    group.moved = 300
    assert World.host_traffic(world) == (id(group), 300)


def test_without_a_segment_every_answer_is_no():
    world = _world(None)
    assert World.small_road(world, ReduceOp.SUM, np.dtype(np.float32), 8) is None
    assert World.shared_above(world) is None
    assert World.shared_buffer(world, 64) is None
    assert not World.is_shared(world, np.zeros(16, np.uint8))
    assert World.host_traffic(world) is None
    World.release_shared(world, 12345)


def test_a_buffers_release_waits_for_its_owner_and_does_not_keep_the_world(group):
    """A DistributedOptimizer bucket's shared buffer is released when the bucket's tensor goes:
    the finalizer holds the segment, so a closed sub-world is not kept alive by its buckets."""
    import gc
    import weakref

    class Stand:  # weakly referable, unlike a SimpleNamespace
        shm_group = group

    released: list = []
    group.release = released.append
    world, owner = Stand(), Stand()
    World.release_shared_with(world, owner, 4096)
    gone = weakref.ref(world)
    del world
    gc.collect()
    assert gone() is None and released == []
    del owner
    gc.collect()
    assert released == [4096]
