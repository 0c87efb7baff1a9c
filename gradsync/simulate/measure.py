"""Validation measured here: training steps on emulated clusters against the simulator.

Each point builds an emulated cluster of network namespaces (``gradsync.testbed.netns``: hosts
joined by veth pairs that ``tc`` shapes), runs ``gradsync bench train`` on it (the bench MLP,
2.1M parameters, communication-bound, and the bench CNN, 0.62M, compute-bound), and compares
the measured step time of gradsync's DistributedOptimizer with the simulator's prediction
for the shipped cluster file of that emulation. Both come from the bench's ``--profile`` pass
(medians over its steps): the compute the prediction starts from is, per step, the slowest
rank's forward + backward + update (the allreduces wait for it; the model's ranks are all
alike), the measured step rank 0's total with the wait for the allreduces (``sync``),
so that the prediction is of the communication the step exposes, in the very steps it is
compared with (this machine is shared, and its load moves between windows). Needs root
(``ip netns``); about a minute per cluster.

``compute_jitter`` measures the other input the step model takes from a machine: the
coefficient of variation of one rank's compute time per step (``jitter_cv``, see
``straggle.py``). It times forward + backward + update of the bench models in this process,
one thread, as the bench's ranks run, and reports mean, standard deviation, their ratio and
the tail. ``python3 -m gradsync.simulate.measure --jitter`` prints it (no root).
``straggler_check`` (``--stragglers N``) runs N such ranks in lockstep and compares the
slowest rank per step with the straggler term's expectation.

The points of 16 to 64 ranks are allreduces, not training steps (``measure_allreduce.py``
says why); ``measured_rows`` returns both kinds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass

from .cluster import load
from .step import Model, simulate

__all__ = ["EMULATED", "Emulation", "measure", "measured_rows", "compute_jitter",
           "straggler_check"]


@dataclass(frozen=True)
class Emulation:
    name: str
    """Shipped cluster file describing it."""
    hosts: tuple
    groups: "dict | None"
    host_rate: str
    group_rate: "str | None" = None
    algorithm: str = "auto"
    """The allreduce the ranks run (``GRADSYNC_ALGORITHM``) and the simulator predicts."""


EMULATED = (
    Emulation("emulated-2x2", (("h0", 2), ("h1", 2)), None, "200mbit"),
    # The ranks know their hosts (GRADSYNC_HOSTNAME) but not the groups, which only the
    # cluster file holds: with one rank per host their planner runs a ring, while the
    # simulator, which knows the groups, would predict the hierarchical plan. The point is
    # pinned to the ring on both sides, so that it compares one algorithm with itself.
    Emulation("emulated-3x1-groups", (("h0", 1), ("h1", 1), ("h2", 1)),
              {"g0": ["h0", "h1"], "g1": ["h2"]}, "1gbit", "200mbit", algorithm="ring"),
)


def measure(emulation: Emulation, steps: int = 4, windows: int = 2,
            timeout: float = 240) -> list[dict]:
    """Runs the bench on ``emulation``; one row per model, predicted against measured."""
    from ..testbed.netns import Cluster, run

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        argv = [sys.executable, "-m", "gradsync.bench.train", "--model", "both", "--steps",
                str(steps), "--windows", str(windows), "--warmup", "2", "--profile", "--json", out]
        with Cluster(list(emulation.hosts), emulation.groups, host_rate=emulation.host_rate,
                     group_rate=emulation.group_rate) as c:
            environ = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
            results = run(c, argv, timeout=timeout, environ=environ, stop_on_failure=True,
                          env={"GRADSYNC_ALGORITHM": emulation.algorithm})
        failed = [r for r in results if r.returncode != 0]
        if failed:
            raise RuntimeError(f"bench train on {emulation.name} failed:\n"
                               + "\n".join(str(r) for r in failed))
        with open(out) as f:
            bench = json.load(f)
    cluster = load(emulation.name)
    rows = []
    for row in bench:
        phases = row["profile_ms"]["gradsync"]
        compute = phases["compute_slowest"]
        model = Model(params=row["params"], compute=compute / 1e3,
                      bucket_bytes=row["fusion_threshold"])
        got = simulate(cluster, model, row["ranks"], emulation.algorithm)
        measured = phases["total"]
        rows.append({"point": f"bench {row['model']} (measured here)", "cluster": emulation.name,
                     "gpus": row["ranks"], "step_ms_predicted": got.step * 1e3,
                     "step_ms_measured": measured, "compute_ms": model.compute * 1e3,
                     "compute_rank0_ms": phases["compute"],
                     "error_pct": 100 * (got.step * 1e3 - measured) / measured,
                     "algorithms": got.algorithms})
    return rows


def measured_rows() -> list[dict]:
    """The training steps of ``EMULATED``, then the allreduces of 16 to 64 ranks
    (``measure_allreduce.EMULATED_ALLREDUCE``)."""
    from .measure_allreduce import allreduce_rows

    return [row for e in EMULATED for row in measure(e)] + allreduce_rows()


def compute_jitter(model: str = "cnn", steps: int = 300, warmup: int = 20,
                   batch_size: int = 32) -> dict:
    """Per-step compute time of one bench rank (forward + backward + SGD update, one thread)
    over ``steps`` steps after ``warmup``: mean, standard deviation, coefficient of variation
    (``cv``), median, 99th percentile and max, in ms, twice: ``wall`` (elapsed time, which on a
    shared machine includes the time the scheduler gives other processes) and ``cpu`` (this
    process's CPU time: the variation of the work itself on a core it has to itself)."""
    import time

    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..testbed.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, shape = build_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, *shape)
    y = torch.randint(0, 10, (batch_size,))
    wall, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    row = {"model": model, "steps": steps, "batch_size": batch_size,
           "load_average": os.getloadavg()[0]}
    for name, samples in (("wall", wall), ("cpu", cpu)):
        t = np.array(samples) * 1e3
        row[name] = {"mean_ms": float(t.mean()), "std_ms": float(t.std(ddof=1)),
                     "cv": float(t.std(ddof=1) / t.mean()), "median_ms": float(np.median(t)),
                     "p99_ms": float(np.percentile(t, 99)), "max_ms": float(t.max())}
    return row


