"""gradsync.torch's collectives, object and broadcast helpers, SyncBatchNorm and errors.

Run by tests/test_torch_api.py through ``gradsync run -np N`` (N = 1, 2, 3). Every result is
checked against a closed-form or single-process reference; the script exits non-zero at the
first wrong value, printing what it was.
"""

import sys
import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import torch

import gradsync.api
import gradsync.torch as hvd

hvd.init(fusion_threshold=256)  # small: broadcast_parameters packs several buffers
R, N = hvd.rank(), hvd.size()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8]
SHAPE = (3, 4)
C = Checks(R)
check, check_dtype, raises = C.equal, C.dtype, C.raises


def values(kind, rank):
    """Closed-form inputs: small integers, exact in every dtype and reduction order."""
    i = torch.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE)
    if kind in ("sum", "average"):
        return rank + 1 + i % 5
    if kind in ("min", "max"):
        return (rank * 7 + i) % 11
    return 1 + (rank + i) % 2


def reference(kind, dtype):
    stack = torch.stack([values(kind, r) for r in range(N)]).double()
    ref = {"sum": stack.sum(0), "average": stack.sum(0), "min": stack.min(0).values,
           "max": stack.max(0).values, "product": stack.prod(0)}[kind]
    if kind == "average":
        ref = torch.floor(ref / N) if not dtype.is_floating_point else ref / N
    return ref


OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}

# --- allreduce: every op x dtype, all four forms
for dtype in DTYPES:
    for kind, op in OPS.items():
        x = values(kind, R).to(dtype)
        want = reference(kind, dtype)
        what = f"allreduce {kind} {dtype}"
        y = hvd.allreduce(x, op=op, name=what)
        check(what, y, want)
        check_dtype(what, y, dtype)
        check(what + " (input untouched)", x, values(kind, R))
        check(what + " async", hvd.synchronize(hvd.allreduce_async(x, op=op)), want)
        h = hvd.allreduce_async_(x.clone(), op=op)
        check(what + " async_", hvd.synchronize(h), want)
        z = x.clone()
        assert hvd.allreduce_(z, op=op) is z
        check(what + " in place", z, want)
print(f"rank {R}: allreduce ok", flush=True)

# --- average= (Horovod's deprecated spelling), scaling, compression
x = torch.full((5,), float(R + 1))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check("average=True", hvd.allreduce(x, average=True), torch.full((5,), (N + 1) / 2))
    check("average=False", hvd.allreduce(x, average=False), torch.full((5,), N * (N + 1) / 2))
assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
raises("op and average", ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum))
check("prescale/postscale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                          postscale_factor=0.25),
      torch.full((5,), N * (N + 1) / 4))
