"""Every torch.distributed collective × dtype × element count on the "gradsync" backend,
against gloo's result in the same processes and against a closed-form reference.

Run by tests/test_distributed_backend.py as torchrun would start it (N = 1, 2, 3; 3 on two
emulated hosts, so shared memory and TCP both carry data). The default group is gradsync's;
``new_group(backend="gloo")`` is the peer. Every rank's inputs are a formula of its rank, so
each rank also computes the exact expected value of every collective. Where gloo refuses a
dtype or op (it has no uint16/32/64, no AVG, no PREMUL_SUM ...) only the reference is
checked, and the script counts those cases. It exits non-zero at the first difference.
"""

import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import torch
import torch.distributed as dist

import gradsync  # noqa: F401  (registers the backend)

warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename
dist.init_process_group("gradsync")
R, N = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
assert dist.get_backend() == "gradsync", dist.get_backend()
RO = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
        torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
DTYPES = FLOATS + INTS + [torch.bool] + COMPLEX
COUNTS = [0, 1, 7, 300]  # 300 elements pass several 256-byte chunks (GRADSYNC_CHUNK_BYTES)
stats = {"checked": 0, "gloo_compared": 0, "gloo_refused": 0}


fail = Checks(R).fail


def wide(dtype):
    return torch.complex128 if dtype.is_complex else \
        torch.float64 if dtype.is_floating_point else torch.int64


