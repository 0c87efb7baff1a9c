"""The DDP hook's reduction behind backward (gradsync/compress/ddp_hook.py, ``overlap``).

One process, a one-rank gloo group: what is checked here is the hook's own contract with DDP
(it returns before the bucket's reduction has ended; the reductions run one after another,
in the order the hook was called, on one thread and on a group of their own; an error in one
reaches DDP through its future), which needs no second rank. That the ranks of a job agree
through it, over gloo and over gradsync, is tests/ranks/compress_train.py (2 and 3 ranks).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from gradsync.compress import HookState, Int8, compressed_hook


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Gated(Int8):
    """Int8 whose reductions wait for ``gate`` (at most ``wait`` seconds) and are logged."""

    def __init__(self, wait: float = 10.0, fail_on: str | None = None):
        super().__init__()
        self.gate, self.wait, self.fail_on = threading.Event(), wait, fail_on
        self.calls: list[tuple[str, str, object]] = []

    def reduce(self, flat, shapes, comm, key, average):
        self.calls.append((key, threading.current_thread().name, comm.group))
        self.gate.wait(self.wait)
        if key == self.fail_on:
            raise RuntimeError(f"lost a peer in {key}")
        return super().reduce(flat, shapes, comm, key, average)


class Bucket:
    """What DDP hands the hook: a flat buffer, its gradients' shapes, an index."""

    def __init__(self, index: int, n: int):
        self.grads = [torch.linspace(-1, 1, n) * (index + 1), torch.ones(3)]
        self.flat = torch.cat(self.grads)
        self.i = index

    def buffer(self):
        return self.flat

    def gradients(self):
        return self.grads

    def index(self):
        return self.i


def test_the_hook_returns_while_its_bucket_is_still_being_reduced(one_rank):
    state = HookState(Gated())
    began = time.monotonic()
    future = compressed_hook(state, Bucket(0, 100))
    returned_after = time.monotonic() - began
    assert not future.done(), f"the hook waited for the reduction ({returned_after:.1f} s)"
    assert returned_after < 5
    state.compressor.gate.set()
    inline = HookState(Int8(), overlap=False)
    assert torch.equal(future.wait(), compressed_hook(inline, Bucket(0, 100)).wait())


def test_reductions_run_in_the_hooks_order_on_one_thread_and_a_group_of_their_own(one_rank):
    state = HookState(Gated(wait=0.0))
    futures = [compressed_hook(state, Bucket(i, 10 + i)) for i in range(4)]
    for future in futures:
        future.wait()
    keys = [key.split(".")[1] for key, _, _ in state.compressor.calls]
    assert keys == ["0", "1", "2", "3"]
    threads = {thread for _, thread, _ in state.compressor.calls}
    assert len(threads) == 1 and threads.pop().startswith("gradsync-ddp-hook")
    groups = {id(group) for _, _, group in state.compressor.calls}
    assert len(groups) == 1
    group = state.compressor.calls[0][2]
    assert group is not None and group is not dist.group.WORLD
    assert dist.get_process_group_ranks(group) == [0]


def test_without_overlap_the_reduction_runs_inside_the_call_on_the_models_group(one_rank):
    state = HookState(Gated(wait=0.0), overlap=False)
    future = compressed_hook(state, Bucket(0, 10))
    assert future.done()
    (_, thread, group), = state.compressor.calls
    assert thread == threading.current_thread().name and group is None


def test_an_error_in_a_reduction_reaches_its_future_and_the_next_bucket_still_runs(one_rank):
    state = HookState(Gated(wait=0.0))
    compressed_hook(state, Bucket(0, 10)).wait()
    state.compressor.fail_on = state.compressor.calls[0][0]  # bucket 0's key, from now on
    with pytest.raises(RuntimeError, match="lost a peer"):
        compressed_hook(state, Bucket(0, 10)).wait()
    assert compressed_hook(state, Bucket(1, 10)).wait().numel() == 13


def test_ddp_trains_the_same_with_and_without_overlap(one_rank):
    finals = []
    for overlap in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
        model.register_comm_hook(HookState(Int8(), overlap=overlap), compressed_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1])


class Timed(Int8):
    """Int8 whose reductions each take ``seconds`` more, and which is told how long training
    waited on its exchange (as ``Auto`` is, by ``blocked``)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.waits = seconds, []

    def reduce(self, flat, shapes, comm, key, average):
        time.sleep(self.seconds)  # the link's time, on the hook's thread
        return super().reduce(flat, shapes, comm, key, average)

    def blocked(self, seconds: float) -> None:
        self.waits.append(seconds)


def test_the_wait_at_the_end_of_backward_is_reported_once_per_step(one_rank):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
    compressor = Timed(0.1)
    model.register_comm_hook(HookState(compressor), compressed_hook)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert len(compressor.waits) == 3
    # Backward's compute here is far shorter than a reduction: training waits for at least
    # the last bucket's whole reduction, and at most for all of them.
    buckets = len(compressor.state.tensors)
    assert buckets >= 2
    assert all(0.07 <= w <= buckets * 0.1 + 1.0 for w in compressor.waits), compressor.waits


def test_a_failed_reduction_fails_ddps_backward_with_its_message(one_rank):
    """DDP reads the bucket's future in C++: the error must reach it as an error, not as a
    Python object where a Tensor is expected (``Unable to cast ... to Tensor``)."""

    class Lost(Int8):
        def reduce(self, flat, shapes, comm, key, average):
            raise RuntimeError("lost a peer in the reduction")

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(HookState(Lost()), compressed_hook)
    with pytest.raises(RuntimeError, match="lost a peer in the reduction") as info:
        model(torch.randn(3, 4)).sum().backward()
    assert "Unable to cast" not in str(info.value)
