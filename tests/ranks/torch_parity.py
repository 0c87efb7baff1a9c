"""DistributedOptimizer: N ranks with batch B each train exactly like one process with N*B.

Run by tests/test_torch_optimizer.py through ``gradsync run -np N`` (N = 2, 3). Each rank also
trains the single-process reference itself (same seed, same data, the full batch) and compares
parameters after every step; every step also checks, through an allgather of a digest, that all
ranks hold bitwise identical parameters. Each recipe runs with a tiny fusion threshold (one
bucket per parameter: ordering and overlap), with the default one (one bucket), and with the
tiny one again where every bucket is a shared buffer (``ShmGroup.shared_buffer``, which only
buckets larger than 32 KiB are by default). The script exits non-zero at the first difference.
"""

import gc
import hashlib

import common  # noqa: F401  (deadline)
from checks import Checks
import torch
import torch.nn.functional as F

import gradsync.job
import gradsync.torch as hvd
from gradsync.torch import buckets
from gradsync.torch import process_sets as psets

hvd.init()
R, N = hvd.rank(), hvd.size()
B, IN, OUT = 4, 5, 3
TIGHT = dict(rtol=1e-9, atol=1e-11)  # float64: only summation order differs
DEFAULT_THRESHOLD = gradsync.job.world().config.fusion_threshold


def set_fusion_threshold(nbytes: int) -> None:
    """Test-only knob: the threshold new DistributedOptimizers plan their buckets with."""
    world = gradsync.job.world()
    world.config = world.config.replace(fusion_threshold=nbytes)


C = Checks(R)
fail, raises = C.fail, C.raises


def batch(step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(N * B, IN, generator=g, dtype=dtype),
            torch.randn(N * B, OUT, generator=g, dtype=dtype))


def mine(t: torch.Tensor) -> torch.Tensor:
    return t[R * B:(R + 1) * B]


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6),
                               torch.nn.Tanh(), torch.nn.Linear(6, OUT))


def twins(make, dtype=torch.float64, make_ref=None):
    """The model and its single-process reference, identically initialised."""
    torch.manual_seed(0)
    model = make().to(dtype)
    torch.manual_seed(0)
    return model, (make_ref or make)().to(dtype)


def same_everywhere(model: torch.nn.Module, what: str) -> None:
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    digests = hvd.allgather_object(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    if len(set(digests)) != 1:
        fail(f"{what}: parameters differ between ranks")


def close(model, ref, what: str, **tol) -> None:
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        if not torch.allclose(a.double(), b.double(), **(tol or TIGHT)):
            fail(f"{what}: {name} differs from the single-process reference by "
                 f"{(a.double() - b.double()).abs().max().item():.3g}")


def plain_step(model, opt, x, y, passes=1):
    """Reference step, and the distributed one with ``passes`` micro-batches."""
    opt.zero_grad()
    for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
        (F.mse_loss(model(xs), ys) / passes).backward()
    opt.step()


def train(what, make_opt, *, steps=3, passes=1, dist_step=None, ref_step=None, make=mlp,
          make_ref=None, dtype=torch.float64, tol=None, **wrap):
    model, ref = twins(make, dtype, make_ref)
    if callable(wrap.get("groups")):
        wrap["groups"] = wrap["groups"](model)
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **wrap)
    ref_opt = make_opt(ref)
    for step in range(steps):
        x, y = batch(step, dtype)
        (dist_step or (lambda m, o, a, b: plain_step(m, o, a, b, passes)))(
            model, opt, mine(x), mine(y))
        (ref_step or plain_step)(ref, ref_opt, x, y)
        same_everywhere(model, f"{what} step {step}")
        close(model, ref, f"{what} step {step}", **(tol or {}))
    return model, opt


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def clip_dist(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        opt.step()


def clip_ref(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()


def summed_ref(model, opt, x, y):  # op=Sum: the gradient of the sum of the ranks' losses
    opt.zero_grad()
    sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(N), y.chunk(N))).backward()
    opt.step()


def closure_step(model, opt, x, y):  # the gradients the closure computes are synchronized
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)


def zero_grad_keep(model, opt, x, y):  # grads stay allocated: backward adds into the buckets
    opt.zero_grad(set_to_none=False)
    F.mse_loss(model(x), y).backward()
    opt.step()


