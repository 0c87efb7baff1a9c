"""One float32 allreduce over gloo and over the gradsync backend, in turn, in one job: the
raw exchange behind ``gradsync bench compress``'s fp32 modes, without DDP or training.

Run on emulated hosts whose links are shaped (root; ``gradsync/testbed/netns.py``)::

    python3 -m gradsync.testbed.netns --hosts h0:1,h1:1,h2:1,h3:1 --rate 25mbit -- \\
        python3 scripts/shaped_allreduce.py [--elements 1329856] [--rounds 4]

Every rank joins a gloo default group and a gradsync group (``new_group``), warms each up
with one allreduce, then runs ``--rounds`` rounds, each a barrier and one timed allreduce per
backend; rank 0 prints each backend's median and its rounds, the wire rate the median
means for a ring's bytes (each rank sends 2 (n - 1) / n of the tensor), and the CPU time a
rank's process spent in a call (all its threads; the median over rounds of the ranks' mean). Set
``GRADSYNC_ALGORITHM`` to compare gradsync's algorithms against gloo (docs/benchmarks.md,
"Slow links").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import gradsync  # noqa: F401  (registers the "gradsync" backend)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=1_329_856,
                   help="float32 elements (default: the bench's language model, 5.3 MB)")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo")
    groups = {"gloo": None, "gradsync": dist.new_group(backend="gradsync")}
    t = torch.ones(args.elements)
    for group in groups.values():
        dist.all_reduce(t, group=group)  # connections made, buffers touched
    times: dict[str, list[float]] = {name: [] for name in groups}
    cpu: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(args.rounds):
        for name, group in groups.items():
            dist.barrier()
            start, used = time.perf_counter(), time.process_time()
            dist.all_reduce(t, group=group)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
    n = dist.get_world_size()
    everyone: list = [None] * n
    dist.all_gather_object(everyone, cpu)
    if dist.get_rank() == 0:
        for name, seconds in times.items():
            median = statistics.median(seconds)
            wire = 2 * (n - 1) / n * 4 * args.elements * 8 / median / 1e6
            used = statistics.median(statistics.mean(c[name][i] for c in everyone)
                                     for i in range(args.rounds))
            print(f"{name}: median {median:.3f} s, rounds "
                  f"{', '.join(f'{s:.3f}' for s in seconds)}; {wire:.1f} Mbit/s on the wire; "
                  f"CPU {used * 1e3:.0f} ms per rank", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
