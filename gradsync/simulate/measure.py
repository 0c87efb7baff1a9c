"""Validation measured here: training steps on emulated clusters against the simulator.

Each point builds an emulated cluster of network namespaces (``gradsync.bench.netns``: hosts
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
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass

from .cluster import load
from .step import Model, simulate

__all__ = ["EMULATED", "Emulation", "measure", "measured_rows"]


@dataclass(frozen=True)
class Emulation:
    name: str
    """Shipped cluster file describing it."""
    hosts: tuple
    groups: "dict | None"
    host_rate: str
    group_rate: "str | None" = None


EMULATED = (
    Emulation("emulated-2x2", (("h0", 2), ("h1", 2)), None, "200mbit"),
    Emulation("emulated-3x1-groups", (("h0", 1), ("h1", 1), ("h2", 1)),
              {"g0": ["h0", "h1"], "g1": ["h2"]}, "1gbit", "200mbit"),
)


def measure(emulation: Emulation, steps: int = 4, windows: int = 2,
            timeout: float = 240) -> list[dict]:
    """Runs the bench on ``emulation``; one row per model, predicted against measured."""
    from ..bench.netns import Cluster, run

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        argv = [sys.executable, "-m", "gradsync.bench.train", "--model", "both", "--steps",
                str(steps), "--windows", str(windows), "--warmup", "2", "--profile", "--json", out]
        with Cluster(list(emulation.hosts), emulation.groups, host_rate=emulation.host_rate,
                     group_rate=emulation.group_rate) as c:
            environ = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
            results = run(c, argv, timeout=timeout, environ=environ, stop_on_failure=True)
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
        got = simulate(cluster, model, row["ranks"], "auto")
        measured = phases["total"]
        rows.append({"point": f"bench {row['model']} (measured here)", "cluster": emulation.name,
                     "gpus": row["ranks"], "step_ms_predicted": got.step * 1e3,
                     "step_ms_measured": measured, "compute_ms": model.compute * 1e3,
                     "compute_rank0_ms": phases["compute"],
                     "error_pct": 100 * (got.step * 1e3 - measured) / measured,
                     "algorithms": got.algorithms})
    return rows


def measured_rows() -> list[dict]:
    return [row for e in EMULATED for row in measure(e)]


