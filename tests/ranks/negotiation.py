"""Name-negotiated execution of the Horovod API: order-free matching, errors that leave the job
usable, duplicate names, unnamed ops, fusion and the response cache. Prints "ok <check>"."""

import common  # noqa: F401  (deadline)

import torch

import gradsync.torch as hvd
from gradsync.errors import CollectiveMismatchError
from gradsync.torch import process_sets

hvd.init(fusion_threshold=1 << 20)
R, N = hvd.rank(), hvd.size()
ctl = process_sets.controller(hvd.global_process_set)
ranks_sum = N * (N + 1) // 2  # sum over ranks of (rank + 1)


def ok(check: str) -> None:
    print(f"ok {check} {R}", flush=True)


# 1. Each rank issues the same eight names in its own rotated order.
names = [f"rot{i}" for i in range(8)]
mine = names[R % 8:] + names[:R % 8]
handles = {n: hvd.allreduce_async(torch.full((3 + i,), float(R + 1)), name=n, op=hvd.Sum)
           for i, n in sorted(enumerate(names), key=lambda p: mine.index(p[1]))}
for i, n in enumerate(names):
    out = hvd.synchronize(handles[n])
    assert out.shape == (3 + i,) and (out == ranks_sum).all(), (n, out)
ok("out-of-order")

# 2. Rank 0 issues an allreduce before a barrier, the others after it.
t = torch.full((5,), float(R + 1))
if R == 0:
    h = hvd.allreduce_async(t, name="around_barrier", op=hvd.Sum)
hvd.barrier()
if R != 0:
    h = hvd.allreduce_async(t, name="around_barrier", op=hvd.Sum)
assert (hvd.synchronize(h) == ranks_sum).all()
ok("barrier")

# 3. Mismatches raise on every rank, and the next operation works.
if N > 1:
    cases = [
        ("shape", lambda: hvd.allreduce(torch.ones(4 + R), name="bad_shape")),
        ("dtype", lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if R else
                                                    torch.float64), name="bad_dtype")),
        ("op", lambda: hvd.allreduce(torch.ones(4), name="bad_op",
                                     op=hvd.Sum if R else hvd.Max)),
        ("root", lambda: hvd.broadcast(torch.ones(4), root_rank=R, name="bad_root")),
        ("allgather", lambda: hvd.allgather(torch.ones(2, 3 + R), name="bad_gather")),
    ]
    for label, call in cases:
        try:
            call()
        except CollectiveMismatchError as exc:
            assert isinstance(exc, RuntimeError)
            assert "did not run" in str(exc) and "rank 0" in str(exc), str(exc)
        else:
            raise AssertionError(f"no error for mismatched {label}")
        out = hvd.allreduce(torch.full((6,), float(R + 1)), name=f"after_{label}", op=hvd.Sum)
        assert (out == ranks_sum).all(), (label, out)
    assert ctl.stats["mismatches"] == len(cases), ctl.stats
    ok("mismatch")

# 4. A second async operation with the name of one in flight raises ValueError at once.
with ctl._cv:  # holds the cycle off, so the first one is certainly still in flight
    first = hvd.allreduce_async(torch.ones(3), name="dup")
    try:
        hvd.allreduce_async(torch.ones(3), name="dup")
    except ValueError as exc:
        assert "dup" in str(exc), exc
    else:
        raise AssertionError("duplicate name accepted")
    other_kind = hvd.allgather_async(torch.ones(1, 2), name="dup")  # another kind, another name
assert (hvd.synchronize(first) == 1).all()
assert hvd.synchronize(other_kind).shape == (N, 2)
hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="dup"))  # free again once done
# The name stays in use until the handle is synchronized, not merely until the operation is
# done. Horovod's duplicate-name tests: rank 0 issues the op before a barrier, the others after
# it, so theirs is ready as soon as announced and may finish before their second call; had the
# second call been accepted, they would have issued an operation rank 0 never does.
if R == 0:
    late = hvd.allreduce_async(torch.ones(3), name="late", op=hvd.Sum)
hvd.barrier()
if R != 0:
    late = hvd.allreduce_async(torch.ones(3), name="late", op=hvd.Sum)
while not hvd.poll(late):
    pass
try:
    hvd.allreduce_async(torch.ones(3), name="late", op=hvd.Sum)
except ValueError as exc:
    assert "done but not synchronized" in str(exc), exc
else:
    raise AssertionError("the name of a done, unsynchronized operation was reused")
