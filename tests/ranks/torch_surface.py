"""Horovod surface added for issue 10: build queries, op=Adasum, grouped allgather and
reducescatter, sparse allreduce, DistributedOptimizer(op=Adasum).

Run by tests/test_torch_surface.py through ``gradsync run -np N`` (N = 1 .. 4). Adasum results
are checked against the NumPy reference of tests/test_adasum.py (whole vectors, the same tree)
and against closed forms (orthogonal inputs sum, equal ones give themselves back); the other
collectives against closed forms. Exits non-zero at the first wrong value.
"""

import os
import sys

import common  # noqa: F401  (deadline)
from checks import Checks
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradsync.torch as hvd  # noqa: E402
from test_adasum import reference  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks(R)
fail, check, raises = C.fail, C.near, C.raises


def ref(per_rank, counts=None):
    """The NumPy Adasum reference over every rank's float64 vector."""
    flat = [np.asarray(v, dtype=np.float64).reshape(-1) for v in per_rank]
    return torch.from_numpy(reference(flat, counts or [flat[0].size], np.float64))


def rank_vector(r, n, seed):
    return torch.from_numpy(np.random.default_rng(seed * 100 + r).standard_normal(n))


# --- build queries: the truth about gradsync
for query, want in (("mpi_built", False), ("mpi_enabled", False), ("gloo_built", False),
                    ("gloo_enabled", False), ("nccl_built", 0), ("ccl_built", False),
                    ("ddl_built", False), ("cuda_built", False), ("rocm_built", False)):
    got = getattr(hvd, query)()
    if got != want or type(got) is not type(want):
        fail(f"hvd.{query}() = {got!r}, want {want!r}")
raises("mpi_threads_supported", ValueError, hvd.mpi_threads_supported)
if not issubclass(hvd.HorovodInternalError, RuntimeError):
    fail("HorovodInternalError is not a RuntimeError")

# --- Adasum allreduce, every form, against the reference
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
for dtype, tol in TOL.items():
    for n in (0, 1, N - 1, 3 * N + 1, 1000):
        vectors = [rank_vector(r, n, seed=n).to(dtype) for r in range(N)]
        want = ref([v.double() for v in vectors])
        x = vectors[R].clone()
        check(f"allreduce Adasum {dtype} n={n}", hvd.allreduce(x, op=hvd.Adasum), want, tol)
        check(f"allreduce Adasum leaves its input {dtype}", x, vectors[R])
        check(f"allreduce_async Adasum {dtype} n={n}",
              hvd.synchronize(hvd.allreduce_async(x, op=hvd.Adasum, name=f"a{n}")), want, tol)
        y = x.clone()
        hvd.allreduce_(y, op=hvd.Adasum)
        check(f"allreduce_ Adasum {dtype} n={n}", y, want, tol)
        y = x.clone()
        hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Adasum))
        check(f"allreduce_async_ Adasum {dtype} n={n}", y, want, tol)

# Closed forms: orthogonal vectors sum, equal vectors give themselves back; scale factors.
mine = torch.zeros(N, 3, dtype=torch.float64)
mine[R] = R + 1.0
check("Adasum of orthogonal vectors is their sum", hvd.allreduce(mine, op=hvd.Adasum),
      torch.arange(1.0, N + 1, dtype=torch.float64)[:, None].expand(N, 3))
same = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
check("Adasum of equal vectors is the vector", hvd.allreduce(same, op=hvd.Adasum), same)
check("Adasum with prescale 2 and postscale 3",
      hvd.allreduce(same, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=3.0), same * 6)

# --- grouped Adasum: each tensor is reduced as if alone (per-tensor dot products)
shapes = [(4,), (2, 3), (0,), (1,), (7, 5)]
groups = [[rank_vector(r, int(np.prod(s)), seed=20 + i).reshape(s) for r in range(N)]
          for i, s in enumerate(shapes)]
wants = [ref(g).reshape(s) for g, s in zip(groups, shapes)]
mixed = [g[R].clone() if i % 2 else g[R].float() for i, g in enumerate(groups)]
for form in ("grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
             "grouped_allreduce_async_"):
    tensors = [t.clone() for t in mixed]
    out = getattr(hvd, form)(tensors, op=hvd.Adasum, name=f"g.{form}")
    if form.endswith("async") or form.endswith("async_"):
        out = hvd.synchronize(out)
    for i, (got, want) in enumerate(zip(out, wants)):
        check(f"{form} Adasum tensor {i} {got.dtype}", got, want,
              1e-5 if got.dtype == torch.float32 else 1e-12)
    if form.endswith("_"):
        for i, (t, want) in enumerate(zip(tensors, wants)):
            check(f"{form} Adasum in place {i}", t, want, 1e-5 if t.dtype == torch.float32
                  else 1e-12)
