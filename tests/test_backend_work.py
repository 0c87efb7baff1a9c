"""The torch.distributed backend's pieces that need no processes: Works and lanes, reduce-op
mapping, the error classes (the multi-process side is test_distributed_backend.py)."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.torch.backend import (BackendError, MismatchBackendError, PeerLostBackendError,
                                    TimeoutBackendError)
from gradsync.torch.backend.errors import to_backend_error
from gradsync.torch.backend.tensors import as_bytes, reduction_of
from gradsync.torch.backend.work import Lane, Work

RO = dist.ReduceOp


def test_errors_are_both_torch_and_gradsync_errors():
    lost = to_backend_error(gradsync.PeerLostError("gone", peer=2), "rank 0: all_reduce")
    assert isinstance(lost, PeerLostBackendError) and lost.peer == 2
    assert isinstance(lost, dist.DistBackendError) and isinstance(lost, gradsync.PeerLostError)
    assert str(lost) == "rank 0: all_reduce: PeerLostError: gone"
    assert isinstance(to_backend_error(gradsync.CollectiveMismatchError("x"), "w"),
                      MismatchBackendError)
    timeout = to_backend_error(gradsync.GradsyncTimeoutError("t"), "w")
    assert isinstance(timeout, TimeoutBackendError) and isinstance(timeout, TimeoutError)
    plain = to_backend_error(ValueError("v"), "w")
    assert type(plain) is BackendError and isinstance(plain.__cause__, ValueError)


def test_work_completes_its_future_with_the_outputs_or_an_error():
    out = [torch.ones(2)]
    ok = Work("all_reduce", out)
    fut = ok.get_future()
    assert not ok.is_completed() and not fut.done()
    ok._finish()
    assert ok.wait() is True and ok.is_success() and fut.wait() is out
    assert Work.completed("late", out).get_future().wait() is out  # future made after the end

    bad = Work("all_reduce", out)
    fut = bad.get_future()
    bad._finish(PeerLostBackendError("rank 1 is gone", peer=1))
    with pytest.raises(PeerLostBackendError, match="rank 1 is gone"):
        bad.wait()
    assert not bad.is_success() and isinstance(bad.exception(), PeerLostBackendError)
    # the future fails (never a successful value), naming the error's class
    with pytest.raises(RuntimeError, match="PeerLostBackendError: rank 1 is gone"):
        fut.wait()


def test_work_wait_with_a_timeout_raises_while_in_flight():
    work = Work("barrier", [])
    with pytest.raises(BackendError, match="still in flight"):
        work.wait(timedelta(milliseconds=20))


def test_lane_runs_in_order_inline_when_idle_and_fails_what_raises():
    order, gate = [], threading.Event()
    lane = Lane("test-lane", lambda exc, what: to_backend_error(exc, what))
    first = lane.submit(Work("a", None), lambda: (gate.wait(5), order.append("a")))
    # the lane is busy: a synchronous call queues behind instead of running inline
    second = lane.run_now(Work("b", None), lambda: order.append("b"))
    gate.set()
    second.wait(timedelta(seconds=5))
    assert order == ["a", "b"] and first.is_success()
    me = []
    lane.run_now(Work("c", None), lambda: me.append(threading.current_thread()))
    assert me == [threading.current_thread()]  # idle lane: ran on this thread

    def boom():
        raise gradsync.CollectiveMismatchError("ranks differ")
    failed = lane.submit(Work("d", None), boom)
    with pytest.raises(MismatchBackendError, match="d: CollectiveMismatchError: ranks differ"):
        failed.wait(timedelta(seconds=5))
    lane.close(BackendError("closed"))
    late = lane.submit(Work("e", None), lambda: None)
    with pytest.raises(BackendError, match="closed"):
        late.wait()


def test_reduce_ops_map_to_gradsync_or_a_local_fold():
    assert reduction_of(RO.SUM, torch.float32).op is gradsync.Sum
    assert reduction_of(RO.AVG, torch.bfloat16).op is gradsync.Average
    premul = reduction_of(dist._make_nccl_premul_sum(2.5), torch.float64)
    assert premul.op is gradsync.Sum and premul.prescale == 2.5
    band = reduction_of(RO.BAND, torch.int16)
    assert band.op is None
    stacked = torch.tensor([[0b1100, 0b1010], [0b0110, 0b0011]], dtype=torch.int16)
    assert band.fold_fn(stacked).tolist() == [0b0100, 0b0010]
    for op, dtype, message in ((RO.BOR, torch.float32, "integer or bool"),
                               (RO.MAX, torch.complex64, "not defined on complex"),
                               (RO.SUM, torch.float8_e4m3fn, "cannot reduce")):
        with pytest.raises(ValueError, match=message):
            reduction_of(op, dtype)


def test_byte_views_share_memory_and_keep_storage_resizable():
    t = torch.arange(4, dtype=torch.int32)
    view = as_bytes(t)
    assert view.nbytes == 16
    view[:4] = 255
    assert t[0].item() == -1
    t.untyped_storage().resize_(0)  # what FSDP does; Tensor.numpy() would forbid it
    assert as_bytes(torch.empty(0)).size == 0