def value(rank: int, dtype, count: int, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (exact in every dtype and reduction order)."""
    i = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return (i + rank + salt) % 3 != 0
    base = (i * 3 + rank * 5 + salt) % 4 + 1  # 1..4: products of 3 ranks stay below 65
    if dtype.is_complex:
        return torch.complex(base.double(), ((i + rank) % 3).double()).to(dtype)
    return base.to(dtype)


def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    stats["checked"] += 1
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        fail(f"{what}: got {got.dtype}{list(got.shape)} {got.tolist()[:12]}, want "
             f"{want.dtype}{list(want.shape)} {want.tolist()[:12]}")


def with_gloo(what: str, run, got: torch.Tensor) -> None:
    """Runs ``run(group=GLOO)`` and compares its result with gradsync's ``got``."""
    try:
        peer = run(GLOO)
    except (RuntimeError, ValueError, TypeError) as exc:
        if "gradsync" in str(exc):
            raise
        stats["gloo_refused"] += 1
        return
    stats["gloo_compared"] += 1
    same(f"{what} vs gloo", got, peer)


def reduce_ref(stacked: torch.Tensor, op, dtype) -> torch.Tensor:
    """The reduction over dimension 0 computed wide, cast back to ``dtype``."""
    if dtype == torch.bool:
        if op in (RO.SUM, RO.MAX, RO.BOR):
            return stacked.any(0)
        if op in (RO.PRODUCT, RO.MIN, RO.BAND):
            return stacked.all(0)
        return (stacked.to(torch.int64).sum(0) % 2).bool()  # BXOR
    w = stacked.to(wide(dtype))
    if op == RO.SUM:
        out = w.sum(0)
    elif op == RO.PRODUCT:
        out = w.prod(0)
    elif op == RO.MIN:
        out = w.amin(0)
    elif op == RO.MAX:
        out = w.amax(0)
    elif op == RO.AVG and dtype.is_complex:  # each part divided, as torch's real view does
        total = w.sum(0)
        out = torch.complex(total.real / stacked.shape[0], total.imag / stacked.shape[0])
    elif op == RO.AVG:
        out = w.sum(0) / stacked.shape[0]
    elif op == "premul":
        out = (w * 2).sum(0)
    else:
        fn = {RO.BAND: torch.bitwise_and, RO.BOR: torch.bitwise_or, RO.BXOR: torch.bitwise_xor}[op]
        out = w[0]
        for row in w[1:]:
            out = fn(out, row)
    return out.to(dtype)


def ops_for(dtype):
    if dtype == torch.bool:
        return [RO.SUM, RO.PRODUCT, RO.MIN, RO.MAX, RO.BAND, RO.BOR, RO.BXOR]
    if dtype.is_complex:
        return [RO.SUM, RO.AVG, "premul"]  # torch itself refuses the others on complex
    if dtype.is_floating_point:
        return [RO.SUM, RO.PRODUCT, RO.MIN, RO.MAX, RO.AVG, "premul"]
    return [RO.SUM, RO.PRODUCT, RO.MIN, RO.MAX, RO.BAND, RO.BOR, RO.BXOR]


def torch_op(op):
    return dist._make_nccl_premul_sum(2.0) if op == "premul" else op


def everyone(dtype, count, salt=0):
    return torch.stack([value(r, dtype, count, salt) for r in range(N)]) if count else \
        torch.empty(N, 0, dtype=dtype)


def check_reductions(dtype, count):
    for op in ops_for(dtype):
        name = f"all_reduce {op} {dtype} x{count}"
        t = value(R, dtype, count)
        dist.all_reduce(t, op=torch_op(op))
        same(name, t, reduce_ref(everyone(dtype, count), op, dtype))

        def peer(group, op=op):
            u = value(R, dtype, count)
            dist.all_reduce(u, op=torch_op(op), group=group)
            return u
        with_gloo(name, peer, t)
    # reduce: only the root's result is defined
    t = value(R, dtype, count)
    dist.reduce(t, dst=N - 1, op=RO.SUM)
    if R == N - 1:
        same(f"reduce {dtype} x{count}", t, reduce_ref(everyone(dtype, count), RO.SUM, dtype))
    # reduce_scatter and reduce_scatter_tensor: rank r gets the reduction of block r
    # (every op: the scaled ones and those without a ring reducer take other paths)
    for kind in ops_for(dtype):
        op = torch_op(kind)
        ins = [value(R, dtype, count, salt=b) for b in range(N)]
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter(out, ins, op=op)
        want = reduce_ref(everyone(dtype, count, salt=R), kind, dtype)
        same(f"reduce_scatter {op} {dtype} x{count}", out, want)
        flat = torch.cat(ins)
        out2 = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out2, flat, op=op)
        same(f"reduce_scatter_tensor {op} {dtype} x{count}", out2, want)

        def peer(group, op=op):
            o = torch.empty(count, dtype=dtype)
            dist.reduce_scatter_tensor(o, torch.cat([value(R, dtype, count, salt=b)
                                                     for b in range(N)]), op=op, group=group)
            return o
        if kind != RO.AVG:  # gloo's average multiplies by 1/n: a rounding off the reference
            with_gloo(f"reduce_scatter_tensor {op} {dtype} x{count}", peer, out2)
        # in place, as FSDP may call it: the output is this rank's block of the input
        flat = torch.cat(ins)
        dist.reduce_scatter_tensor(flat[R * count:(R + 1) * count], flat, op=op)
        same(f"reduce_scatter_tensor in place {op} {dtype} x{count}",
             flat[R * count:(R + 1) * count], want)
        # into a strided output (every other element of a wider tensor)
        wider = torch.zeros(2 * count, dtype=dtype)
        dist.reduce_scatter_tensor(wider[::2], torch.cat(ins), op=op)
        same(f"reduce_scatter_tensor strided {op} {dtype} x{count}", wider[::2], want)
        same(f"reduce_scatter_tensor strided {op} {dtype} x{count} leaves the gaps",
             wider[1::2], torch.zeros(count, dtype=dtype))


