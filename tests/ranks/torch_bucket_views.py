"""DistributedOptimizer's default zero_grad(): gradients are views of the fusion buffers.

Run by tests/test_torch_optimizer.py through ``gradsync run -np N``. A model of two float32
vectors (weight ``w`` of 5, ``b`` of 3; one bucket, or one bucket each with a tiny fusion
threshold) with the loss ``(r + 1) * (w.sum() + b.sum())`` on rank r: each gradient is
``(r + 1)`` everywhere, so the average over N ranks is ``(N + 1) / 2`` per pass, exactly.
Checked, for both thresholds (at N = 1 there are no buckets: ``zero_grad()`` is torch's,
gradients None):

- the first round (gradients None, allocated by backward) copies them into the buckets;
- from the second on, after ``zero_grad()`` every ``p.grad`` is zero and lies inside its
  bucket's buffer (``data_ptr`` within the buffer's bytes), and stays there through backward
  and ``step()``; backward writes into the bucket directly: no gradient is staged (copied);
- the reduced gradient is the closed-form average, with one and with two backward passes
  per step (accumulated in the bucket: ``2 * (N + 1) / 2``);
- ``zero_grad(set_to_none=True)`` sets every gradient to None (``p.grad is None``), the next
  round stages copies and reduces the same values, and the one after ``zero_grad()`` is back
  on the views; ``zero_grad(set_to_none=False)`` keeps the views;
- a backward with ``create_graph=True`` (autograd then replaces the gradient with a new
  tensor instead of adding into the view) is staged and reduced the same;
- a parameter that is not contiguous (a transposed matrix) is bound to its view like the
  others, and reduced the same;
- a frozen parameter's gradient is set to None, and a sparse gradient stays sparse round after
  round (it is never bound to a dense view).
"""

import common  # noqa: F401  (deadline)
from checks import Checks
import torch

import gradsync.job
import gradsync.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()


fail = Checks(R).fail


def inside(grad: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= grad.data_ptr() and grad.data_ptr() + grad.numel() * grad.element_size() <= end


def backward(w, b):
    ((R + 1) * (w.sum() + b.sum())).backward()


def expect_views(opt, params, what: str) -> None:
    buckets = {id(p): bucket for bucket in opt._gs_buckets for p, _ in bucket.pairs}
    for p in params:
        if p.grad is None or not inside(p.grad, buckets[id(p)].buffer):
            fail(f"{what}: a gradient is not a view of its bucket")


def expect_values(params, value: float, what: str) -> None:
    for p in params:
        if not torch.equal(p.grad, torch.full_like(p, value)):
            fail(f"{what}: gradient {p.grad.tolist()}, expected {value} everywhere")


world = gradsync.job.world()
default = world.config.fusion_threshold
for threshold in (default, 4):
    world.config = world.config.replace(fusion_threshold=threshold)
    w = torch.nn.Parameter(torch.zeros(5))
    b = torch.nn.Parameter(torch.zeros(3))
    params = [w, b]
    for passes in (1, 2):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                       named_parameters=[("w", w), ("b", b)],
                                       backward_passes_per_step=passes)
        if N > 1 and len(opt._gs_buckets) != (1 if threshold == default else 2):
            fail(f"threshold {threshold}: {len(opt._gs_buckets)} buckets")
        tag = f"threshold {threshold}, {passes} pass(es)"
        for step in range(3):
            opt.zero_grad()
            if N > 1 and step > 0:
                expect_views(opt, params, f"{tag}, step {step}, after zero_grad()")
                expect_values(params, 0.0, f"{tag}, step {step}, after zero_grad()")
            elif any(p.grad is not None for p in params):
                # One rank: no buckets, torch's way. Before the first backward, no parameter
                # is known to get a dense gradient (a sparse one must not meet a dense view).
                fail(f"{tag}, step {step}: zero_grad() should set the gradients to None")
            for _ in range(passes):
                backward(w, b)
            staged = [s is not None for s in opt._gs_staged]
            if N > 1 and step > 0 and any(staged):
                fail(f"{tag}, step {step}: a gradient was staged (copied) into its bucket")
            if N > 1 and step == 0 and not all(staged):
                fail(f"{tag}: the first round's gradients (allocated by backward) were not staged")
            pointers = [p.grad.data_ptr() for p in params]
            opt.step()
            expect_values(params, passes * (N + 1) / 2, f"{tag}, step {step}")
            if N > 1 and step > 0 and [p.grad.data_ptr() for p in params] != pointers:
                fail(f"{tag}, step {step}: step() moved the gradients out of the buckets")
        # set_to_none=True: p.grad is None, the next round copies into the buckets
        opt.zero_grad(set_to_none=True)
        if any(p.grad is not None for p in params):
            fail(f"{tag}: zero_grad(set_to_none=True) left a gradient")
        for _ in range(passes):
            backward(w, b)
        if N > 1 and all(s is None for s in opt._gs_staged):
            fail(f"{tag}: after set_to_none=True the gradients should have been staged")
        opt.step()
        expect_values(params, passes * (N + 1) / 2, f"{tag}, after set_to_none=True")
        if N > 1:
            expect_views(opt, params, f"{tag}, reduced after set_to_none=True")
        opt.zero_grad(set_to_none=False)
        expect_values(params, 0.0, f"{tag}, after zero_grad(set_to_none=False)")
        if N > 1:
            expect_views(opt, params, f"{tag}, after zero_grad(set_to_none=False)")
        for _ in range(passes):
            backward(w, b)
        opt.step()
        expect_values(params, passes * (N + 1) / 2, f"{tag}, after set_to_none=False")
        # create_graph=True: autograd makes a new gradient instead of adding into the view
        opt.zero_grad()
        for _ in range(passes):
            ((R + 1) * (w.sum() + b.sum())).backward(create_graph=True)
        if N > 1 and not all(s is not None for s in opt._gs_staged):
            fail(f"{tag}: with create_graph=True the gradients should have been staged")
        opt.step()
        expect_values(params, passes * (N + 1) / 2, f"{tag}, create_graph=True")
        del opt