raises("reducescatter Adasum", NotImplementedError,
       lambda: hvd.reducescatter(torch.ones(N, 2), op=hvd.Adasum))
raises("grouped_reducescatter Adasum", NotImplementedError,
       lambda: hvd.grouped_reducescatter([torch.ones(N, 2)], op=hvd.Adasum))
raises("Adasum on int64", TypeError,
       lambda: hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum))
print(f"rank {R}: build queries and Adasum ok", flush=True)

# --- grouped_allgather: rank r contributes r + 1 rows of value r (tensor i: i + 1 columns)
rows = torch.arange(N).repeat_interleave(torch.arange(1, N + 1))
for form in ("grouped_allgather", "grouped_allgather_async"):
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        tensors = [torch.full((R + 1, i + 1), R, dtype=dtype) for i in range(3)]
        out = getattr(hvd, form)(tensors, name=f"ga.{form}.{dtype}")
        if form.endswith("async"):
            out = hvd.synchronize(out)
        for i, got in enumerate(out):
            check(f"{form} {dtype} tensor {i}", got, rows[:, None].expand(-1, i + 1).to(dtype))
            if got.dtype != dtype:
                fail(f"{form}: dtype {got.dtype} != {dtype}")
check("grouped_allgather of nothing", torch.tensor(len(hvd.grouped_allgather([]))),
      torch.tensor(0))
