"""One float32 allreduce over gloo and over the gradsync backend, in turn, in one job: the
raw exchange behind ``gradsync bench compress``'s fp32 modes, without DDP or training.

Run on emulated hosts whose links are shaped (root; ``gradsync/testbed/netns.py``)::

    python3 -m gradsync.testbed.netns --hosts h0:1,h1:1,h2:1,h3:1 --rate 25mbit -- \\
        python3 scripts/shaped_allreduce.py [--elements 1329856] [--rounds 4]

Every rank joins a gloo default group and a gradsync group (``new_group``), warms each up
with ``--warmup`` allreduces (the default, 25, lets the ring's trials of segment sizes end
first: three sizes, two turns of four allreduces each, ``transport/trials.py``), then runs
``--rounds`` rounds, each a barrier and one timed allreduce per
backend; rank 0 prints each backend's median and its rounds, the wire rate the median
means for a ring's bytes (each rank sends 2 (n - 1) / n of the tensor), and the CPU time a
rank's process spent in a call (all its threads; the median over rounds of the ranks' mean),
and TCP's loss episodes during the calls (the kernel's TcpExt TCPSackRecovery, read by the first
rank of each emulated host in its namespace, summed over the hosts and the rounds). Set
``GRADSYNC_ALGORITHM`` to compare gradsync's algorithms against gloo, ``GRADSYNC_CHUNK_BYTES``
to change the ring's segments (docs/benchmarks.md, "Slow links").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradsync  # noqa: F401  (registers the "gradsync" backend)


def loss_episodes() -> int:
    """TCP's loss recoveries so far in this network namespace (0 for a host's other ranks,
    which share its counters)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    with open("/proc/net/netstat") as f:
        rows = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(dict(zip(rows[0][1:], rows[1][1:]))["TCPSackRecovery"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=1_329_856,
                   help="float32 elements (default: the bench's language model, 5.3 MB)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=25,
                   help="allreduces per backend before the rounds (default 25: the ring's "
                        "segment-size trials end within them)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    groups = {"gloo": None, "gradsync": dist.new_group(backend="gradsync")}
    t = torch.ones(args.elements)
    for group in groups.values():
        for _ in range(args.warmup):  # connections made, buffers touched, trials over
            dist.all_reduce(t, group=group)
    times: dict[str, list[float]] = {name: [] for name in groups}
    cpu: dict[str, list[float]] = {name: [] for name in groups}
    losses = dict.fromkeys(groups, 0)
    for _ in range(args.rounds):
        for name, group in groups.items():
            dist.barrier()
            start, used, lost = time.perf_counter(), time.process_time(), loss_episodes()
            dist.all_reduce(t, group=group)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
            losses[name] += loss_episodes() - lost
    n = dist.get_world_size()
    everyone: list = [None] * n
    dist.all_gather_object(everyone, (cpu, losses))
    if dist.get_rank() == 0:
        for name, seconds in times.items():
            median = statistics.median(seconds)
            wire = 2 * (n - 1) / n * 4 * args.elements * 8 / median / 1e6
            used = statistics.median(statistics.mean(c[name][i] for c, _ in everyone)
                                     for i in range(args.rounds))
            lost = sum(lo[name] for _, lo in everyone)
            print(f"{name}: median {median:.3f} s, rounds "
                  f"{', '.join(f'{s:.3f}' for s in seconds)}; {wire:.1f} Mbit/s on the wire; "
                  f"CPU {used * 1e3:.0f} ms per rank; {lost} loss episodes", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