for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
    y = hvd.allreduce(x / 3, compression=comp, op=hvd.Sum)
    check_dtype(f"compression {comp.__name__}", y, torch.float32)
    check(f"compression {comp.__name__}", y, torch.full((5,), N * (N + 1) / 6), exact=False)
    ints = torch.arange(4) + R
    check(f"compression {comp.__name__} leaves ints", hvd.allreduce(ints, compression=comp,
                                                                    op=hvd.Sum),
          torch.arange(4) * N + N * (N - 1) // 2)
print(f"rank {R}: allreduce options ok", flush=True)

# --- grouped_allreduce: one fused allreduce per dtype
calls = []
real_async_ = gradsync.torch.requests.allreduce


def counting(tensor, *args, **kwargs):
    calls.append(tensor.dtype)
    return real_async_(tensor, *args, **kwargs)


gradsync.torch.requests.allreduce = counting
group = [values("sum", R).to(d) for d in (torch.float32, torch.int64, torch.float32,
                                          torch.bfloat16, torch.int64, torch.float32)]
want = [reference("sum", t.dtype) for t in group]
for form in ("grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
             "grouped_allreduce_async_"):
    calls.clear()
    inputs = [t.clone() for t in group]
    result = getattr(hvd, form)(inputs, op=hvd.Sum, name=form)
    if "async" in form:
        result = hvd.synchronize(result)
    if calls != [torch.float32, torch.int64, torch.bfloat16]:
        sys.exit(f"rank {R}: {form}: expected one allreduce per dtype, got {calls}")
    for k, (got, w) in enumerate(zip(result, want)):
        check(f"{form} [{k}]", got, w)
        check_dtype(f"{form} [{k}]", got, group[k].dtype)
    if form.endswith("_"):
        assert all(a is b for a, b in zip(result, inputs)), form
    else:
        check(f"{form} input untouched", inputs[0], group[0])
gradsync.torch.requests.allreduce = real_async_
check("grouped_allreduce fp16 compression",
      hvd.grouped_allreduce([x / 3, x], op=hvd.Sum, compression=hvd.Compression.fp16)[0],
      torch.full((5,), N * (N + 1) / 6), exact=False)
assert hvd.grouped_allreduce([]) == []
print(f"rank {R}: grouped_allreduce ok", flush=True)

# --- allgather (rank r has r + 1 rows), broadcast from every root, alltoall, reducescatter
for dtype in DTYPES:
    x = torch.full((R + 1, 2), R).to(dtype)
    want = torch.cat([torch.full((r + 1, 2), r) for r in range(N)])
    check(f"allgather {dtype}", hvd.allgather(x), want)
    check(f"allgather_async {dtype}", hvd.synchronize(hvd.allgather_async(x)), want)
    for root in range(N):
        x = (torch.arange(6).reshape(2, 3) + 10 * R).to(dtype)
        want = torch.arange(6).reshape(2, 3) + 10 * root
        check(f"broadcast {dtype} root={root}", hvd.broadcast(x, root), want)
        check(f"broadcast_async {dtype}", hvd.synchronize(hvd.broadcast_async(x, root)), want)
        check(f"broadcast {dtype} untouched", x, torch.arange(6).reshape(2, 3) + 10 * R)
        assert hvd.broadcast_(x, root_rank=root) is x
        check(f"broadcast_ {dtype}", x, want)
        x = (torch.arange(6).reshape(2, 3) + 10 * R).to(dtype)
        hvd.synchronize(hvd.broadcast_async_(x, root))
        check(f"broadcast_async_ {dtype}", x, want)
    even = torch.full((2 * N, 3), R).to(dtype)
    check(f"alltoall {dtype}", hvd.alltoall(even), torch.arange(N).repeat_interleave(2)
          .unsqueeze(1).expand(2 * N, 3))
    splits = [(j + R) % 3 for j in range(N)]
    rows = torch.cat([torch.full(((j + R) % 3, 1), 10 * R + j) for j in range(N)]).to(dtype)
    out, received = hvd.alltoall(rows, splits=torch.tensor(splits, dtype=torch.int32))
    check(f"alltoall splits {dtype}", out,
          torch.cat([torch.full(((R + j) % 3, 1), 10 * j + R) for j in range(N)]))
    check(f"alltoall received splits {dtype}", received, [(R + j) % 3 for j in range(N)])
    out2, _ = hvd.synchronize(hvd.alltoall_async(rows, splits=splits))
    check(f"alltoall_async {dtype}", out2, out)
    x = (torch.arange(2 * N + 1).unsqueeze(1) + R).to(dtype)
    full = torch.arange(2 * N + 1).unsqueeze(1) * N + N * (N - 1) // 2
    base, extra = divmod(2 * N + 1, N)
    start = R * base + min(R, extra)
    mine = full[start:start + base + (R < extra)]
    check(f"reducescatter Sum {dtype}", hvd.reducescatter(x, op=hvd.Sum), mine)
    check(f"reducescatter_async {dtype}",
          hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)), mine)
    if dtype.is_floating_point:
        check(f"reducescatter Average {dtype}", hvd.reducescatter(x), mine / N, exact=False)
print(f"rank {R}: allgather/broadcast/alltoall/reducescatter ok", flush=True)

# --- autograd, with Horovod's gradient conventions
t = torch.full((4,), float(R + 1), dtype=torch.float64, requires_grad=True)
hvd.allreduce(t, op=hvd.Sum).backward(torch.full((4,), 2.0, dtype=torch.float64))
check("allreduce Sum grad", t.grad, torch.full((4,), 2.0 * N))
t.grad = None
hvd.allreduce(t, op=hvd.Average, prescale_factor=3.0).sum().backward()
check("allreduce Average grad", t.grad, torch.full((4,), 3.0))
ts = [torch.full((2,), 1.0, requires_grad=True), torch.full((3,), 1.0, dtype=torch.float64,
                                                          requires_grad=True)]
outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
(outs[0].sum() + 2 * outs[1].sum()).backward()
check("grouped_allreduce grad 0", ts[0].grad, torch.full((2,), float(N)))
check("grouped_allreduce grad 1", ts[1].grad, torch.full((3,), 2.0 * N))
outs[0].add_(1)  # outputs are not views of one another: in-place use is allowed
t = torch.full((R + 1, 2), float(R), requires_grad=True)
upstream = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)])
hvd.allgather(t).backward(upstream)
check("allgather grad (average of upstream, my rows)", t.grad, torch.full((R + 1, 2), float(R)))
root = N - 1
t = torch.full((3,), float(R), requires_grad=True)
hvd.broadcast(t, root).backward(torch.full((3,), float(R + 1)))
check("broadcast grad", t.grad, torch.full((3,), (N + 1) / 2 if R == root else 0.0))
t = torch.ones(2 * N, 2, requires_grad=True)
hvd.reducescatter(t, op=hvd.Sum).backward(torch.ones(2, 2))
check("reducescatter Sum grad (Horovod: size x)", t.grad, torch.full((2 * N, 2), float(N)))
t.grad = None
hvd.reducescatter(t, op=hvd.Average).backward(torch.ones(2, 2))
check("reducescatter Average grad", t.grad, torch.ones(2 * N, 2))
t = (torch.arange(2 * N, dtype=torch.float32) + 100 * R).unsqueeze(1).requires_grad_()
received = hvd.alltoall(t)
received.backward(received.detach())  # d(sum(y^2)/2)/dx = x: the rows come back home
check("alltoall grad", t.grad, t.detach())
t = torch.ones(3, requires_grad=True)
raises("Max is not differentiable", RuntimeError,
       lambda: hvd.allreduce(t, op=hvd.Max).sum().backward())
print(f"rank {R}: autograd ok", flush=True)

# --- objects, barrier, handles
obj = hvd.broadcast_object({"from": R, "list": list(range(R + 2))} if R == N - 1 else None,
                           root_rank=N - 1)
assert obj == {"from": N - 1, "list": list(range(N + 1))}, obj
assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
hvd.barrier()
h = hvd.allreduce_async(torch.ones(3))
hvd.synchronize(h)
assert hvd.poll(h)
raises("synchronize(None)", TypeError, lambda: hvd.synchronize(None))
raises("poll(3)", TypeError, lambda: hvd.poll(3))

# --- what gradsync cannot honour raises
x = torch.ones(2)
raises("unregistered process set", ValueError,
       lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0])))
check("the global process set", hvd.allreduce(x, process_set=hvd.global_process_set), x)
assert hvd.global_process_set.size() == N and hvd.global_process_set.rank() == R
raises("reducescatter Adasum", NotImplementedError,
       lambda: hvd.reducescatter(torch.ones(N, 2), op=hvd.Adasum))
raises("Adasum of an integer tensor", TypeError,
       lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum))
raises("reducescatter of a scalar", ValueError, lambda: hvd.reducescatter(torch.tensor(1.0)))
raises("init(comm=...)", NotImplementedError, lambda: hvd.init(comm=[0]))
raises("a meta tensor", TypeError, lambda: hvd.allreduce(torch.ones(2, device="meta")))
raises("a list", TypeError, lambda: hvd.allreduce([1.0, 2.0]))
raises("join(device='cuda')", TypeError, lambda: hvd.join(device="cuda"))
raises("broadcast root out of range", ValueError, lambda: hvd.broadcast(x, N))
print(f"rank {R}: objects and errors ok", flush=True)

# --- broadcast_parameters: dict, list and named forms, several dtypes, fused and alone
torch.manual_seed(R)  # every rank starts different
model = torch.nn.Sequential(torch.nn.Linear(3, 40), torch.nn.BatchNorm1d(40),
                            torch.nn.Linear(40, 2).double())
with torch.no_grad():
    model[1].num_batches_tracked.fill_(R + 5)
    model[1].running_mean.fill_(R)
expected = {k: v.clone() for k, v in hvd.broadcast_object(
    {k: v for k, v in model.state_dict().items()} if R == 0 else None, root_rank=0).items()}
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for k, v in model.state_dict().items():
    check(f"broadcast_parameters state_dict {k}", v, expected[k])
    check_dtype(f"broadcast_parameters {k}", v, expected[k].dtype)
for form in ("list", "named"):
    before = [p.detach().clone() for p in model.parameters()]  # equal on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(R)
    params = list(model.parameters()) if form == "list" else model.named_parameters()
    hvd.broadcast_parameters(params, root_rank=N - 1)
    for k, (p, b) in enumerate(zip(model.parameters(), before)):
        check(f"broadcast_parameters {form} #{k}", p.detach(), b + (N - 1))
raises("a non-tensor entry", TypeError, lambda: hvd.broadcast_parameters({"x": 1}, 0))