# A parameter that is not contiguous (a transposed matrix) is bound to its view like the
# contiguous one beside it: backward adds into the view whatever the parameter's strides.
t = torch.nn.Parameter(torch.zeros(2, 3).t())
c = torch.nn.Parameter(torch.zeros(4))
opt = hvd.DistributedOptimizer(torch.optim.SGD([t, c], lr=0.0),
                               named_parameters=[("t", t), ("c", c)])
for step in range(3):
    opt.zero_grad()
    if N > 1 and step > 0:
        expect_views(opt, [t, c], f"not contiguous, step {step}, after zero_grad()")
    ((R + 1) * (t.sum() + c.sum())).backward()
    if N > 1 and step > 0 and any(s is not None for s in opt._gs_staged):
        fail(f"not contiguous, step {step}: a gradient was staged")
    opt.step()
    expect_values([t, c], (N + 1) / 2, f"not contiguous, step {step}")
del opt

# Parameters a bucket does not reduce (frozen) keep torch's default: None after zero_grad().
w = torch.nn.Parameter(torch.zeros(4))
frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
opt = hvd.DistributedOptimizer(torch.optim.SGD([w, frozen], lr=0.0),
                               named_parameters=[("w", w), ("frozen", frozen)])
frozen.grad = torch.ones(2)
opt.zero_grad()
if frozen.grad is not None:
    fail("zero_grad() left the gradient of a parameter outside the buckets")
# A sparse gradient (Embedding(sparse=True)) never meets a dense view: it stays sparse, round
# after round, and is reduced as Horovod does (allgather): row r gets 1 from rank r only.
emb = torch.nn.Embedding(6, 2, sparse=True)
opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.0),
                               named_parameters=emb.named_parameters())
expected = torch.zeros(6, 2)
expected[:N] = 1.0 / N
for step in range(3):
    opt.zero_grad()
    emb(torch.tensor([R])).sum().backward()
    opt.step()
    if not emb.weight.grad.is_sparse:
        fail(f"sparse gradient, step {step}: handed back {emb.weight.grad.layout}")
    if not torch.allclose(emb.weight.grad.to_dense(), expected):
        fail(f"sparse gradient, step {step}: {emb.weight.grad.to_dense().tolist()}")
print(f"rank {R}: bucket views ok", flush=True)
hvd.shutdown()