def check_movement(dtype, count):
    x = value(R, dtype, count)
    # broadcast from the last rank
    b = x.clone()
    dist.broadcast(b, src=N - 1)
    same(f"broadcast {dtype} x{count}", b, value(N - 1, dtype, count))
    # all_gather (list) and all_gather_into_tensor
    outs = [torch.empty(count, dtype=dtype) for _ in range(N)]
    dist.all_gather(outs, x)
    for r in range(N):
        same(f"all_gather {dtype} x{count} from {r}", outs[r], value(r, dtype, count))
    flat = torch.empty(N * count, dtype=dtype)
    dist.all_gather_into_tensor(flat, x)
    same(f"all_gather_into_tensor {dtype} x{count}", flat, everyone(dtype, count).reshape(-1))

    def peer(group):
        o = torch.empty(N * count, dtype=dtype)
        dist.all_gather_into_tensor(o, x, group=group)
        return o
    with_gloo(f"all_gather_into_tensor {dtype} x{count}", peer, flat)
    # in place (the input is this rank's block of the output) and into a strided output
    inplace = torch.zeros(N * count, dtype=dtype)
    inplace[R * count:(R + 1) * count] = x
    dist.all_gather_into_tensor(inplace, inplace[R * count:(R + 1) * count])
    same(f"all_gather_into_tensor in place {dtype} x{count}", inplace, flat)
    wider = torch.zeros(2 * N * count, dtype=dtype)
    dist.all_gather_into_tensor(wider[::2], x)
    same(f"all_gather_into_tensor strided {dtype} x{count}", wider[::2], flat)
    # gather to rank 0, scatter from the last rank
    got = [torch.empty(count, dtype=dtype) for _ in range(N)] if R == 0 else None
    dist.gather(x, got, dst=0)
    if R == 0:
        for r in range(N):
            same(f"gather {dtype} x{count} from {r}", got[r], value(r, dtype, count))
    pieces = [value(N - 1, dtype, count, salt=r) for r in range(N)] if R == N - 1 else None
    mine = torch.empty(count, dtype=dtype)
    dist.scatter(mine, pieces, src=N - 1)
    same(f"scatter {dtype} x{count}", mine, value(N - 1, dtype, count, salt=R))
    # all_to_all: rank s sends s + d + 1 rows of ``count`` elements to rank d (uneven)
    sends = [value(R, dtype, (R + d + 1) * count, salt=d) for d in range(N)]
    recvs = [torch.empty((s + R + 1) * count, dtype=dtype) for s in range(N)]
    dist.all_to_all(recvs, sends)
    for s in range(N):
        same(f"all_to_all {dtype} x{count} from {s}", recvs[s],
             value(s, dtype, (s + R + 1) * count, salt=R))
    rows_in = [R + d + 1 for d in range(N)]
    rows_out = [s + R + 1 for s in range(N)]
    src = torch.cat([value(R, dtype, rows_in[d] * max(count, 1), salt=d).reshape(-1, max(count, 1))
                     for d in range(N)]) if count else torch.empty(sum(rows_in), 0, dtype=dtype)
    dst = torch.empty(sum(rows_out), max(count, 1) if count else 0, dtype=dtype)
    dist.all_to_all_single(dst, src, rows_out, rows_in)
    want = torch.cat([value(s, dtype, rows_out[s] * max(count, 1), salt=R).reshape(-1, max(count, 1))
                      for s in range(N)]) if count else dst
    same(f"all_to_all_single {dtype} x{count}", dst, want)


