"""What a training step pays for synchronising, separated (issue 12, docs/benchmarks-history.md).

Run as ``gradsync run -np 2 python3 scripts/train_costs.py``. The MLP of ``gradsync bench
train`` (batch 32, SGD with momentum, one thread per rank), eight modes taking turns over 5
windows of 10 steps, each window timed on the slowest rank:

- ``local``: no communication;
- ``barrier``: a barrier after each step (the cost of synchronising alone);
- ``tiny``: a 4-byte allreduce after each step;
- ``views``: the gradients are views of one flat buffer, zeroed in place before each step
  (DistributedOptimizer's default ``zero_grad()``), and nothing is communicated: what the
  bucket views alone cost;
- ``inline``: the gradients are views of one flat buffer, allreduced (Average) on the caller
  thread right after backward (``gs.allreduce_``: no negotiation thread);
- ``controller``: ``gradsync.torch.DistributedOptimizer`` (its negotiation thread);
- ``ddp``: ``DistributedDataParallel`` (its defaults) over the torch.distributed backend
  "gradsync";
- ``ddp_none``: the same DDP with a comm hook that communicates nothing (every rank keeps its
  own gradients): what DDP itself costs (its gradient copies and hooks), so the fastest any
  backend can make ``ddp``;
- ``ddp_gloo``: the same DDP over a gloo group (``new_group(backend="gloo")``), the peer of
  ``ddp`` in the same processes.

Prints each mode's step time, its rate over ``local`` and, for the DDP modes, ``ddp_gloo``'s
step time over theirs (docs/benchmarks.md, "Training, 2 ranks on one host").
"""

import functools
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradsync as gs
import gradsync.torch as hvd


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    m1 = model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.01, momentum=0.9)
    m2 = model()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.01, momentum=0.9)
    flat = torch.zeros(sum(p.numel() for p in m2.parameters()))
    offset = 0
    for p in m2.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    m3 = model()
    o3 = hvd.DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=m3.named_parameters())
    small = torch.zeros(1)
    world = gs.job.world()
    dist.init_process_group("gradsync", store=dist.PrefixStore("costs", world.store.base),
                            rank=rank, world_size=hvd.size())
    m4, m5 = model(), model()
    d4 = nn.parallel.DistributedDataParallel(m4)
    o4 = torch.optim.SGD(m4.parameters(), lr=0.01, momentum=0.9)
    d5 = nn.parallel.DistributedDataParallel(m5)
    d5.register_comm_hook(None, keep_own)
    o5 = torch.optim.SGD(m5.parameters(), lr=0.01, momentum=0.9)
    m6 = model()
    d6 = nn.parallel.DistributedDataParallel(m6, process_group=dist.new_group(backend="gloo"))
    o6 = torch.optim.SGD(m6.parameters(), lr=0.01, momentum=0.9)

    def train_step(model, opt):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    local = functools.partial(train_step, m1, o1)
    controller = functools.partial(train_step, m3, o3)
    ddp = functools.partial(train_step, d4, o4)
    ddp_none = functools.partial(train_step, d5, o5)
    ddp_gloo = functools.partial(train_step, d6, o6)

    def barrier():
        local()
        gs.barrier()

    def tiny():
        local()
        gs.allreduce_(small, name="tiny")

    def views():
        flat.zero_()
        F.cross_entropy(m2(x), y).backward()
        o2.step()

    def inline():
        flat.zero_()
        F.cross_entropy(m2(x), y).backward()
        gs.allreduce_(flat, op=gs.Average, name="flat")
        o2.step()

    modes = {"local": local, "barrier": barrier, "tiny": tiny, "views": views,
             "inline": inline, "controller": controller, "ddp": ddp, "ddp_none": ddp_none,
             "ddp_gloo": ddp_gloo}
    for step in modes.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(5):
        for name, step in modes.items():
            gs.barrier()
            start = time.perf_counter()
            for _ in range(10):
                step()
            times[name].append(time.perf_counter() - start)
    slowest = {k: gs.allreduce(np.array(v), op=gs.Max, name=f"costs.{k}") for k, v in times.items()}
    if rank == 0:
        medians = {k: statistics.median(v.tolist()) for k, v in slowest.items()}
        for name, med in medians.items():
            versus = (f"  gloo/this {medians['ddp_gloo'] / med:5.2f}"
                      if name.startswith("ddp") else "")
            print(f"{name:11s} step {med / 10 * 1e3:7.2f} ms (slowest rank)  "
                  f"rate/local {medians['local'] / med:5.2f}{versus}")
    dist.destroy_process_group()
    hvd.shutdown()


def keep_own(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each rank keeps its own gradients."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


if __name__ == "__main__":
    main()
