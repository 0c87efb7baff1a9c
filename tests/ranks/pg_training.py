"""DDP, FSDP and functional collectives on the "gradsync" backend, against one process.

Run by tests/test_distributed_backend.py (N = 2, 3). N ranks with batch B each must train like
one process with batch N*B (the mean loss over the full batch): every rank trains the
single-process reference itself (same seed, same data) and compares parameters after the
last step. float64 keeps the comparison tight (only summation order differs). The script
exits non-zero at the first difference.
"""

import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync  # noqa: F401  (registers the backend)

warnings.simplefilter("ignore")
torch.set_default_dtype(torch.float64)
dist.init_process_group("gradsync")
R, N = dist.get_rank(), dist.get_world_size()
B, IN, OUT, STEPS = 4, 6, 3, 4
TIGHT = dict(rtol=1e-10, atol=1e-12)
passed = []


fail = Checks(R).fail


class Net(nn.Module):
    def __init__(self, unused: bool = False, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, width), nn.Linear(width, width)
        self.fc3 = nn.Linear(width, OUT)
        self.spare = nn.Linear(width, OUT) if unused else None  # never used in forward

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step: int, rows: int = N * B):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, IN, generator=g), torch.randint(0, OUT, (rows,), generator=g)


def mine(x):
    return x[R * B:(R + 1) * B]


def reference(steps: int, accumulate: int = 1, unused: bool = False):
    """The single-process model after ``steps`` SGD steps on the full batches."""
    torch.manual_seed(0)
    model = Net(unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro)
            (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
    return model


def compare(what: str, model, ref, **tol) -> None:
    mine_ = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        q = mine_.get(name) if name in mine_ else mine_.get(f"module.{name}")
        if q is None:
            continue
        if not torch.allclose(q.detach(), p.detach(), **(tol or TIGHT)):
            fail(f"{what}: {name} differs from the single-process reference by "
                 f"{(q.detach() - p.detach()).abs().max().item():.3g}")
    passed.append(what)


def train_ddp(what: str, accumulate: int = 1, unused: bool = False, hook=None, **kwargs):
    torch.manual_seed(0)
    model = DDP(Net(unused), **kwargs)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro)
            loss = F.cross_entropy(model(mine(x)), mine(y)) / accumulate
            if micro < accumulate - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    return model


# ----------------------------------------------------------------------------- DDP
ref = reference(STEPS)
compare("ddp default buckets", train_ddp("default"), ref)
compare("ddp one bucket per parameter", train_ddp("tiny", bucket_cap_mb=1e-6), ref)
compare("ddp gradient_as_bucket_view", train_ddp("view", gradient_as_bucket_view=True), ref)
compare("ddp static_graph", train_ddp("static", static_graph=True), ref)
compare("ddp find_unused_parameters",
        train_ddp("unused", unused=True, find_unused_parameters=True),
        reference(STEPS, unused=True))
compare("ddp no_sync (2 micro-batches)", train_ddp("no_sync", accumulate=2),
        reference(STEPS, accumulate=2))
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

# Buckets of a slot or more (1 MiB): the backend moves each into shared memory the second
# time it reduces it (gradsync/torch/backend/sharing.py), and every view follows. On one host
# the gradients (views of the buckets) end up shared; the result is the same.
WIDE = 384  # fc2's 384 x 384 float64 weights: 1.1 MiB