assert (hvd.synchronize(late) == N).all()
assert (hvd.allreduce(torch.ones(3), name="late", op=hvd.Sum) == N).all()  # free again
ok("duplicate")

# 5. Unnamed operations match per kind, whatever the order of kinds on each rank.
x, y = torch.full((2,), float(R + 1)), torch.full((1, 2), float(R))
if R % 2:
    hg, hr = hvd.allgather_async(y), hvd.allreduce_async(x, op=hvd.Sum)
else:
    hr, hg = hvd.allreduce_async(x, op=hvd.Sum), hvd.allgather_async(y)
assert (hvd.synchronize(hr) == ranks_sum).all()
assert hvd.synchronize(hg)[:, 0].tolist() == [float(r) for r in range(N)]
ok("unnamed")

# 6. Ready allreduces of one dtype fuse into one collective; others stay apart.
before = ctl.stats.copy()
with ctl._cv:  # all ten are announced in one cycle on this rank
    fused = [hvd.allreduce_async(torch.full((10 + i,), float(R + 1)), name=f"fuse{i}",
                                 op=hvd.Sum) for i in range(10)]
    apart = hvd.allreduce_async(torch.full((4,), R + 1, dtype=torch.int64), name="fuse_int",
                                op=hvd.Sum)
for i, h in enumerate(fused):
    out = hvd.synchronize(h)
    assert out.shape == (10 + i,) and (out == ranks_sum).all()
assert (hvd.synchronize(apart) == ranks_sum).all()
assert ctl.stats["fused_batches"] - before["fused_batches"] == 1, ctl.stats
assert ctl.stats["fused_tensors"] - before["fused_tensors"] == 10, ctl.stats
ok("fusion")

# 7. Steady state: after the first step, every request is announced as a cache bit.
before = ctl.stats.copy()
steps, per_step = 6, 4
for step in range(steps):
    hs = [hvd.allreduce_async(torch.full((7,), float(step)), name=f"grad{j}")
          for j in range(per_step)]
    for h in hs:
        assert (hvd.synchronize(h) == step).all()
if N > 1:
    assert ctl.stats["full"] - before["full"] == per_step, ctl.stats
    assert ctl.stats["cached"] - before["cached"] == (steps - 1) * per_step, ctl.stats
ok("cache")

# 8. The numpy API keeps its own World and issue order beside the Horovod API.
import gradsync as gs  # noqa: E402

h = hvd.allreduce_async(torch.ones(3), name="beside")
assert (gs.allreduce(torch.ones(3) * (R + 1), op=gs.Sum) == ranks_sum).all()
assert (hvd.synchronize(h) == 1).all()
ok("beside")

# 9. An integer Average rounds toward zero, as Horovod's does (-(2N+1)/N is -2, not -3).
row = [-(2 * N + 1), 2 * N + 1, -N, 2]
want = [-((2 * N + 1) // N), (2 * N + 1) // N, -1, 2 // N]
for dtype in (torch.int32, torch.int64):
    mine = torch.tensor(row if R == 0 else [0] * 4, dtype=dtype)
    assert hvd.allreduce(mine, op=hvd.Average, name=f"round_{dtype}").tolist() == want
    block = hvd.reducescatter(mine.repeat(N, 1), op=hvd.Average, name=f"round_rs_{dtype}")
    assert block.tolist() == [want], (block, want)
assert gs.allreduce(torch.tensor([-(2 * N + 1)]) * (R == 0), op=gs.Average).item() == \
    -(2 * N + 1) // N  # the numpy API keeps floor division
ok("rounding")

# 10. Steady-state training: once every name has run, a cycle is one vote of cache bits and
# never gathers full announcements. The optimizer gets no parameter names (its buckets are
# named after unnamed parameters, and must be cached all the same); the loss is a named metric.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))


def train(step: int) -> None:
    loss = model(torch.full((4, 8), float(R + step) / 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    hvd.allreduce(loss.detach(), name="loss")


for step in range(3):  # warm-up: the buckets and the metric are described once, in full
    train(step)
cycles, gathers = ctl.cycles, ctl.gathers
for step in range(3, 15):
    train(step)
if N > 1:
    assert gathers > 0 and ctl.cycles > cycles, (cycles, gathers, ctl.stats)
    assert ctl.gathers == gathers, (f"{ctl.gathers - gathers} of {ctl.cycles - cycles} steady "
                                    "cycles gathered", ctl.stats)
ok("steady")

hvd.shutdown()
ok("shutdown")
