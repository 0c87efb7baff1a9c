"""What torch's own code asks of a backend, on a "gradsync" default group beside a gloo one.

Run by tests/test_backend_torch_contract.py as torchrun would start it (3 ranks). Each check
is one that torch's suite or torch's utilities found wrong (issue 37): the group's device and
backend answers, FSDP2's full-state-dict load broadcast from rank 0, DCP's ``async_save``,
``all_gather_coalesced``, a receive from any source, a sparse ``all_reduce``, the timeout's
error. Every check runs, whatever the others did (each in its own ``try``), and prints
``rank R: ok NAME`` or ``rank R: FAILED NAME: ...``; the test reads one line per check. The
timeout check goes last: its group fails on purpose.
"""

import os
import re
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import common  # noqa: F401  (deadline)
import torch
import torch.distributed as dist

import gradsync  # noqa: F401  (registers the backend)

warnings.simplefilter("ignore")  # _get_pg_default_device's deprecation, DCP's notes
dist.init_process_group("gradsync")
R, N = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # a failed check ends, not hangs
CPU = torch.device("cpu")
failures = 0


def check(fn):
    global failures
    try:
        fn()
    except Exception:  # noqa: BLE001 - reported, then the next check runs
        failures += 1
        print(f"rank {R}: FAILED {fn.__name__}: {traceback.format_exc()}", flush=True)
    else:
        print(f"rank {R}: ok {fn.__name__}", flush=True)


def devices():
    c10d = dist.distributed_c10d
    group = dist.group.WORLD
    # gloo's group (made for cpu and cuda) answers the same for cpu; gradsync's serves cpu only.
    assert CPU in GLOO._device_types, GLOO._device_types
    assert group._device_types == [CPU], group._device_types
    assert c10d._get_pg_default_device(group) == c10d._get_pg_default_device(GLOO) == CPU
    assert c10d._get_object_coll_device(group) == c10d._get_object_coll_device(GLOO) == "cpu"
    assert c10d._device_capability(group) == ["cpu"], c10d._device_capability(group)
    try:
        group._get_backend(torch.device("cuda"))
    except RuntimeError as exc:
        assert "No backend type associated with device type cuda" in str(exc), exc
    else:
        raise AssertionError("_get_backend(cuda) must raise")
    backend = dist.group.WORLD._get_backend(CPU)
    assert backend.name() == "gradsync" and (backend.rank(), backend.size()) == (R, N)
    assert backend.options.backend == "gradsync", backend.options.backend
    assert not backend.supports_splitting and not backend.supports_tensor_alloc(CPU)
    # The backend torch hands out is one that works: a collective straight on it.
    t = torch.full((3,), float(R + 1))
    backend.allreduce([t]).wait()
    assert t.tolist() == [N * (N + 1) / 2] * 3, t


def fsdp2_full_state_dict_from_rank0():
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(R)  # every rank starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    full = {k: torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) / 7
            for k, v in model.state_dict().items()}
    fully_shard(model)
    # Only rank 0 holds the weights; torch broadcasts them over the group's device
    # (pg._device_types[0]: an IndexError before issue 37).
    set_model_state_dict(model, {k: v.clone() for k, v in full.items()} if R == 0 else {},
                         options=StateDictOptions(full_state_dict=True,
                                                  broadcast_from_rank0=True))
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), full[k]), k


def async_save_on_the_default_group():
    import torch.distributed.checkpoint as dcp

    where = [tempfile.mkdtemp(prefix="gs-dcp-") if R == 0 else None]
    dist.broadcast_object_list(where)
    state = {f"rank{R}": torch.arange(5.0) + R}
    dcp.async_save(state, checkpoint_id=where[0]).result()
    back = {f"rank{R}": torch.zeros(5)}
    dcp.load(back, checkpoint_id=where[0])
    assert torch.equal(back[f"rank{R}"], torch.arange(5.0) + R), back


def all_gather_coalesced():
    # Tensors of different shapes in one call, as torch's suite sends them.
    inputs = [torch.full((1,), R + 1.0), torch.full((2, 2), R * 10.0), torch.arange(3.0) + R]
    got = {name: [[torch.empty_like(t) for t in inputs] for _ in range(N)]
           for name in ("gradsync", "gloo")}
    dist.all_gather_coalesced(got["gradsync"], inputs)
    dist.all_gather_coalesced(got["gloo"], inputs, group=GLOO)
    for r in range(N):
        want = [torch.full((1,), r + 1.0), torch.full((2, 2), r * 10.0), torch.arange(3.0) + r]
        for g, k, w in zip(got["gradsync"][r], got["gloo"][r], want):
            assert torch.equal(g, w) and torch.equal(k, w), (r, g, k, w)


