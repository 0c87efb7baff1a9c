"""DDP over the gradsync backend three ways in the same ranks, window for window: no hook
(``gs-fp32`` of ``gradsync bench compress``), gradsync's compressed hook with
``compression="auto"`` (``gs-auto``), and torch's reference hook that does what DDP does by
itself (``default_hooks.allreduce_hook``: the division, then an asynchronous allreduce of the
bucket): what a Python hook, and auto's path and bookkeeping, cost beside the same steps,
without the 10% that separate jobs move by.

Run on emulated hosts whose links are shaped (root; ``gradsync/testbed/netns.py``)::

    python3 -m gradsync.testbed.netns --hosts h0:1,h1:1,h2:1,h3:1 --rate 1gbit -- \\
        python3 scripts/hook_ab.py [--rounds 14] [--steps 8] [--batch 8]

Every rank builds the bench's language model (``compress_tasks``, the same weights) once per
way, each in its own DDP over one gradsync group, and trains on random byte windows: per
round, each way ``--steps`` steps after a barrier, the ways in turn (reversed every other
round). The first two rounds are not counted (DDP rebuilds its buckets; auto warms up,
calibrates and decides in its first 5 steps). Rank 0 prints, for each way, the median over
the rounds of the slowest rank's wall time and CPU time (the process's, all its threads) per
step, and the wall ratio to no hook. Auto's decision is printed too: at 1 Gbit/s and faster
it chooses none, so its row is the cost of getting there and of checking.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync  # noqa: F401  (registers the "gradsync" backend)
from gradsync.bench.compress_tasks import Sizes, build_model
from gradsync.compress import Auto, HookState, compressed_hook

WAYS = ("none", "auto", "plain")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--steps", type=int, default=8, help="steps per way per round")
    p.add_argument("--batch", type=int, default=8, help="windows per rank (the bench's)")
    args = p.parse_args()
    torch.set_num_threads(1)  # several ranks share the cores, as in the bench
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gradsync")
    sizes = Sizes()
    auto = Auto()
    trainers = {}
    for way in WAYS:
        torch.manual_seed(0)
        model = build_model("lm", sizes)
        net = DDP(model, process_group=group, broadcast_buffers=False)
        if way == "auto":
            net.register_comm_hook(HookState(auto, group), compressed_hook)
        elif way == "plain":
            net.register_comm_hook(group, allreduce_hook)
        trainers[way] = (net, torch.optim.AdamW(model.parameters(), 3e-3))
    gen = torch.Generator().manual_seed(rank)
    wall: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            net, opt = trainers[way]
            dist.barrier()
            began, began_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                w = torch.randint(0, 256, (args.batch, sizes.lm_context + 1), generator=gen)
                opt.zero_grad(set_to_none=True)
                out = net(w[:, :-1])
                F.cross_entropy(out.reshape(-1, out.shape[-1]), w[:, 1:].reshape(-1)).backward()
                opt.step()
            spent = torch.tensor([time.perf_counter() - began, time.process_time() - began_cpu],
                                 dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            if round_ >= 2:
                wall[way].append(float(spent[0]) / args.steps)
                cpu[way].append(float(spent[1]) / args.steps)
    if rank == 0:
        base = statistics.median(wall["none"])
        print(f"{size} ranks, {args.rounds - 2} rounds of {args.steps} steps counted")
        for way in WAYS:
            print(f"{way:6} wall {statistics.median(wall[way]) * 1e3:7.1f} ms/step  cpu "
                  f"{statistics.median(cpu[way]) * 1e3:7.1f} ms/step  wall/none "
                  f"{statistics.median(wall[way]) / base:.3f}")
        decision = auto.decision
        print(f"auto: {decision.summary() if decision is not None else 'no decision'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