# --- broadcast_optimizer_state: state on the root only, different hyperparameters elsewhere
for make in (lambda ps: torch.optim.Adam(ps, lr=0.01 if R == 0 else 0.5),
             lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9 if R == 0 else 0.1),
             lambda ps: torch.optim.LBFGS(ps, lr=1.0 if R == 0 else 0.3, history_size=3)):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = make(net.parameters())
    if R == 0:
        def closure():
            opt.zero_grad()
            loss = net(torch.randn(5, 3)).pow(2).sum()
            loss.backward()
            return loss
        for _ in range(2):
            opt.step(closure)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    root_state = hvd.broadcast_object(opt.state_dict(), root_rank=0)
    mine = opt.state_dict()
    name = type(opt).__name__
    assert mine["param_groups"] == root_state["param_groups"], (name, mine["param_groups"])
    assert mine["state"].keys() == root_state["state"].keys(), name
    for pid, st in root_state["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                check(f"broadcast_optimizer_state {name} {key}", mine["state"][pid][key], value)
            elif isinstance(value, list):
                assert len(value) == len(mine["state"][pid][key]), (name, key)
            else:
                assert mine["state"][pid][key] == value, (name, key)
# A scheduler built on the unwrapped optimizer before the broadcast still drives the
# DistributedOptimizer's learning rate afterwards, on every rank (Horovod updates in place).
net = torch.nn.Linear(3, 2)
inner = torch.optim.SGD(net.parameters(), lr=0.1 if R == 0 else 0.7)
scheduler = torch.optim.lr_scheduler.LinearLR(inner, start_factor=0.5, total_iters=4)
dist_opt = hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters())
hvd.broadcast_optimizer_state(dist_opt, root_rank=0)
for _ in range(3):
    net(torch.ones(4, 3)).sum().backward()
    dist_opt.step()
    dist_opt.zero_grad()
    scheduler.step()
lrs = hvd.allgather_object(dist_opt.param_groups[0]["lr"])
assert inner.param_groups[0] is dist_opt.param_groups[0], "param_groups no longer shared"
assert len(set(lrs)) == 1, f"ranks use different learning rates after a broadcast: {lrs}"
print(f"rank {R}: broadcast_parameters/optimizer_state ok", flush=True)

# --- SyncBatchNorm = BatchNorm on the concatenated batch (rank r holds r + 2 samples)
for shape, momentum, affine in (((5,), 0.1, True), ((5, 3, 2), None, True), ((5, 4), 0.3, False)):
    counts = [r + 2 for r in range(N)]
    torch.manual_seed(42)
    full = torch.randn(sum(counts), *shape, dtype=torch.float64) * 3 + 1
    upstream = torch.randn(full.shape, dtype=torch.float64)
    start = sum(counts[:R])
    sync = hvd.SyncBatchNorm(shape[0], momentum=momentum, affine=affine).double()
    bn = torch.nn.BatchNorm1d(shape[0], momentum=momentum, affine=affine).double() \
        if len(shape) < 3 else torch.nn.BatchNorm2d(shape[0], momentum=momentum).double()
    for _ in range(2):  # twice: running statistics accumulate
        x = full[start:start + counts[R]].clone().requires_grad_()
        xf = full.clone().requires_grad_()
        y, yf = sync(x), bn(xf)
        what = f"SyncBatchNorm {shape} momentum={momentum}"
        if not torch.allclose(y, yf[start:start + counts[R]], rtol=1e-10, atol=1e-10):
            sys.exit(f"rank {R}: {what}: output differs from BatchNorm on the full batch")
        (y * upstream[start:start + counts[R]]).sum().backward()
        (yf * upstream).sum().backward()
        if not torch.allclose(x.grad, xf.grad[start:start + counts[R]], rtol=1e-9, atol=1e-10):
            sys.exit(f"rank {R}: {what}: input gradient differs from BatchNorm's")
        for got, want, label in ((sync.running_mean, bn.running_mean, "running_mean"),
                                 (sync.running_var, bn.running_var, "running_var")):
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
                sys.exit(f"rank {R}: {what}: {label} {got.tolist()} != {want.tolist()}")
        if affine:
            for p, q in ((sync.weight, bn.weight), (sync.bias, bn.bias)):
                total = hvd.allreduce(p.grad, op=hvd.Sum)
                if not torch.allclose(total, q.grad, rtol=1e-9, atol=1e-10):
                    sys.exit(f"rank {R}: {what}: summed weight/bias gradient differs")
                p.grad = q.grad = None
    sync.eval(), bn.eval()
    x = full[start:start + counts[R]]
    if not torch.allclose(sync(x), bn(x), rtol=1e-10, atol=1e-12):
        sys.exit(f"rank {R}: SyncBatchNorm eval differs from BatchNorm eval")
converted = hvd.SyncBatchNorm.convert_sync_batchnorm(
    torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)))
assert isinstance(converted[1], hvd.SyncBatchNorm), converted
raises("SyncBatchNorm process_group", NotImplementedError,
       lambda: hvd.SyncBatchNorm(3, process_group=object()))
print(f"rank {R}: SyncBatchNorm ok", flush=True)

# --- join without a DistributedOptimizer: everyone joins at once; the highest rank is last
assert hvd.join(device=hvd.local_rank()) == N - 1  # a device id is accepted (CPU zeros)
print(f"rank {R}: join ok; {C.count} checks passed", flush=True)
hvd.shutdown()