def check_async_and_futures():
    """Several Works in flight at once; futures carry the output tensors and chain."""
    ts = [value(R, torch.float32, 50, salt=k) for k in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    chained = works[0].get_future().then(lambda fut: fut.value()[0] * 2)
    for k, w in enumerate(works):
        w.wait()
        assert w.is_completed() and w.is_success(), w
        same(f"async all_reduce {k}", ts[k], everyone(torch.float32, 50, salt=k).sum(0))
    value0 = works[1].get_future().wait()
    if not (isinstance(value0, list) and value0[0] is ts[1]):
        fail(f"an all_reduce future's value must be [tensor], got {type(value0)}")
    same("chained future", chained.wait(), ts[0] * 2)
    # the coalesced forms
    a, b = value(R, torch.float32, 9), value(R, torch.float64, 4, salt=1)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    same("coalesced all_reduce a", a, everyone(torch.float32, 9).sum(0))
    same("coalesced all_reduce b", b, everyone(torch.float64, 4, salt=1).sum(0).double())
    # non-contiguous tensors are written back
    m = torch.stack([value(R, torch.float32, 4, salt=k) for k in range(3)]).t()
    dist.all_reduce(m)
    same("non-contiguous all_reduce", m,
         torch.stack([everyone(torch.float32, 4, salt=k).sum(0) for k in range(3)]).t())


def check_objects_and_p2p():
    objs = [None] * N
    dist.all_gather_object(objs, {"rank": R, "name": f"r{R}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(N)], objs
    lst = [f"from {N - 1}", N - 1] if R == N - 1 else [None, None]
    dist.broadcast_object_list(lst, src=N - 1)
    assert lst == [f"from {N - 1}", N - 1], lst
    got = [None] * N if R == 0 else None
    dist.gather_object(("g", R), got, dst=0)
    assert R != 0 or got == [("g", r) for r in range(N)], got
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(N)] if R == 0 else None, src=0)
    assert out == [("s", R)], out
    stats["checked"] += 4
    if N == 1:
        return
    # a ring: each rank sends to the next and receives from the previous, both orders in the
    # batch list, big enough (1 MiB) not to fit in a transport's buffer
    nxt, prv = (R + 1) % N, (R - 1) % N
    for big in (False, True):
        count = (1 << 18) if big else 5
        send = value(R, torch.float32, count)
        recv = torch.empty(count)
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        if R % 2:
            ops.reverse()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(f"batch_isend_irecv x{count}", recv, value(prv, torch.float32, count))
    # blocking send/recv with tags, several messages in a row
    for k in range(3):
        if R == 0:
            dist.send(value(0, torch.int64, 3, salt=k), dst=N - 1, tag=k)
        elif R == N - 1:
            t = torch.empty(3, dtype=torch.int64)
            dist.recv(t, src=0, tag=k)
            same(f"recv {k}", t, value(0, torch.int64, 3, salt=k))
    w = dist.irecv(torch.empty(1), src=prv)
    dist.send(torch.ones(1), dst=nxt)
    w.wait()


def check_subgroups():
    # a subgroup of the even ranks, also a gradsync group (new_group's default backend)
    evens = list(range(0, N, 2))
    sub = dist.new_group(evens)
    if R in evens:
        t = value(R, torch.int32, 5)
        dist.all_reduce(t, group=sub)
        same("subgroup all_reduce", t,
             torch.stack([value(r, torch.int32, 5) for r in evens]).sum(0).int())
        if dist.get_backend(sub) != "gradsync":
            fail(f"new_group's backend is {dist.get_backend(sub)}")
    dist.barrier()


def check_no_fresh_buffers():
    """reduce_scatter_tensor copies its input into one buffer kept by the group, not a fresh
    one per call (whose page faults cost more than the transfer); it only grows.
    all_gather_into_tensor gathers into a contiguous output itself."""
    group = dist.distributed_c10d._get_default_group()  # the ProcessGroupGradsync itself
    big, small = torch.ones(N * 1000), torch.ones(N * 10, dtype=torch.float64)
    dist.reduce_scatter_tensor(torch.empty(1000), big)
    kept = group._scratch.data_ptr()
    for _ in range(3):
        out = torch.empty(10, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, small)
        same("reduce_scatter_tensor after a larger one", out, torch.full((10,), float(N),
                                                                         dtype=torch.float64))
        dist.reduce_scatter_tensor(torch.empty(1000), big)
    if group._scratch.data_ptr() != kept:
        fail("reduce_scatter_tensor allocated a new work buffer for a size it had already")
    # all_gather_into_tensor gathers straight into a contiguous output of the right size
    import gradsync.pipeline.operations as operations
    gather, used = operations.allgather, []

    def spy(*args, into=None, **kwargs):
        out, rows = gather(*args, into=into, **kwargs)
        used.append(into is not None and out is into)
        return out, rows
    operations.allgather = spy
    try:
        dist.all_gather_into_tensor(torch.empty(N * 100), torch.ones(100))
        dist.all_gather_into_tensor(torch.empty(2 * N * 100)[::2], torch.ones(100))
    finally:
        operations.allgather = gather
    if used != [True, False]:
        fail(f"all_gather_into_tensor gathered into the output: {used}, want [True, False]")


def check_float8():
    f8 = torch.float8_e4m3fn
    x = value(R, torch.float32, 6).to(f8)
    outs = [torch.empty(6, dtype=f8) for _ in range(N)]
    dist.all_gather(outs, x)
    for r in range(N):
        same(f"all_gather float8 from {r}", outs[r].float(), value(r, torch.float32, 6).to(f8).float())
    try:
        dist.all_reduce(x)
    except ValueError as exc:
        assert "float8" in str(exc), exc
    else:
        fail("all_reduce of float8 must raise ValueError")


for dtype in DTYPES:
    for count in COUNTS:
        check_reductions(dtype, count)
        check_movement(dtype, count)
check_async_and_futures()
check_objects_and_p2p()
check_subgroups()
check_float8()
check_no_fresh_buffers()
dist.barrier()
print(f"rank {R}: pg collectives ok: {stats}", flush=True)
dist.destroy_process_group()
