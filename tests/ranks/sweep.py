"""Every collective x dtype x algorithm x element count, against a NumPy reference.

    sweep.py [tcp|python|hosts=LAYOUT]

Run by tests/test_collectives.py for N = 1..4, in the job of each size that tests/small_jobs.py
starts (and alone by ``harness.spawn`` on emulated hosts). ``tcp`` joins every pair over TCP;
``python`` keeps the host's shared segment on its Python road (the compiled one off). The
settings are ``init()``'s keyword arguments, not GRADSYNC_* variables: the job's environment
is shared by every script it runs. ``hosts=LAYOUT`` is the one exception: rank r plays host
LAYOUT[r] (``aabb``: two hosts of two ranks), a name that ``init()`` reads from
``GRADSYNC_HOSTNAME`` only; this script sets it for its own ``init()`` and puts the job's back
after its ``shutdown()``. Prints one line per collective family and exits non-zero at
the first wrong element.
"""

import os
import sys

import common  # noqa: F401  (deadline)
from checks import Checks
import numpy as np
import torch

import gradsync as gs

MODE = sys.argv[1] if len(sys.argv) > 1 else "default"
SETTINGS = {"tcp": {"transport": "tcp"}, "python": {"shm_fast": False}}.get(MODE, {})
JOB_HOSTNAME = os.environ.get("GRADSYNC_HOSTNAME")
if MODE.startswith("hosts="):  # this rank's host: RANK under torchrun, GRADSYNC_RANK under run
    rank = int(os.environ.get("GRADSYNC_RANK", os.environ.get("RANK", "0")))
    os.environ["GRADSYNC_HOSTNAME"] = f"host-{MODE[len('hosts='):][rank]}"
gs.init(chunk_bytes=256, shm_slot_bytes=1024, small_bytes=256, medium_bytes=2048, **SETTINGS)
R, N = gs.rank(), gs.size()
OPS = {"sum": gs.Sum, "average": gs.Average, "min": gs.Min, "max": gs.Max, "product": gs.Product}
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "float16", "bfloat16", "bool"]
COUNTS = [0, 1, max(N - 1, 1), 7 * N + 3, 1000]  # 1000 elements span many 256-byte chunks
ALGORITHMS = ["auto", "ring", "topo_ring", "doubling", "halving_doubling", "hierarchical"]
if gs.local_size() == N and MODE != "tcp":
    ALGORITHMS.append("shm")
checked = 0
fail = Checks(R).fail


def make(values, dtype):
    """A tensor of ``values`` in ``dtype``: torch for bfloat16, NumPy otherwise."""
    if dtype == "bfloat16":
        return torch.tensor(values, dtype=torch.bfloat16)
    return np.asarray(values).astype(dtype)


def as_np(x, dtype):
    return x.float().numpy() if dtype == "bfloat16" else np.asarray(x)


def reference(kind, dtype, count):
    stack = np.stack([gs_inputs(kind, r, count) for r in range(N)]).astype(np.float64)
    if dtype == "bool":
        stack = stack.astype(bool)
        return (stack.any(0) if kind in ("sum", "average", "max") else stack.all(0))
    ref = {"sum": stack.sum(0), "average": stack.sum(0), "min": stack.min(0),
           "max": stack.max(0), "product": stack.prod(0)}[kind]
    if kind == "average":
        ref = np.floor(ref / N) if np.dtype("float32" if dtype == "bfloat16" else dtype).kind in "iu" else ref / N
    return ref


gs_inputs = common.inputs


def check(what, got, want, dtype, exact=True):
    global checked
    checked += 1
    got = as_np(got, dtype).astype(np.float64)
    want = (as_np(want, dtype) if isinstance(want, torch.Tensor) else np.asarray(want)).astype(np.float64)
    if got.shape != want.shape:
        fail(f"{what}: shape {got.shape} != {want.shape}")
    ok = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=2e-2)
    if not ok:
        bad = np.flatnonzero(~np.isclose(got, want, rtol=2e-2))[:5]
        fail(f"{what}: wrong at {bad.tolist()}: got {got.ravel()[bad]} want "
             f"{want.ravel()[bad]}")


# --- allreduce: every op x dtype x count x algorithm, out-of-place and in-place
for alg in ALGORITHMS:
    for dtype in DTYPES:
        for count in COUNTS:
            for kind, op in OPS.items():
                if dtype == "bool" and kind == "average":
                    continue
                x = make(gs_inputs(kind, R, count), dtype)
                want = reference(kind, dtype, count)
                exact = kind != "average" or dtype in ("int32", "int64", "uint8")
                what = f"allreduce {kind} {dtype}[{count}] algorithm={alg}"
                y = gs.allreduce(x, op=op, algorithm=alg, name=what)
                check(what, y, want, dtype, exact)
                check(what + " (input untouched)", x, make(gs_inputs(kind, R, count), dtype), dtype)
                if kind == "sum" and count:
                    gs.allreduce_(x, op=op, algorithm=alg)
                    check(what + " in place", x, want, dtype)
print(f"rank {R}: allreduce ok", flush=True)

