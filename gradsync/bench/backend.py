"""The torch.distributed backend "gradsync" against gloo, collective by collective.

Run as ``gradsync bench backend -np N [--sizes 1M:64M] [--collectives ...]``; every rank runs
this module. ``gradsync run`` exports torchrun's variables, so ``init_process_group("gradsync")``
joins as a user's script does, and ``new_group(backend="gloo")`` is the peer, in the same
processes. For each collective and size the two backends run in turn on the same tensors,
allocated once before the timing (as FSDP keeps its buffers): warm-up, then timed calls, each
started after a barrier so that ranks start together, each timed on every rank; a sample is the
slowest rank's time. The iteration count is chosen on rank 0 and broadcast. After timing, one
call of known inputs is checked on each backend (#wrong = elements that differ from the closed
form). Only rank 0 prints.

The size is that of the collective's whole tensor: ``all_reduce``'s tensor,
``reduce_scatter_tensor``'s input, ``all_gather_into_tensor``'s output (float32, a multiple of
the rank count). Over TCP the ring's first large allreduces are trials
(``collectives/ring.py``); the warm-up of ``all_reduce`` goes on until they are over.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .allreduce import _TRIAL_WARMUPS, at_least, size_range

__all__ = ["parser", "run", "COLLECTIVES"]

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def _collectives(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in COLLECTIVES]
    if unknown or not names:
        listed = ", ".join(unknown) if unknown else repr(text)
        raise argparse.ArgumentTypeError(f"unknown collective(s) {listed}; "
                                         f"choose from {', '.join(COLLECTIVES)}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench backend")
    p.add_argument("--sizes", default="1M:64M",
                   help="MIN:MAX bytes of the whole tensor, stepping by --factor (default 1M:64M)")
    p.add_argument("--factor", type=at_least(2), default=4,
                   help="size multiplier between rows (default 4)")
    p.add_argument("--collectives", type=_collectives, default=list(COLLECTIVES),
                   help=f"which, separated by commas (default {','.join(COLLECTIVES)})")
    p.add_argument("--seconds", type=at_least(0.0, float), default=0.5,
                   help="target timed seconds per size and backend")
    p.add_argument("--max-iters", type=at_least(1), default=200)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--json", help="write the rows to this file (rank 0)")
    return p


class _Case:
    """One collective on one size: its tensors, the call, and its closed-form check."""

    def __init__(self, name: str, nbytes: int, rank: int, n: int):
        import torch

        self.name, self.rank, self.n = name, rank, n
        count = max(n, nbytes // 4 // n * n)
        self.nbytes = count * 4
        zeros = torch.zeros  # zeros: repeated in-place sums stay finite
        if name == "all_reduce":
            self.inp = self.out = zeros(count)
        elif name == "reduce_scatter_tensor":
            self.inp, self.out = zeros(count), zeros(count // n)
        else:
            self.inp, self.out = zeros(count // n), zeros(count)

    def call(self, dist, group) -> None:
        if self.name == "all_reduce":
            dist.all_reduce(self.inp, group=group)
        elif self.name == "reduce_scatter_tensor":  # torch 2.13 renamed it, older have only this
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
                self.out, self.inp, group=group)
        else:
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
                self.out, self.inp, group=group)

    def wrong(self, dist, group) -> int:
        """Elements that differ from the closed form after one call on known inputs."""
        import torch

        n, r = self.n, self.rank
        self.inp.copy_(torch.arange(self.inp.numel()) % 5 + r)
        self.call(dist, group)
        if self.name == "all_reduce":
            want = n * (torch.arange(self.out.numel()) % 5) + n * (n - 1) / 2
        elif self.name == "reduce_scatter_tensor":
            block = self.out.numel()
            want = n * (torch.arange(r * block, (r + 1) * block) % 5) + n * (n - 1) / 2
        else:
            block = self.inp.numel()
            want = torch.cat([torch.arange(block) % 5 + q for q in range(n)])
        wrong = int(torch.count_nonzero(self.out != want.float()))
        self.inp.zero_()
        self.out.zero_()
        return wrong


def run(args) -> list[dict]:
    import numpy as np
    import torch
    import torch.distributed as dist

    import gradsync  # noqa: F401  (registers the backend)
    from gradsync.collectives import ring

    torch.set_num_threads(1)
    names = args.collectives
    sizes = size_range(args.sizes, args.factor)
    dist.init_process_group("gradsync")
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group().world

    def slowest(samples: list[float]) -> list[float]:
        t = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        return t.tolist()

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        return bool(t.item())

    def timed(fn, iters: int) -> list[float]:
        samples = []
        for _ in range(iters):
            dist.barrier(group=gloo)
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return slowest(samples)

    def measure(case: _Case, group, trying=None) -> dict:
        def fn():
            case.call(dist, group)
        for _ in range(args.warmup):
            fn()
        for _ in range(_TRIAL_WARMUPS if trying is not None else 0):
            if not any_rank(trying()):
                break
            fn()
        probe = timed(fn, 2)
        iters = int(min(args.max_iters, max(5, args.seconds / max(min(probe), 1e-6))))
        box = [iters]
        dist.broadcast_object_list(box, src=0, group=gloo)
        samples = timed(fn, box[0])
        wrong = int(slowest([float(case.wrong(dist, group))])[0])  # the most on any rank
        med = statistics.median(samples)
        return {"time_us": med * 1e6, "iqr_us": float(np.subtract(
            *np.percentile(samples, [75, 25])) * 1e6), "iters": box[0], "wrong": wrong}

    rows = []
    for name in names:
        for size in sizes:
            case = _Case(name, size, rank, n)
            trying = None
            if name == "all_reduce":
                def trying(nbytes=case.nbytes):
                    return ring.measuring(world.comm, nbytes, world.config.chunk_bytes)
            row = {"collective": name, "size": case.nbytes, "ranks": n,
                   "transport": world.config.transport,
                   "gradsync": measure(case, None, trying), "gloo": measure(case, gloo)}
            row["ratio"] = row["gloo"]["time_us"] / max(row["gradsync"]["time_us"], 1e-9)
            rows.append(row)
            if rank == 0:
                _print_row(row, header=len(rows) == 1)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return rows


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(f"# torch.distributed collectives, backend \"gradsync\" against \"gloo\" in the "
              f"same processes, {row['ranks']} ranks, transport={row['transport']}, float32; "
              f"size = the whole tensor; time = median over iterations of the slowest rank; "
              f"ratio = gloo's time / gradsync's", flush=True)
        print(f"{'collective':>24} {'size(B)':>10} {'gradsync(us)':>12} {'#wrong':>6} "
              f"{'gloo(us)':>10} {'#wrong':>6} {'ratio':>6}", flush=True)
    g, o = row["gradsync"], row["gloo"]
    print(f"{row['collective']:>24} {row['size']:>10} {g['time_us']:>12.1f} {g['wrong']:>6} "
          f"{o['time_us']:>10.1f} {o['wrong']:>6} {row['ratio']:>6.2f}", flush=True)


if __name__ == "__main__":
    run(parser().parse_args(sys.argv[1:]))
