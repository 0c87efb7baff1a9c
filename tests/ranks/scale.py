"""Every collective, the Horovod API's DistributedOptimizer and the torch backend at scale.

Run by tests/test_scale.py through ``gradsync run -np 128 -H 127.0.0.1:8,...,127.0.0.16:8``:
16 emulated hosts of 8 ranks (shared memory inside a host, TCP between hosts). One job pays
the start of 128 processes once, so it checks in turn, each against a closed form that every
rank computes for itself (rank r contributes a formula of r):

1. gradsync's own collectives: allreduce (sum, average, min, max, product), each at every
   element count (0, 1, N - 1, 7N + 3 and one of many chunks) and its dtypes in turn, in place
   and not, every algorithm at two counts; allgather of uneven rows; broadcast from three roots;
   reducescatter of uneven rows; alltoall with uneven and even splits; objects; barrier.
2. The Horovod API (``gradsync.torch``): named asynchronous allreduces issued in a different
   order on every rank (the negotiation matches them by name), then ``DistributedOptimizer``
   over a tiny float64 model against one process training on every rank's batch at once.
3. The torch.distributed backend "gradsync" in the same process, after ``hvd.shutdown()`` (a
   World of its own): every collective, a ring of sends and receives, and DDP against the
   same one-process reference.

Tensors stay small (the largest is 256 KiB) so that 128 ranks fit in memory beside torch.
Each rank exits non-zero at its first wrong value, naming it, and ends with
``SCALE OK rank=<r> checks=<count> maxrss_mib=<peak resident> private_mib=<its own now>``.
"""

import re
import resource
import time
import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import numpy as np

import gradsync as gs

started = time.monotonic()
gs.init()
R, N = gs.rank(), gs.size()


def done(what):
    print(f"rank {R}: {what} ok at {time.monotonic() - started:.1f} s", flush=True)


done("init")
C = Checks(R)
fail = C.fail
BIG = 65_536 + 5  # float32: 256 KiB, many chunks, not a multiple of N
COUNTS = [0, 1, N - 1, 7 * N + 3, BIG]


def check(what, got, want):
    """``got`` equals ``want`` exactly (the inputs are small integers or halves)."""
    C.count += 1
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        fail(f"{what}: shape {got.shape} != {want.shape}")
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:5]
        fail(f"{what}: wrong at {bad.tolist()}: got {got.ravel()[bad]} want {want.ravel()[bad]}")


def inputs(kind, rank, count):
    """Rank ``rank``'s allreduce input: exact in every dtype below and any reduction order."""
    i = np.arange(count)
    if kind in ("sum", "average"):
        return rank + i % 3
    if kind in ("min", "max"):
        return (rank * 37 + i) % 251  # 128 distinct values per element: the extremes move
    return 1 + (i % N == rank)  # product: one rank contributes 2 to each element, the rest 1


def reference(kind, dtype, count):
    """The reduction of every rank's input, in closed form or folded rank by rank."""
    i = np.arange(count)
    if kind == "sum":
        return N * (N - 1) // 2 + N * (i % 3)
    if kind == "average":
        exact = (N - 1) / 2 + i % 3
        return np.floor(exact) if np.dtype(dtype).kind in "iu" else exact
    if kind == "product":
        return np.full(count, 2)
    fold = np.minimum if kind == "min" else np.maximum
    out = inputs(kind, 0, count)
    for r in range(1, N):
        out = fold(out, inputs(kind, r, count))
    return out


OPS = {"sum": (gs.Sum, ["float32", "float64", "int32", "int64"]),
       "average": (gs.Average, ["float32", "float64", "int64"]),
       "min": (gs.Min, ["uint8", "float16", "int32"]),
       "max": (gs.Max, ["uint8", "float32", "int64"]),
       "product": (gs.Product, ["int64", "float32"])}

# --- 1. gradsync's collectives
for kind, (op, dtypes) in OPS.items():
    # Every op at every count, its dtypes taken in turn: each collective costs 128 ranks'
    # turns on 2 cores, so the sweep of every combination stays in tests/test_collectives.py.
    for index, count in enumerate(COUNTS):
        dtype = dtypes[index % len(dtypes)]
        x = inputs(kind, R, count).astype(dtype)
        want = reference(kind, dtype, count)
        what = f"allreduce {kind} {dtype}[{count}]"
        check(what, gs.allreduce(x, op=op, name=what), want)
        check(what + " (input untouched)", x, inputs(kind, R, count))
        if kind == "sum" and count:
            gs.allreduce_(x, op=op)
            check(what + " in place", x, want)
