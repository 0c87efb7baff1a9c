"""Which tensors the torch backend moves into shared memory (``gradsync/torch/backend/sharing.py``).

A tensor reduced in place from its storage's first byte, of at least the World's
``adopt_above`` bytes, moves the second time the same tensor object comes back (DDP's
buckets); a tensor made afresh each time never does; a storage shared already is adopted as it
is; a move that torch refuses leaves the tensor where it is, once. A stand-in World records
what the backend hands it: the segment's side is tests/test_shm_shared.py's.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from gradsync.torch.backend import sharing as sharing_module
from gradsync.torch.backend.sharing import Sharing


class _World:
    """What ``Sharing`` asks of a World: the size from which it adopts, and the adoption."""

    def __init__(self, above: "int | None" = 1024):
        self.above, self.adopted = above, []

    def adopt_above(self):
        return self.above

    def adopt_shared(self, address: int, fd: int, nbytes: int) -> bool:
        self.adopted.append((address, fd, nbytes))
        return True


def _fd_file(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_the_same_tensor_moves_the_second_time_and_its_views_follow():
    world = _World()
    sharing = Sharing(world)
    bucket = torch.arange(512, dtype=torch.float32)  # 2 KiB
    view = bucket[100:110]  # as DDP's per-parameter views of a bucket
    before = bucket.data_ptr()
    sharing.offer(bucket)
    assert world.adopted == [] and not bucket.untyped_storage().is_shared()
    sharing.offer(bucket)
    storage = bucket.untyped_storage()
    assert storage.is_shared() and bucket.data_ptr() != before
    assert bucket.tolist() == list(range(512))  # the bytes moved with it
    view.fill_(-1)
    assert bucket[100:110].tolist() == [-1] * 10  # a view made before the move follows it
    fd = storage._get_shared_fd()
    assert world.adopted == [(bucket.data_ptr(), fd, 2048)]
    assert _fd_file(fd).startswith("/dev/shm/")
    sharing.offer(bucket)  # from now on the shared storage is handed over as it is
    assert world.adopted[-1] == (bucket.data_ptr(), fd, 2048) and len(world.adopted) == 2


def test_the_first_move_is_said_once(caplog):
    sharing = Sharing(_World())
    buckets = [torch.zeros(512), torch.zeros(512)]
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for _ in range(3):
            for bucket in buckets:
                sharing.offer(bucket)
    assert all(b.untyped_storage().is_shared() for b in buckets)
    said = [r.getMessage() for r in caplog.records if "moved into shared memory" in r.getMessage()]
    assert len(said) == 1 and "2048-byte tensor" in said[0], said


def test_another_tensor_at_the_same_address_is_not_taken_for_the_first():
    world = _World()
    sharing = Sharing(world)
    base = torch.zeros(1024)
    for _ in range(3):  # a new tensor object over the same storage each time
        sharing.offer(base.view(-1))
    assert world.adopted == [] and not base.untyped_storage().is_shared()


def test_small_offset_and_private_only_tensors_stay_where_they_are():
    world = _World(above=4096)
    sharing = Sharing(world)
    small = torch.zeros(1023)  # 4092 bytes
    offset = torch.zeros(4096)[1:]
    for t in (small, small, offset, offset):
        sharing.offer(t)
    assert world.adopted == []
    assert not small.untyped_storage().is_shared()
    assert not offset.untyped_storage().is_shared()
    nothing = Sharing(_World(above=None))  # no host segment
    big = torch.zeros(4096)
    nothing.offer(big)
    nothing.offer(big)
    assert not big.untyped_storage().is_shared()


def test_a_storage_shared_already_is_adopted_at_once():
    world = _World()
    sharing = Sharing(world)
    t = torch.ones(1024)
    t.untyped_storage()._share_fd_cpu_()  # as a DataLoader worker's tensors arrive
    sharing.offer(t)
    assert world.adopted == [(t.data_ptr(), t.untyped_storage()._get_shared_fd(), 4096)]


def test_a_move_that_torch_refuses_leaves_the_tensor_and_is_not_tried_again(monkeypatch,
                                                                            caplog):
    world = _World()
    sharing = Sharing(world)
    tries = []

    def refuse(self):
        tries.append(1)
        raise RuntimeError("unable to write to file </torch_1_2_3>: No space left on device")

    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", refuse)
    t = torch.ones(1024)
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for _ in range(4):
            sharing.offer(t)
    assert tries == [1] and world.adopted == []
    assert t.tolist() == [1.0] * 1024 and not t.untyped_storage().is_shared()
    assert "stays in private memory" in caplog.text and "No space left" in caplog.text


@pytest.mark.parametrize("count", [200, 30])
def test_the_tensors_remembered_are_bounded(count):
    sharing = Sharing(_World())
    kept = [torch.zeros(512) for _ in range(count)]
    for t in kept:
        sharing.offer(t)
    assert len(sharing._seen) == min(count, 64)


def test_a_tensor_moves_only_where_half_of_dev_shm_stays_free(monkeypatch, caplog):
    world = _World()
    sharing = Sharing(world)
    # A 64 MiB /dev/shm (a container's default) with 33 MiB free: a 2 MiB tensor would leave
    # 31 MiB, under half.
    monkeypatch.setattr(sharing_module.os, "statvfs", lambda path: _StatVfs(64 << 20, 33 << 20))
    t = torch.ones(512 << 10)
    with caplog.at_level(logging.INFO, logger="gradsync"):
        sharing.offer(t)
        sharing.offer(t)
    assert world.adopted == [] and not t.untyped_storage().is_shared()
    assert "33 MiB free of 64 MiB" in caplog.text
    assert sharing_module._room_for(2 << 20) != ""
    monkeypatch.setattr(sharing_module.os, "statvfs", lambda path: _StatVfs(64 << 20, 35 << 20))
    assert sharing_module._room_for(2 << 20) == ""  # 33 MiB left: more than half


class _StatVfs:
    def __init__(self, size: int, free: int):
        self.f_frsize, self.f_blocks, self.f_bavail = 4096, size // 4096, free // 4096