# gradient: the average over ranks of the output gradient, cut to this rank's rows
a = torch.zeros(R + 1, 2, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
ga, gb = hvd.grouped_allgather([a, b])
total = N * (N + 1) // 2
(ga * torch.arange(total, dtype=torch.float32)[:, None] * (R + 1)).sum().backward(
    retain_graph=True)
start = R * (R + 1) // 2
mean_factor = (N + 1) / 2  # the average over ranks of (r + 1)
check("grouped_allgather grad", a.grad,
      (torch.arange(start, start + R + 1, dtype=torch.float32) * mean_factor)[:, None]
      .expand(R + 1, 2), 1e-6)

# --- grouped_reducescatter: x_r[j] = r + 1 + j; Sum of rows is closed form
for form in ("grouped_reducescatter", "grouped_reducescatter_async"):
    for op in (hvd.Sum, hvd.Average):
        tensors = [(R + 1 + torch.arange(k * 2, dtype=torch.float64)).reshape(k, 2)
                   for k in (N, 2 * N + 1, 1)]
        out = getattr(hvd, form)(tensors, op=op, name=f"rs.{form}.{op.name}",
                                 prescale_factor=2.0, postscale_factor=0.5)
        if form.endswith("async"):
            out = hvd.synchronize(out)
        for k, got in zip((N, 2 * N + 1, 1), out):
            base, extra = divmod(k, N)
            counts = [base + (r < extra) for r in range(N)]
            first = sum(counts[:R])
            full = (N * (N + 1) / 2 + N * torch.arange(k * 2, dtype=torch.float64)).reshape(k, 2)
            want = full[first:first + counts[R]] / (N if op is hvd.Average else 1)
            check(f"{form} {op!r} k={k}", got, want, 1e-12)
raises("grouped_reducescatter of a scalar", ValueError,
       lambda: hvd.grouped_reducescatter([torch.ones(N), torch.tensor(1.0)]))
t = torch.zeros(2 * N, 3, dtype=torch.float64, requires_grad=True)
(out,) = hvd.grouped_reducescatter([t], op=hvd.Sum)
out.backward(torch.ones_like(out))
check("grouped_reducescatter Sum grad (size x, as Horovod)", t.grad,
      torch.full((2 * N, 3), float(N), dtype=torch.float64))

# --- sparse_allreduce_async: rank r has entries at rows r and N, values r + 1
dense = torch.zeros(N + 1, 3)
dense[R] = R + 1.0
dense[N, R % 3] = 1.0
sparse = dense.to_sparse()
for op, divide in ((hvd.Average, N), (hvd.Sum, 1)):
    got = hvd.sparse_allreduce_async(sparse, name=f"sp.{op.name}", op=op)()
    if not got.is_sparse:
        fail("sparse_allreduce_async returned a dense tensor")
    check(f"sparse_allreduce_async {op!r}", got.to_dense(),
          hvd.allreduce(dense, op=hvd.Sum) / divide, 1e-6)
raises("sparse_allreduce_async of a dense tensor", TypeError,
       lambda: hvd.sparse_allreduce_async(dense, name="d", op=hvd.Sum))
raises("sparse_allreduce_async op=Max", ValueError,
       lambda: hvd.sparse_allreduce_async(sparse, name="m", op=hvd.Max))
print(f"rank {R}: grouped allgather/reducescatter and sparse ok", flush=True)

# --- DistributedOptimizer(op=Adasum): loss = g_r . p, so each rank's gradient is g_r
LR, MOMENTUM = 0.1, 0.5
G = [rank_vector(r, 6, seed=40) for r in range(N)]
H = [rank_vector(r, 3, seed=41) for r in range(N)]


def model():
    torch.manual_seed(0)
    return (torch.nn.Parameter(torch.randn(6, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(3, dtype=torch.float64)))


p, q = model()
p0, q0 = p.detach().clone(), q.detach().clone()
opt = hvd.DistributedOptimizer(torch.optim.SGD([p, q], lr=LR, momentum=MOMENTUM),
                               named_parameters=[("p", p), ("q", q)], op=hvd.Adasum)
if not isinstance(opt, torch.optim.SGD):
    fail("the Adasum DistributedOptimizer is not an SGD")
for step in range(2):
    opt.zero_grad()
    ((G[R] * p).sum() + (H[R] * q).sum()).backward()
    check(f"step {step}: parameters unchanged between backward and step", p,
          p0 - LR * ref(G) * (0 if step == 0 else 1), 1e-12)
    if step == 0:
        raises("zero_grad after backward", RuntimeError, opt.zero_grad)
        raises("skip_synchronize", RuntimeError, lambda: opt.skip_synchronize().__enter__())
    opt.synchronize()  # Horovod's: does nothing under Adasum
    opt.step()
# momentum: the local steps are -lr g_r, then -lr (1 + m) g_r; Adasum scales with its inputs
check("Adasum optimizer, SGD with momentum, p", p, p0 - LR * (2 + MOMENTUM) * ref(G), 1e-12)
check("Adasum optimizer, SGD with momentum, q", q, q0 - LR * (2 + MOMENTUM) * ref(H), 1e-12)

# A parameter only rank 0 uses: the others' deltas are zero, and zero is neutral in Adasum.
p, q = model()
p0, q0 = p.detach().clone(), q.detach().clone()
opt = hvd.DistributedOptimizer(torch.optim.SGD([p, q], lr=LR), op=hvd.Adasum,
                               backward_passes_per_step=2)
opt.zero_grad()
for _ in range(2):
    loss = (G[R] * p).sum() + ((H[R] * q).sum() if R == 0 else 0)
    loss.backward()
raises("a third backward pass", RuntimeError, lambda: (G[R] * p).sum().backward())
opt.step()
check("Adasum optimizer, 2 passes per step, p", p, p0 - 2 * LR * ref(G), 1e-12)
check("Adasum optimizer, q used on rank 0 only", q, q0 - 2 * LR * H[0], 1e-12)

# Adam: its state evolves from the local gradient only; one rank's Adam step is reproducible.
p, q = model()
p0 = p.detach().clone()
opt = hvd.DistributedOptimizer(torch.optim.Adam([p, q], lr=0.01), op=hvd.Adasum)
opt.zero_grad()
((G[R] * p).sum() + (H[R] * q).sum()).backward()
opt.step()
deltas = [None] * N
for r in range(N):  # Adam's first step is lr * sign(g) (up to eps) on every rank
    x = torch.nn.Parameter(p0.clone())
    o = torch.optim.Adam([x], lr=0.01)
    x.grad = G[r].clone()
    o.step()
    deltas[r] = (x - p0).detach()
check("Adasum optimizer, Adam", p, p0 + ref(deltas), 1e-12)
if len(opt.state) != 2:
    fail(f"Adam state for {len(opt.state)} parameters, want 2")
print(f"rank {R}: {C.count} surface checks passed", flush=True)
hvd.shutdown()