for algorithm in ["ring", "topo_ring", "doubling", "halving_doubling", "hierarchical"]:
    for count in [7 * N + 3, BIG]:
        what = f"allreduce sum float32[{count}] algorithm={algorithm}"
        got = gs.allreduce(inputs("sum", R, count).astype(np.float32), op=gs.Sum,
                           algorithm=algorithm, name=what)
        check(what, got, reference("sum", "float32", count))
done("allreduce")

for dtype in ["float32", "int64"]:  # rank r has r % 3 rows: some ranks none
    x = np.full((R % 3, 2), R).astype(dtype)
    want = np.concatenate([np.full((r % 3, 2), r) for r in range(N)])
    check(f"allgather {dtype}", gs.allgather(x), want)

for root in [0, 77 % N, N - 1]:
    for dtype, count in [("float32", 0), ("float32", 1), ("int64", 7 * N + 3),
                         ("float32", BIG)]:
        x = (np.arange(count) % 7 + (R == root)).astype(dtype)
        check(f"broadcast root={root} {dtype}[{count}]", gs.broadcast(x, root),
              np.arange(count) % 7 + 1)

for rows in [0, 1, N + 1, 5 * N + 2]:  # uneven: the first rows % N ranks get one more
    x = np.tile(inputs("sum", R, rows)[:, None], (1, 2)).astype(np.float32)
    full = np.tile(reference("sum", "float32", rows)[:, None], (1, 2))
    base, extra = divmod(rows, N)
    start = R * base + min(R, extra)
    check(f"reducescatter sum rows={rows}", gs.reducescatter(x, op=gs.Sum),
          full[start:start + base + (R < extra)])

splits = [(j + R) % 3 for j in range(N)]  # rank r sends (j + r) % 3 rows to rank j
rows = np.concatenate([np.full((s, 2), 1000 * R + j) for j, s in enumerate(splits)])
out, received = gs.alltoall(rows.astype(np.int32), splits=splits)
check("alltoall uneven", out,
      np.concatenate([np.full(((j + R) % 3, 2), 1000 * j + R) for j in range(N)]))
check("alltoall received splits", np.asarray(received), [(R + j) % 3 for j in range(N)])
check("alltoall even", gs.alltoall(np.full((2 * N, 1), R, dtype=np.float32)),
      np.repeat(np.arange(N), 2)[:, None])

got = gs.broadcast_object({"root": R, "list": list(range(R))} if R == N - 1 else None,
                          root_rank=N - 1)
if got != {"root": N - 1, "list": list(range(N - 1))}:
    fail(f"broadcast_object: {got}")
if gs.allgather_object(("r", R)) != [("r", r) for r in range(N)]:
    fail("allgather_object")
gs.barrier()
done("gradsync collectives")

# --- 2. the Horovod API
import torch  # noqa: E402  (after part 1, which must not need it)

import gradsync.torch as hvd  # noqa: E402

torch.set_num_threads(1)
hvd.init()
names = [f"grad.{k}" for k in range(5)]
order = names[R % 5:] + names[:R % 5]  # each rank issues the same five in its own order
handles = {name: hvd.allreduce_async(torch.full((int(name[-1]) * 50 + 1,), float(R)),
                                     op=hvd.Sum, name=name) for name in order}
for name, handle in handles.items():
    check(f"hvd allreduce {name}", hvd.synchronize(handle).numpy(),
          np.full(int(name[-1]) * 50 + 1, N * (N - 1) / 2))
check("hvd allgather", hvd.allgather(torch.full((R % 2, 3), R)).numpy(),
      np.concatenate([np.full((r % 2, 3), r) for r in range(N)]))
check("hvd broadcast", hvd.broadcast(torch.tensor([R, 2 * R]), root_rank=5 % N).numpy(),
      [5 % N, 2 * (5 % N)])
done("Horovod API collectives")

B, IN, OUT, STEPS = 2, 3, 2, 3


def batch(rank):
    """Rank ``rank``'s batch: a formula of the rank, so every rank can build all of them."""
    x = (torch.arange(B * IN, dtype=torch.float64).reshape(B, IN) + rank) / (4 * N)
    return x, torch.sin(x.sum(1, keepdim=True)).repeat(1, OUT)


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, OUT)).double()


def train(net, optimizer, x, y):
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()