def recv_from_any_source():
    # Every rank sends twice to every other; each receives 2 * (N - 1) messages from
    # whoever comes first, with dist.recv and dist.irecv, and learns the sender's rank.
    senders = []
    for dst in range(N):
        if dst == R:
            for _ in range(N - 1):
                out = torch.full((4,), -1.0)
                senders.append(dist.recv(out))
                assert out.eq(senders[-1]).all(), (senders[-1], out)
                out = torch.full((4,), -1.0)
                work = dist.irecv(out)
                work.wait()
                senders.append(work._source_rank())
                assert out.eq(senders[-1]).all(), (senders[-1], out)
        else:
            dist.send(torch.full((4,), float(R)), dst)
            dist.send(torch.full((4,), float(R)), dst)
    assert sorted(senders) == sorted([r for r in range(N) if r != R] * 2), senders
    # A receive from a named rank still follows on the directions just used. After a
    # barrier: a rank still receiving from any source would take the ring's message too.
    dist.barrier()
    nxt, prev = (R + 1) % N, (R - 1) % N
    out = torch.empty(2)
    work = dist.isend(torch.full((2,), R * 3.0), nxt)
    dist.recv(out, src=prev)
    work.wait()
    assert out.tolist() == [prev * 3.0] * 2, out
    # A receive from any source that no rank answers ends when its group is destroyed.
    group = dist.new_group()
    pending = dist.irecv(torch.empty(1), group=group)
    dist.destroy_process_group(group)
    deadline = time.monotonic() + 20
    while not pending.is_completed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pending.is_completed() and not pending.is_success(), pending
    dist.barrier()


def sparse_all_reduce():
    # Rank r holds entries 0..r of the first sparse dimension (so ranks overlap), with 1 to 3
    # sparse and 0 to 2 dense dimensions, as torch's suite builds them: rank 0's one entry
    # makes index and value tensors of size-1 dimensions. The sum is coalesced, as gloo's.
    for sparse_dims, dense_dims in ((1, 0), (2, 0), (3, 0), (1, 1), (1, 2), (2, 1)):
        indices = torch.zeros((sparse_dims, R + 1), dtype=torch.long)
        indices[0] = torch.arange(R + 1)
        shape = [N] * sparse_dims + [2] * dense_dims
        values = torch.ones([R + 1] + [2] * dense_dims) * (R + 1)
        results = {}
        for name, group in (("gradsync", None), ("gloo", GLOO)):
            t = torch.sparse_coo_tensor(indices, values, shape)
            dist.all_reduce(t, group=group)
            results[name] = t
        assert results["gradsync"].is_coalesced(), (sparse_dims, dense_dims)
        assert torch.equal(results["gradsync"].to_dense(), results["gloo"].to_dense()), \
            (sparse_dims, dense_dims, results)
    # A rank with no entries at all.
    empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), torch.empty(0), (3, 3))
    lone = empty if R != 1 else torch.sparse_coo_tensor([[1], [2]], [5.0], (3, 3))
    dist.all_reduce(lone)
    want = torch.zeros(3, 3)
    want[1, 2] = 5.0
    assert torch.equal(lone.to_dense(), want), lone


def timeout_error_as_torch_words_it():
    group = dist.new_group(timeout=timedelta(seconds=1))
    if R != 0:
        return  # only rank 0 enters the barrier: it must time out
    start = time.monotonic()
    try:
        dist.barrier(group)
    except dist.DistBackendError as exc:
        waited = time.monotonic() - start
        # torch's suite (test_barrier_timeout_*) and users match torch's wording.
        assert re.search(" (Timed out|closed|timeout) ", str(exc)), str(exc)
        assert isinstance(exc, gradsync.GradsyncTimeoutError), type(exc)
        assert waited >= 0.9, waited
    else:
        raise AssertionError("a barrier that no other rank enters must time out")


check(devices)
check(fsdp2_full_state_dict_from_rank0)
check(async_save_on_the_default_group)
check(all_gather_coalesced)
check(recv_from_any_source)
check(sparse_all_reduce)
dist.barrier(GLOO)  # the last check's group fails on purpose: nothing of it after
check(timeout_error_as_torch_words_it)
dist.barrier(GLOO)
print(f"rank {R}: torch contract done, {failures} failed", flush=True)
os._exit(1 if failures else 0)  # the failed group's connections need no goodbye