def wide(distributed: bool, **kwargs):
    torch.manual_seed(0)
    model = DDP(Net(width=WIDE), **kwargs) if distributed else Net(width=WIDE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        if distributed:
            x, y = mine(x), mine(y)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
wide_ref = wide(False)
for view in (False, True):
    model = wide(True, gradient_as_bucket_view=view)
    compare(f"ddp buckets of a slot or more (gradient_as_bucket_view={view})", model, wide_ref)
    if view:
        moved = [p.grad.untyped_storage().is_shared() for p in model.parameters()]
        if backend.world.shares_host and not any(moved):
            fail("no DDP bucket was moved into shared memory on one host")
        if not backend.world.shares_host and any(moved):
            fail("a DDP bucket was moved into shared memory across hosts")
big = torch.ones(WIDE * WIDE)  # as large, reduced in place twice outside a backward pass
for _ in range(2):
    dist.all_reduce(big)
if big.untyped_storage().is_shared() or big[0].item() != N * N:
    fail("a tensor reduced outside a backward pass moved into shared memory (or is wrong)")
passed.append("all_reduce outside a backward pass: the tensor stays where it is")
compare("ddp fp16_compress_hook", train_ddp("fp16", hook=default_hooks.fp16_compress_hook),
        ref, rtol=1e-2, atol=1e-3)
# (bf16_compress_hook: DDP refuses it without CUDA/NCCL or XPU, whatever the backend)

# Join: rank r has r + 2 batches; the ranks that run out shadow the others' allreduces.
from torch.distributed.algorithms.join import Join  # noqa: E402

torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Join([model]):
    for step in range(R + 2):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(model(mine(x)), mine(y)).backward()
        opt.step()
# Reference: at step s, the ranks that still have data average their gradients over all N
# ranks (a joined rank contributes zeros).
torch.manual_seed(0)
ref_join = Net()
opt = torch.optim.SGD(ref_join.parameters(), lr=0.1)
for step in range(N + 1):
    opt.zero_grad()
    x, y = batch(step)
    live = [r for r in range(N) if step < r + 2]
    for r in live:
        F.cross_entropy(ref_join(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
    for p in ref_join.parameters():
        p.grad /= N
    opt.step()
compare("ddp Join with uneven inputs", model, ref_join)

# ----------------------------------------------------------------------------- FSDP
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402

torch.manual_seed(0)
fsdp = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=True)
opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
for step in range(STEPS):
    opt.zero_grad()
    x, y = batch(step)
    F.cross_entropy(fsdp(mine(x)), mine(y)).backward()
    opt.step()
with FSDP.summon_full_params(fsdp):
    compare("FullyShardedDataParallel (CPU)", fsdp.module, ref)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

mesh = init_device_mesh("cpu", (N,))
torch.manual_seed(0)
net = Net()
for layer in (net.fc1, net.fc2, net.fc3):
    fully_shard(layer, mesh=mesh)
fully_shard(net, mesh=mesh)
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
for step in range(STEPS):
    opt.zero_grad()
    x, y = batch(step)
    F.cross_entropy(net(mine(x)), mine(y)).backward()
    opt.step()
full = {name: p.full_tensor() for name, p in net.named_parameters()}
for name, p in ref.named_parameters():
    if not torch.allclose(full[name], p.detach(), **TIGHT):
        fail(f"fully_shard: {name} differs by {(full[name] - p).abs().max().item():.3g}")
passed.append("fully_shard on a CPU DeviceMesh")

# ----------------------------------------------------------------------------- functional
import torch.distributed._functional_collectives as fc  # noqa: E402

t = torch.full((5,), float(R + 1))
got = fc.all_reduce(t, "sum", dist.group.WORLD)
want = torch.full((5,), float(N * (N + 1) // 2))
if not torch.equal(fc.wait_tensor(got), want):
    fail(f"functional all_reduce: {got} != {want}")
gathered = fc.all_gather_tensor(t, 0, dist.group.WORLD)
if not torch.equal(fc.wait_tensor(gathered),
                   torch.cat([torch.full((5,), float(r + 1)) for r in range(N)])):
    fail(f"functional all_gather_tensor: {gathered}")
scattered = fc.reduce_scatter_tensor(torch.arange(2.0 * N), "sum", 0, dist.group.WORLD)
if not torch.equal(fc.wait_tensor(scattered), torch.arange(2.0 * N)[2 * R:2 * R + 2] * N):
    fail(f"functional reduce_scatter_tensor: {scattered}")
passed.append("functional collectives")

dist.barrier()
print(f"rank {R}: pg training ok: {len(passed)} checks: {', '.join(passed)}", flush=True)
dist.destroy_process_group()