class Branchy(torch.nn.Module):
    """``unused`` never gets a gradient; ``branch`` only on rank 0 (data-dependent)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(IN, 6)
        self.branch = torch.nn.Linear(6, OUT)
        self.unused = torch.nn.Linear(6, OUT)
        self.last = torch.nn.Linear(6, OUT)

    def forward(self, x, use_branch):
        h = torch.tanh(self.first(x))
        return self.last(h) + (self.branch(h) if use_branch else 0)


def branchy_dist(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x, R == 0), y).backward()
    opt.step()


def branchy_ref(model, opt, x, y):
    opt.zero_grad()
    sum(F.mse_loss(model(xs, r == 0), ys)
        for r, (xs, ys) in enumerate(zip(x.chunk(N), y.chunk(N)))).div(N).backward()
    opt.step()


def bn_net(norm):
    return lambda: torch.nn.Sequential(torch.nn.Linear(IN, 8), norm(8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, OUT))


def shared_buckets(opt) -> bool:
    group = psets.controller(hvd.global_process_set).world.shm_group
    return all(group.is_shared(b.buffer.numpy()) for b in opt._gs_buckets)


for threshold, shared in ((0, False), (DEFAULT_THRESHOLD, False), (0, True)):
    set_fusion_threshold(threshold)
    buckets.SHARED_ABOVE = 0 if shared else None
    tag = f"threshold={threshold}{' shared' if shared else ''}"
    if shared_buckets(train(f"SGD {tag}", sgd)[1]) != shared:
        fail(f"{tag}: the buckets should {'' if shared else 'not '}be shared buffers")
    train(f"Adam {tag}", adam)
    train(f"SGD float32 {tag}", sgd, dtype=torch.float32, tol=dict(rtol=1e-5, atol=1e-6))
    train(f"backward_passes_per_step=2 {tag}", adam, passes=2)
    train(f"synchronize/clip/skip_synchronize {tag}", sgd, dist_step=clip_dist,
          ref_step=clip_ref)
    train(f"op=Sum {tag}", sgd, op=hvd.Sum, ref_step=summed_ref)
    train(f"gradient_predivide_factor {tag}", adam, gradient_predivide_factor=float(N))
    train(f"zero_grad(set_to_none=False) {tag}", sgd, dist_step=zero_grad_keep)
    train(f"step(closure) {tag}", sgd, dist_step=closure_step)
    model = train(f"unused parameters {tag}", sgd, make=Branchy, dist_step=branchy_dist,
                  ref_step=branchy_ref)[0]
    if model.unused.weight.grad is None or model.unused.weight.grad.abs().sum() != 0:
        fail("an unused parameter should end the step with a zero gradient, as in Horovod")
    # SGD, not Adam: the gradient of the bias before a BatchNorm is zero up to rounding,
    # which Adam would amplify to full-size steps in either run.
    train(f"SyncBatchNorm {tag}", sgd, make=bn_net(hvd.SyncBatchNorm),
          make_ref=bn_net(torch.nn.BatchNorm1d))
    print(f"rank {R}: {tag}: parity ok", flush=True)

buckets.SHARED_ABOVE = None
set_fusion_threshold(DEFAULT_THRESHOLD)
train("groups=2", adam, groups=2)
train("groups=[[...]]", adam, groups=lambda m: [[m[0].weight, m[4].weight], [m[2].bias]])
for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
    train(f"compression {comp.__name__}", sgd, dtype=torch.float32, compression=comp,
          tol=dict(rtol=1e-2, atol=1e-3))
print(f"rank {R}: groups and compression ok", flush=True)

# --- by default a bucket is a shared buffer when it is larger than 32 KiB and reduced as it is
torch.manual_seed(0)
wide = torch.nn.Sequential(torch.nn.Linear(IN, 1024), torch.nn.Linear(1024, 1)).double()
for kwargs, want in (({}, True), (dict(compression=hvd.Compression.fp16), False)):
    opt = hvd.DistributedOptimizer(sgd(wide), named_parameters=wide.named_parameters(), **kwargs)
    if shared_buckets(opt) != want or not opt._gs_buckets[0].buffer.numel() * 8 > 32 << 10:
        fail(f"a {sum(p.numel() for p in wide.parameters()) * 8}-byte bucket with {kwargs} "
             f"should {'' if want else 'not '}be a shared buffer")
    wide.zero_grad()
    x, y = batch(0)
    F.mse_loss(wide(mine(x)), mine(y)[:, :1]).backward()
    opt.step()
    same_everywhere(wide, f"wide model, {kwargs}")
del opt
print(f"rank {R}: default shared buckets ok", flush=True)


# --- mixed precision, Horovod's pattern: bf16 autocast, GradScaler, clipping between
#     synchronize() and a step inside skip_synchronize(); step 1 has an inf on rank 0 only
def amp(distributed):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    steps = []

    def step(model, opt, x, y):
        if len(steps) == 1:
            x = x.clone()
            if not distributed or R == 0:
                x[0, 0] = float("inf")
        steps.append(x)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if distributed:
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if distributed:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()

    step.scaler = scaler
    return step


dist_amp, ref_amp = amp(True), amp(False)
train("AMP", sgd, dtype=torch.float32, steps=4, dist_step=dist_amp, ref_step=ref_amp,
      tol=dict(rtol=1e-2, atol=1e-3))
if not dist_amp.scaler.get_scale() == ref_amp.scaler.get_scale() == 128.0:
    fail(f"AMP: the inf on rank 0 should halve every rank's scale once: "
         f"{dist_amp.scaler.get_scale()} vs {ref_amp.scaler.get_scale()}")
print(f"rank {R}: AMP ok", flush=True)

# --- buckets: how many allreduces, launched during backward, last layer first
launched = []
real_async_ = gradsync.torch.requests.allreduce


def recording(tensor, name, *args, **kwargs):
    launched.append(name)
    return real_async_(tensor, name, *args, **kwargs)


gradsync.torch.requests.allreduce = recording
for threshold, groups, expect in ((0, None, 6), (DEFAULT_THRESHOLD, None, 1), (0, 2, 2),
                                  (0, "list", 5)):
    set_fusion_threshold(threshold)
    model = mlp().double()
    if groups == "list":
        groups = [[model[0].weight, model[4].weight]]
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=groups)
    for step in range(2):
        launched.clear()
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(mine(x)), mine(y)).backward()
        during = len(launched)
        opt.step()
        if not during == len(launched) == expect:
            fail(f"threshold={threshold} groups={groups}: expected {expect} bucket allreduces, "
                 f"all launched during backward; got {during} during and {len(launched)} in all")
        if not (launched[0].startswith("gradients[0] ") and "4.bias" in launched[0]):
            fail(f"the first bucket should hold the last layer's bias: {launched}")
gradsync.torch.requests.allreduce = real_async_
set_fusion_threshold(DEFAULT_THRESHOLD)
print(f"rank {R}: bucket launches ok", flush=True)


# --- what DistributedOptimizer rejects, and how it behaves like the optimizer it wraps
net = mlp().double()
named = list(net.named_parameters())
D = hvd.DistributedOptimizer
for what, exc, kwargs in (
        ("a parameter without a name", ValueError, dict(named_parameters=named[:2])),
        ("duplicate names", ValueError,
         dict(named_parameters=named + [("0.weight", named[1][1])])),
        ("not (name, parameter) pairs", ValueError, dict(named_parameters=[p for _, p in named])),
        ("one parameter, two names", ValueError,
         dict(named_parameters=named + [("x", named[0][1])])),
        ("op=Min", ValueError, dict(op=hvd.Min)),
        ("op=Adasum with a predivide factor", ValueError,
         dict(op=hvd.Adasum, gradient_predivide_factor=2.0)),
        ("predivide with Sum", ValueError, dict(op=hvd.Sum, gradient_predivide_factor=2.0)),
        ("groups=0", ValueError, dict(groups=0)),
        ("groups with a stranger", ValueError, dict(groups=[[torch.zeros(2)]])),
        ("groups with a repeat", ValueError, dict(groups=[[named[0][1], named[0][1]]])),
        ("backward_passes_per_step=0", ValueError, dict(backward_passes_per_step=0)),
        ("an unregistered process set", ValueError, dict(process_set=hvd.ProcessSet([N]))),
        ("no compress()", TypeError, dict(compression=object()))):
    message = raises(what, exc, lambda: D(sgd(net), **kwargs))
    if what == "a parameter without a name" and "not named" not in message:
        fail(f"unhelpful message: {message}")
raises("wrapping a model", TypeError, lambda: D(net))
subset = D(torch.optim.SGD(net[4].parameters(), lr=0.1), named_parameters=net.named_parameters())
raises("wrapping twice", ValueError, lambda subset=subset: D(subset))
del subset

model = mlp().double()
opt = D(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD", type(opt)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
x, y = batch(0)
F.mse_loss(model(mine(x)), mine(y)).backward()
raises("zero_grad between backward and step", RuntimeError, opt.zero_grad)
opt.step()
scheduler.step()
assert opt.param_groups[0]["lr"] == 0.05, opt.param_groups
summing = D(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum)
summing.zero_grad()
F.mse_loss(model(mine(x)), mine(y)).backward()
summing.synchronize()
reduced = [p.grad.clone() for p in model.parameters()]
summing.synchronize()  # a round is reduced once: with Sum, twice would multiply by N
summing.step()  # no skip_synchronize needed either
for p, g in zip(model.parameters(), reduced):
    if not torch.equal(p.grad, g):
        fail("a second synchronize() (or step() after it) reduced the gradients again")
same_everywhere(model, "after synchronize(), synchronize(), step()")
opt = D(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
opt.load_state_dict(opt.state_dict())
newer = D(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
raises("the superseded optimizer", RuntimeError, opt.step)
newer.zero_grad()
F.mse_loss(model(mine(x)), mine(y)).backward()
newer.step()
same_everywhere(model, "after re-wrapping")
F.mse_loss(model(mine(x)), mine(y)).backward()
raises("a second backward with backward_passes_per_step=1", RuntimeError,
       lambda: F.mse_loss(model(mine(x)), mine(y)).backward())
rank_dependent = torch.nn.Linear(IN, OUT + (R % 2)).double()
if N > 1:
    raises("different models on different ranks", gradsync.CollectiveMismatchError,
           lambda: D(sgd(rank_dependent)))

# changing gradients between backward and synchronize() is refused: the allreduce has started
model = mlp().double()  # the ranks' random generators differ by now: start from rank 0's
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = batch(2)
for set_to_none in (True, False):  # gradients copied into the buckets, or views of them
    opt = D(sgd(model), named_parameters=model.named_parameters())
    plain_step(model, opt, mine(x), mine(y))
    opt.zero_grad(set_to_none=set_to_none)
    F.mse_loss(model(mine(x)), mine(y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    raises(f"clipping before synchronize() (set_to_none={set_to_none})", RuntimeError, opt.step)
model.zero_grad()

# unfreezing behind the optimizer's back is an error; add_param_group re-plans the buckets
model = mlp().double()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
model[4].requires_grad_(False)
opt = D(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
x, y = batch(1)
plain_step(model, opt, mine(x), mine(y))
model[4].requires_grad_(True)
raises("a parameter unfrozen after the optimizer was made", RuntimeError,
       lambda: plain_step(model, opt, mine(x), mine(y)))
model.zero_grad()
opt = D(torch.optim.SGD(model[:4].parameters(), lr=0.1),
        named_parameters=model.named_parameters())
opt.add_param_group({"params": list(model[4].parameters())})
plain_step(model, opt, mine(x), mine(y))
if model[4].weight.grad is None:
    fail("add_param_group: the new parameters got no reduced gradient")
same_everywhere(model, "after add_param_group")

# sparse gradients: reduced as dense with sparse_as_dense=True, handed back sparse
torch.manual_seed(0)
emb = torch.nn.Embedding(10, 3, sparse=True).double()
ref_emb = torch.nn.Embedding(10, 3, sparse=True).double()
ref_emb.load_state_dict(emb.state_dict())
ids = torch.arange(N * 2).remainder(10).reshape(N, 2)
opt = D(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=True)
emb(ids[R]).pow(2).sum().backward()
opt.step()
ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=0.5)
ref_emb(ids).pow(2).sum().div(N).backward()
ref_opt.step()
if not (emb.weight.grad.is_sparse and emb.weight.grad.sparse_dim() == 1):
    fail("sparse_as_dense: the reduced gradient should be sparse again, as backward made it")
close(emb, ref_emb, "sparse_as_dense")
emb.zero_grad()
ref_opt.zero_grad()
opt = D(torch.optim.SGD(emb.parameters(), lr=0.5))  # sparse: allgathered, as in Horovod
emb(ids[R]).pow(2).sum().backward()
opt.step()
ref_emb(ids).pow(2).sum().div(N).backward()
ref_opt.step()
if not emb.weight.grad.is_sparse:
    fail("a sparse gradient reduced without sparse_as_dense should stay sparse")
close(emb, ref_emb, "sparse gradient without sparse_as_dense")
del opt
print(f"rank {R}: argument checks and optimizer behaviour ok", flush=True)

# --- join: rank r runs out of data after 2 + r steps; the others go on. The buckets are
#     shared buffers, so a joined rank's zeros must be too.
del newer, scheduler
gc.collect()
buckets.SHARED_ABOVE = 0
model, ref = twins(mlp)
opt = D(sgd(model), named_parameters=model.named_parameters())
if not shared_buckets(opt):
    fail("join: the buckets should be shared buffers")
other = D(sgd(mlp().double()))  # an idle second optimizer does not disturb join
ref_opt = sgd(ref)
for step in range(2 + N - 1):
    x, y = batch(step)
    active = [r for r in range(N) if step < 2 + r]
    ref_opt.zero_grad()
    # Joined ranks contribute zeros; the average still divides by N (as in Horovod).
    sum(F.mse_loss(ref(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]) for r in active).div(N) \
        .backward()
    ref_opt.step()
    if R in active:
        plain_step(model, opt, mine(x), mine(y))
        close(model, ref, f"join: step {step}")
last = hvd.join()
if last != N - 1:
    fail(f"join() returned {last}; rank {N - 1} joined last")
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
close(model, ref, "join: after broadcasting from the last rank")
same_everywhere(model, "join")
if hvd.join() != N - 1:  # everyone at once: every rank joined "last"; the highest wins
    fail("a second join() should return the highest rank")
hvd.broadcast_optimizer_state(opt, root_rank=last)  # a joined rank's momentum is stale too
plain_step(model, opt, mine(x), mine(y))  # training goes on after join
same_everywhere(model, "a step after join")
print(f"rank {R}: join ok; all passed", flush=True)
hvd.shutdown()