def compare(what, net, reference_net):
    for (name, p), q in zip(net.named_parameters(), reference_net.parameters()):
        C.near(f"{what} {name}", p.detach(), q.detach(), tol=1e-9)


every = [batch(r) for r in range(N)]
full_x, full_y = torch.cat([b[0] for b in every]), torch.cat([b[1] for b in every])
reference_net = model(0)  # one process on every rank's batch: the mean loss over all of them
train(reference_net, torch.optim.SGD(reference_net.parameters(), lr=0.5, momentum=0.9),
      full_x, full_y)

net = model(R)  # every rank starts different; broadcast_parameters makes them rank 0's
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
                                     named_parameters=net.named_parameters())
train(net, optimizer, *batch(R))
compare("DistributedOptimizer", net, reference_net)
done("DistributedOptimizer")

# --- 3. the torch.distributed backend, in the same process once the Horovod API has left:
# each is a World of its own, and today's Worlds connect every pair at once (a connect storm
# that two of them at a time, 128 ranks on 2 cores, can stretch past the handshake timeout)
hvd.shutdown()
import torch.distributed as dist  # noqa: E402

warnings.simplefilter("ignore")
dist.init_process_group("gradsync")  # env:// from the launcher: a World of its own
if (dist.get_rank(), dist.get_world_size()) != (R, N):
    fail(f"backend rank/size {dist.get_rank()}/{dist.get_world_size()}")
RO = dist.ReduceOp
for kind, op in [("sum", RO.SUM), ("min", RO.MIN), ("max", RO.MAX), ("product", RO.PRODUCT)]:
    for dtype in [torch.float32, torch.int64]:
        t = torch.from_numpy(inputs(kind, R, 7 * N + 3)).to(dtype)
        dist.all_reduce(t, op=op)
        check(f"backend all_reduce {kind} {dtype}", t.numpy(),
              reference(kind, "int64", 7 * N + 3))
t = torch.from_numpy(inputs("average", R, N - 1)).double()
dist.all_reduce(t, op=RO.AVG)
check("backend all_reduce avg", t.numpy(), reference("average", "float64", N - 1))

gathered = [torch.empty(2) for _ in range(N)]
dist.all_gather(gathered, torch.full((2,), float(R)))
check("backend all_gather", torch.stack(gathered).numpy(), np.repeat(np.arange(N), 2)
      .reshape(N, 2))
flat = torch.empty(3 * N, dtype=torch.int64)
dist.all_gather_into_tensor(flat, torch.full((3,), R, dtype=torch.int64))
check("backend all_gather_into_tensor", flat.numpy(), np.repeat(np.arange(N), 3))
t = torch.arange(5, dtype=torch.float32) + (R == N - 1)
dist.broadcast(t, src=N - 1)
check("backend broadcast", t.numpy(), np.arange(5) + 1)
out = torch.empty(2)
dist.reduce_scatter_tensor(out, torch.arange(2 * N, dtype=torch.float32) + R)
check("backend reduce_scatter_tensor", out.numpy(),
      N * np.arange(2 * R, 2 * R + 2) + N * (N - 1) / 2)
send = [(j + R) % 3 for j in range(N)]
receive = [(R + j) % 3 for j in range(N)]
src = torch.cat([torch.full((s,), float(1000 * R + j)) for j, s in enumerate(send)])
dst = torch.empty(sum(receive))
dist.all_to_all_single(dst, src, output_split_sizes=receive, input_split_sizes=send)
check("backend all_to_all_single", dst.numpy(),
      np.concatenate([np.full(s, 1000 * j + R) for j, s in enumerate(receive)]))
got = torch.empty(3)
ops = [dist.P2POp(dist.isend, torch.full((3,), float(R)), (R + 1) % N),
       dist.P2POp(dist.irecv, got, (R - 1) % N)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
check("backend send/recv ring", got.numpy(), np.full(3, (R - 1) % N))
dist.barrier()
done("backend collectives")

ddp_net = model(R)  # DDP broadcasts rank 0's parameters at construction
ddp = torch.nn.parallel.DistributedDataParallel(ddp_net)
train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9), *batch(R))
compare("DDP", ddp_net, reference_net)
dist.destroy_process_group()
done("torch backend")
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
with open("/proc/self/smaps_rollup") as rollup:  # what this rank alone holds, not shared
    private = sum(int(v) for v in re.findall(r"Private_\w+:\s+(\d+)", rollup.read())) >> 10
print(f"SCALE OK rank={R} checks={C.count} maxrss_mib={maxrss} private_mib={private}",
      flush=True)