def _straggler_rank(model: str, steps: int, warmup: int, barrier, out) -> None:
    import time

    import torch
    import torch.nn.functional as F

    from ..testbed.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, shape = build_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, *shape), torch.randint(0, 10, (32,))
    times = []
    for i in range(warmup + steps):
        barrier.wait()  # every rank starts the step together, as after an allreduce
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out.put(times)


def straggler_check(ranks: int, model: str = "mlp", steps: int = 200, warmup: int = 10,
                    timeout: float = 600) -> dict:
    """``ranks`` processes compute bench steps in lockstep (a barrier before each step); per
    step the slowest rank's compute against the straggler term's expectation
    ``mean x (1 + cv x e_N)`` (wall clock), with ``cv`` two ways: ``all``, the coefficient
    of variation of all ranks' steps, and ``own``, of each rank's deviation from its step's
    mean over the ranks (the independent part, which is what the term assumes).
    What it checks on this machine is the term's assumptions (independent, normal draws), not
    a GPU's jitter: the ranks share two cores with each other and with other jobs."""
    import multiprocessing as mp

    import numpy as np

    from .straggle import expected_max

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks, timeout=timeout), ctx.Queue()
    procs = [ctx.Process(target=_straggler_rank, args=(model, steps, warmup, barrier, out))
             for _ in range(ranks)]
    for proc in procs:
        proc.start()
    try:
        t = np.array([out.get(timeout=timeout) for _ in procs]) * 1e3  # [rank, step] ms
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    mean, cv = float(t.mean()), float(t.std(ddof=1) / t.mean())
    # The part of each rank's variation that is its own: its deviation from the step's mean
    # over the ranks (variation common to all ranks, such as the machine's load, moves every
    # rank together and makes nobody wait), scaled back by sqrt(N / (N - 1)).
    own = t - t.mean(axis=0)
    cv_own = float(own.std() * math.sqrt(ranks / (ranks - 1)) / mean)
    measured = float(t.max(axis=0).mean())
    row = {"ranks": ranks, "model": model, "steps": steps, "mean_ms": mean,
           "slowest_measured_ms": measured, "load_average": os.getloadavg()[0]}
    for key, c in (("all", cv), ("own", cv_own)):
        predicted = mean * (1 + c * expected_max(ranks))
        row[key] = {"cv": c, "slowest_predicted_ms": predicted,
                    "error_pct": 100 * (predicted - measured) / measured}
    return row


def main(argv: "list[str] | None" = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m gradsync.simulate.measure",
                                description="This machine's per-step compute jitter (--jitter) "
                                            "or the measured-here validation points (root).")
    p.add_argument("--jitter", action="store_true", help="time the bench models' compute steps")
    p.add_argument("--stragglers", type=int, metavar="N",
                   help="N ranks in lockstep: the slowest rank per step against the straggler term")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    if args.stragglers:
        rows = [straggler_check(args.stragglers, "mlp", args.steps)]
    elif args.jitter:
        rows = [compute_jitter(m, args.steps) for m in ("cnn", "mlp")]
    else:
        rows = measured_rows()
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
