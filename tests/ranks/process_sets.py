"""Process sets of the Horovod API at 3-4 ranks: set operations, sets running at the same time
as each other and as global operations, add/remove while the job runs, a DistributedOptimizer
over a set, and the errors. Prints "ok <check>"."""

import common  # noqa: F401  (deadline)

import threading

import torch

import gradsync.torch as hvd

first = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[first])
R, N = hvd.rank(), hvd.size()
assert N >= 3, N
assert first.process_set_id == 1 and first.size() == 2, first
evens = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
odds = hvd.add_process_set([r for r in range(N) if r % 2 == 1])
mine = evens if R % 2 == 0 else odds
assert mine.rank() == mine.ranks.index(R) and mine.included() and mine.size() == len(mine.ranks)


def ok(check: str) -> None:
    print(f"ok {check} {R}", flush=True)


def total(ranks) -> float:
    return float(sum(r + 1 for r in ranks))


# 1. Every collective inside a set: results over the set's ranks only.
v = torch.full((5,), float(R + 1))
assert (hvd.allreduce(v, op=hvd.Sum, process_set=mine) == total(mine.ranks)).all()
assert (hvd.allreduce(v, process_set=mine) == total(mine.ranks) / len(mine.ranks)).all()
g = hvd.allgather(torch.full((R + 1, 2), float(R)), process_set=mine)
assert g[:, 0].tolist() == [float(r) for r in mine.ranks for _ in range(r + 1)], g
root = mine.ranks[-1]
assert (hvd.broadcast(torch.full((3,), float(R)), root, process_set=mine) == root).all()
m = len(mine.ranks)
out = hvd.alltoall(torch.arange(m, dtype=torch.float32) + 10 * R, process_set=mine)
assert out.tolist() == [10.0 * r + mine.rank() for r in mine.ranks], out
rs = hvd.reducescatter(torch.ones(2 * m, 3) * (R + 1), op=hvd.Sum, process_set=mine)
assert rs.shape == (2, 3) and (rs == total(mine.ranks)).all(), rs
hvd.barrier(process_set=mine)
assert hvd.broadcast_object({"from": R}, root_rank=mine.ranks[0],
                            process_set=mine) == {"from": mine.ranks[0]}
assert hvd.allgather_object(R, process_set=mine) == mine.ranks
ok("collectives")

# 2. A global operation issued around a set's operation never waits on it: rank 0 starts a
# set allreduce that rank 2 issues only after the global one has finished everywhere.
h = None
if R == 0:
    h = hvd.allreduce_async(v, name="late", op=hvd.Sum, process_set=evens)
glob = hvd.allreduce(v, name="global_between", op=hvd.Sum)
assert (glob == total(range(N))).all()
if R % 2 == 0 and R != 0:
    h = hvd.allreduce_async(v, name="late", op=hvd.Sum, process_set=evens)
if h is not None:
    assert (hvd.synchronize(h) == total(evens.ranks)).all()
ok("global-not-blocked")

# 3. Sets run concurrently with each other and with global operations (two threads).
errors = []


def set_loop():
    try:
        for i in range(30):
            out = hvd.allreduce(torch.full((100 + i,), float(R + i)), name=f"set{i}",
                                op=hvd.Sum, process_set=mine)
            assert (out == sum(r + i for r in mine.ranks)).all()
    except BaseException as exc:  # reported below
        errors.append(exc)


thread = threading.Thread(target=set_loop)
thread.start()
for i in range(30):
    out = hvd.allreduce(torch.full((50,), float(i)), name=f"glob{i}", op=hvd.Sum)
    assert (out == i * N).all()
thread.join()
if errors:
    raise errors[0]
ok("concurrent")

# 4. Add and remove while the job runs; the ids and the errors.
trio = hvd.add_process_set([1, 2])
if R in trio.ranks:
    assert (hvd.allreduce(v, op=hvd.Sum, process_set=trio) == total([1, 2])).all()
else:
    try:
        hvd.allreduce(v, process_set=trio)
    except ValueError as exc:
        assert "not a member" in str(exc), exc
    else:
        raise AssertionError("a non-member ran a set's operation")
try:
    hvd.add_process_set([2, 1])
except ValueError as exc:
    assert "duplicate" in str(exc), exc
else:
    raise AssertionError("duplicate set accepted")
assert hvd.remove_process_set(trio) and trio.process_set_id is None
assert not hvd.remove_process_set(hvd.global_process_set)
again = hvd.add_process_set([1, 2])  # the same ranks, once the first is gone
assert again.process_set_id not in (None, 0, 1, evens.process_set_id, odds.process_set_id)
if R in again.ranks:
    assert (hvd.allreduce(v, op=hvd.Sum, process_set=again) == total([1, 2])).all()
hvd.remove_process_set(again)
if R in first.ranks:
    assert (hvd.allreduce(v, op=hvd.Sum, process_set=first) == total([0, 1])).all()
ok("add-remove")

# 5. DistributedOptimizer over a set averages gradients over the set's ranks only.
w = torch.nn.Parameter(torch.zeros(4))
opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                               process_set=mine)
(w * (R + 1)).sum().backward()
opt.step()
assert torch.allclose(w.detach(), torch.full((4,), -total(mine.ranks) / len(mine.ranks))), w
ok("optimizer")

hvd.remove_process_set(odds)
hvd.remove_process_set(evens)
hvd.shutdown()
ok("shutdown")
