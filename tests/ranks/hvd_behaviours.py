"""Horovod behaviours that its own suite relies on, each against a closed form.

Run by tests/test_hvd_behaviours.py through ``gradsync run -np N``. Prints "ok <check> <rank>"
per check; exits non-zero at the first wrong value.
"""

import sys
import threading
import time
import warnings

import common  # noqa: F401  (deadline)
import torch

import gradsync.torch as hvd
from gradsync import job
from gradsync.liveness import abort_watch

hvd.init()
R, N = hvd.rank(), hvd.size()


def ok(check: str) -> None:
    print(f"ok {check} {R}", flush=True)


def expect(what, cond) -> None:
    if not cond:
        sys.exit(f"rank {R}: {what}")


# 1. The gradient of an alltoall without splits goes back in the counts each rank sent: rank r
#    sends r+1 rows to every rank, and rank k weighs what it received by k+1, so the rows rank
#    r sent to rank k get gradient k+1.
x = torch.arange(N * (R + 1), dtype=torch.float64).unsqueeze(1).repeat(1, 2).requires_grad_()
y = hvd.alltoall(x, name="a2a_equal")
expect(f"alltoall rows {y.shape}", y.shape == (N * (N + 1) // 2, 2))
(y * (R + 1)).sum().backward()
want = torch.arange(1, N + 1, dtype=torch.float64).repeat_interleave(R + 1).unsqueeze(1)
expect(f"alltoall gradient {x.grad[:, 0].tolist()}", torch.equal(x.grad, want.repeat(1, 2)))
ok("alltoall-grad")

# 2. DistributedOptimizer on a process set: members average among themselves, a rank outside
#    the set steps on its own gradient (as in Horovod). Members: ranks 0 .. M-1.
if N > 1:
    M = max(1, N - 1) if N > 2 else 1
    members = hvd.add_process_set(list(range(M)))
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   process_set=members)
    (w * (R + 1)).sum().backward()
    opt.step()
    want = -(M + 1) / 2 if R < M else -(R + 1.0)  # -mean(r + 1 for r < M), or -(R + 1)
    expect(f"set optimizer: {w.tolist()} != {want}", torch.allclose(w, torch.full((3,), want)))
    hvd.remove_process_set(members)
ok("set-optimizer")

# 3. A sparse embedding gradient is reduced without sparse_as_dense (allgathered indices and
#    values): rank r looks up rows r % 6 and (r + 1) % 6, so the averaged gradient of row i is
#    (the number of ranks that looked it up) / N.
counts = torch.zeros(6)
for r in range(N):
    counts[r % 6] += 1
    counts[(r + 1) % 6] += 1
for dense in (False, True):
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.ones_(emb.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=dense)
    emb(torch.tensor([R % 6, (R + 1) % 6])).sum().backward()
    opt.synchronize()
    expect("the reduced gradient stays sparse", emb.weight.grad.is_sparse)
    with opt.skip_synchronize():
        opt.step()
    want = 1 - (counts / N).unsqueeze(1).repeat(1, 2)
    expect(f"sparse (as dense: {dense}) {emb.weight[:, 0].tolist()} != {want[:, 0].tolist()}",
           torch.allclose(emb.weight, want))
ok("sparse-grad")

# 4. _parameter_names (Horovod's attribute): parameter -> name, given or made up, unique.
model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
expect("_parameter_names with names", named._parameter_names ==
       {p: n for n, p in model.named_parameters()})
unnamed = hvd.DistributedOptimizer(torch.optim.SGD(
    [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
names = unnamed._parameter_names
expect(f"_parameter_names without names {names}",
       len(names) == 4 and len(set(names.values())) == 4)
expect("same names everywhere", hvd.allgather_object(sorted(names.values())) ==
       [sorted(names.values())] * N)
ok("parameter-names")

# 5. step() right after synchronize() warns (the gradients are not reduced twice); inside
#    skip_synchronize() it does not.
w = torch.nn.Parameter(torch.ones(2))
opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w2", w)])
for skip in (False, True):
    (w * (R + 1)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if skip:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    mine = [c for c in caught if "skip_synchronize" in str(c.message)]
    expect(f"warnings with skip={skip}: {[str(c.message) for c in caught]}",
           len(mine) == (0 if skip else 1))
    opt.zero_grad()
expect(f"two steps of -mean(r + 1): {w.tolist()}",
       torch.allclose(w, torch.full((2,), 1 - (N + 1.0))))
ok("step-warning")

# 6. broadcast_optimizer_state on an optimizer without state gives its trainable parameters
#    zero gradients (as Horovod), and leaves frozen ones without.
frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
trained = torch.nn.Parameter(torch.full((3,), float(R)))
opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9),
                               named_parameters=[("frozen", frozen), ("trained", trained)])
hvd.broadcast_optimizer_state(opt, root_rank=0)
expect("frozen parameter got a gradient", frozen.grad is None)
expect(f"trained gradient {trained.grad}", torch.equal(trained.grad, torch.zeros(3)))
ok("zero-grads")

# 6b. Process sets add no store clients (issue 36): the sets of a process share one client and
#     the root World's bell keeps their abort records, where each set's World cloned a client
#     and its abort watch held another. Counted as this process's sockets to the store's port
#     (the launcher hosts the store) before and after more sets, each used, and removed.
def store_clients() -> int:
    port = job.world().env.store_port
    return sum(peer[1] == port for _, peer in abort_watch._store_sockets().values())


def settled(limit: int) -> int:
    """The count once it is at most ``limit`` (a set's meeting client closes when its last
    reference goes), or what it is after 5 s."""
    end = time.monotonic() + 5.0
    while (count := store_clients()) > limit and time.monotonic() < end:
        time.sleep(0.05)
    return count


if N > 1:
    before = store_clients()
    sets = [hvd.add_process_set(ranks) for ranks in
            ([[r] for r in range(N)] if N == 2 else
             [sorted({r, (r + 1) % N}) for r in range(N)])]
    for ps in sets:
        if R in ps.ranks:
            got = hvd.allreduce(torch.full((2,), R + 1.0), op=hvd.Sum, process_set=ps,
                                name=f"set{ps.process_set_id}")
            expect(f"{ps}: {got.tolist()}", got.tolist() == [sum(r + 1.0 for r in ps.ranks)] * 2)
    with_sets = settled(before)
    for ps in sets:
        hvd.remove_process_set(ps)
    removed = settled(before)
    expect(f"store clients: {before} before {len(sets)} sets, {with_sets} with them, {removed} "
           f"after their removal", with_sets == removed == before)
ok("store-clients")

hvd.shutdown()
# 7. init and shutdown again (as horovodrun's suite does around every test) leave no thread
#    behind: each World's listener is woken from accept() and joined.
for _ in range(3):
    hvd.init()
    hvd.allreduce(torch.ones(2), name="again")
    hvd.shutdown()
t_shutdown = time.monotonic()
# Each closed World's abort watch (abort_watch.py) is woken out of its blocked store request
# by the close itself, so none is left either (until issue 36 each stayed blocked until its
# re-arm, 300 s, or the process's exit).
# A thread of a closed World still finishing (a heartbeat link's set-up, a crossed dial's
# handshake: each bounded by its own deadline) may outlive shutdown() by a moment on a loaded
# machine: it must end on its own within 12 s (tcp.HANDSHAKE_TIMEOUT is 10 s).
def _left() -> list:
    return [t for t in threading.enumerate() if t is not threading.main_thread()]


late = [t.name for t in _left()]
for thread in _left():
    thread.join(max(0.0, 12.0 - (time.monotonic() - t_shutdown)))
left = [t.name for t in _left()]
expect(f"threads left 12 s after shutdown: {left} (at shutdown: {late})", not left)
if late:
    print(f"rank {R}: threads that ended after shutdown returned: {late}")
ok("shutdown")