# --- scaling and async forms
x = np.full(10, R + 1, dtype=np.float64)
y = gs.allreduce(x, op=gs.Sum, prescale_factor=2.0, postscale_factor=0.5)
check("allreduce prescale/postscale", y, np.full(10, N * (N + 1) / 2), "float64")
handles = [gs.allreduce_async(np.full(100 * k, R, dtype=np.float32), op=gs.Sum, name=f"a{k}")
           for k in range(5)]
inplace = np.full(33, R, dtype=np.int64)
h_in = gs.allreduce_async_(inplace, op=gs.Max)
for k, h in enumerate(handles):
    check(f"allreduce_async {k}", gs.synchronize(h), np.full(100 * k, N * (N - 1) / 2), "float32")
assert gs.synchronize(h_in) is inplace and gs.poll(h_in)
check("allreduce_async_", inplace, np.full(33, N - 1), "int64")
t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, ::2]  # non-contiguous
gs.allreduce_(t, op=gs.Sum)
check("allreduce_ non-contiguous torch", t, np.arange(12).reshape(3, 4)[:, ::2] * N, "float32")
print(f"rank {R}: scaling/async ok", flush=True)

# --- allgather: first dimension differs per rank (rank r has r rows: rank 0 has none)
for dtype in DTYPES:
    rows = R
    x = make(np.full((rows, 3), R), dtype)
    want = np.concatenate([np.full((r, 3), r) for r in range(N)]).astype(np.float64)
    if dtype == "bool":
        want = want.astype(bool)
    check(f"allgather {dtype}", gs.allgather(x), want, dtype)
    check(f"allgather_async {dtype}", gs.synchronize(gs.allgather_async(x)), want, dtype)
print(f"rank {R}: allgather ok", flush=True)

# --- broadcast from every root, every dtype, sizes from 0 to multi-chunk
for root in range(N):
    for dtype in DTYPES:
        for count in COUNTS:
            x = make(np.arange(count) % 7 + (R == root), dtype)
            want = np.arange(count) % 7 + 1
            if dtype == "bool":
                want = want.astype(bool)
            check(f"broadcast root={root} {dtype}[{count}]", gs.broadcast(x, root), want, dtype)
            gs.broadcast_(x, root_rank=root)
            check(f"broadcast_ root={root} {dtype}[{count}]", x, want, dtype)
print(f"rank {R}: broadcast ok", flush=True)

# --- reducescatter: uneven rows
for dtype in ["float32", "int64", "float16", "bfloat16"]:
    for rows in [0, 1, N + 1, 5 * N + 2, 300]:
        x = make(np.tile(gs_inputs("sum", R, rows)[:, None], (1, 2)), dtype)
        full = np.tile(reference("sum", dtype, rows)[:, None], (1, 2))
        base, extra = divmod(rows, N)
        start = R * base + min(R, extra)
        mine = full[start:start + base + (R < extra)]
        check(f"reducescatter sum {dtype} rows={rows}", gs.reducescatter(x, op=gs.Sum), mine, dtype)
print(f"rank {R}: reducescatter ok", flush=True)

# --- alltoall: rank r sends (j + r) % 3 rows to rank j
for dtype in ["float32", "int32", "bfloat16"]:
    splits = [(j + R) % 3 for j in range(N)]
    rows = np.concatenate([np.full(((j + R) % 3, 2), 10 * R + j) for j in range(N)]
                          or [np.zeros((0, 2))]).reshape(-1, 2)
    out, received = gs.alltoall(make(rows, dtype), splits=splits)
    want = np.concatenate([np.full(((R + j) % 3, 2), 10 * j + R) for j in range(N)]).reshape(-1, 2)
    check(f"alltoall {dtype}", out, want, dtype)
    assert list(received.tolist() if hasattr(received, "tolist") else received) == \
        [(R + j) % 3 for j in range(N)], received
    even = make(np.full((2 * N, 1), R), dtype)
    check(f"alltoall even {dtype}", gs.alltoall(even), np.repeat(np.arange(N), 2)[:, None], dtype)
print(f"rank {R}: alltoall ok", flush=True)

# --- objects and barrier
obj = gs.broadcast_object({"rank": R, "list": list(range(R + 3))} if R == N - 1 else None,
                          root_rank=N - 1)
assert obj == {"rank": N - 1, "list": list(range(N + 2))}, obj
assert gs.allgather_object(("r", R) * (R + 1)) == [("r", r) * (r + 1) for r in range(N)]
gs.barrier()
group = gs.job.world().shm_group
road = "none" if group is None else "compiled" if group.fast else "python"
print(f"rank {R}: objects ok; {checked} checks passed; shm road {road}; "
      f"{gs.local_size()} ranks on host {gs.job.world().env.hostname}", flush=True)
gs.shutdown()
if JOB_HOSTNAME is None:  # the job's own environment again, for the scripts after this one
    os.environ.pop("GRADSYNC_HOSTNAME", None)
else:
    os.environ["GRADSYNC_HOSTNAME"] = JOB_HOSTNAME
