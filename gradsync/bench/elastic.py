"""``gradsync bench elastic``: how fast an elastic job recovers, and what ``commit()`` costs.

    gradsync bench elastic -np 4 [--runs 3] [--kill-at 20] [--params 100000]
                           [--commit-sizes 1M,10M,50M]

Two measurements, each beside its peer measured in the same run:

1. **commit() against model size**, in this process: a ``TorchState`` over an MLP of about
   P parameters and its Adam optimizer (whose state doubles the bytes), median of 5
   ``commit()`` calls; the peer is one ``clone()`` of the parameters (the copy's floor).
2. **Recovery**, through ``gradsync run -np N --min-np 2``: an MLP of ``--params``
   parameters trains with a commit every 5 steps; at step ``--kill-at`` worker 1 SIGKILLs
   itself after its backward pass (gradients in flight). *Recovery* is the time from its death
   (its own clock, just before the kill) to the last survivor's first completed step in the
   new generation: detection by the survivors or the launcher, the new generation, the new
   World (shared memory included), the recovery plan (since issue 28 a death inside the
   gradient exchange goes on from the survivors' live state: ``elastic/recovery.py``; before,
   a rollback to the last commit), the state sync and one step. The peers: the
   median steady step before the kill, and the median ``commit()`` inside the job (which adds
   the ``check_host_updates`` broadcast).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

__all__ = ["parser", "drive"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench elastic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="recovery jobs to run (default 3)")
    p.add_argument("--kill-at", type=int, default=20, help="step at which worker 1 dies")
    p.add_argument("--params", type=int, default=100_000, help="model size of the job")
    p.add_argument("--commit-sizes", default="1M,10M,50M",
                   help="model sizes for the commit() table (K/M suffixes); empty: skip")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KM" else text) * scale)


def _mlp(params: int):
    import torch

    width = max(8, int((params / 3) ** 0.5))  # three width x width layers
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width)), width


def _commit_table(sizes: list[int]) -> None:
    import torch

    import gradsync.torch as hvd

    print(f"{'parameters':>12} {'state MiB':>10} {'commit() ms':>12} {'clone params ms':>16} "
          f"{'ratio':>6}")
    for size in sizes:
        model, width = _mlp(size)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, width)).sum().backward()
        optimizer.step()  # Adam's state exists: 2 more tensors per parameter
        state = hvd.elastic.TorchState(model, optimizer, epoch=0)
        commits, clones = [], []
        for _ in range(5):
            start = time.perf_counter()
            state.commit()
            commits.append(time.perf_counter() - start)
            start = time.perf_counter()
            [p.detach().clone() for p in model.parameters()]
            clones.append(time.perf_counter() - start)
        n = sum(p.numel() for p in model.parameters())
        commit, clone = statistics.median(commits) * 1e3, statistics.median(clones) * 1e3
        print(f"{n:>12,} {3 * n * 4 / 2 ** 20:>10.1f} {commit:>12.2f} {clone:>16.2f} "
              f"{commit / clone:>6.1f}", flush=True)


def _worker(options) -> None:
    import torch

    import gradsync.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    first_rank = hvd.rank()
    torch.manual_seed(first_rank)
    model, width = _mlp(options.params)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    marks = {"reset": False, "steps": [], "commits": []}
    state.register_reset_callbacks([lambda: marks.update(reset=True)])
    x = torch.randn(32, width)

    @hvd.elastic.run
    def train(state):
        while state.step < options.kill_at + 10:
            start = time.perf_counter()
            optimizer.zero_grad()
            model(x).square().mean().backward()
            if first_rank == 1 and state.step == options.kill_at:
                print(f"DYING wall={time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.step += 1
            if marks["reset"]:
                marks["reset"] = False
                print(f"FIRSTSTEP wall={time.time():.6f}", flush=True)
            elif state.step < options.kill_at:
                marks["steps"].append(time.perf_counter() - start)
            if state.step % 5 == 0:
                start = time.perf_counter()
                state.commit()
                marks["commits"].append(time.perf_counter() - start)

    train(state)
    if hvd.rank() == 0:
        print(f"STEADY step_ms={statistics.median(marks['steps']) * 1e3:.2f} "
              f"commit_ms={statistics.median(marks['commits']) * 1e3:.2f}", flush=True)


def drive(run: list[str], options, rest: list[str], workers: int, servers) -> int:
    """Prints the commit() table, then runs ``--runs`` recovery jobs of ``workers`` ranks."""
    sizes = [_count(s) for s in options.commit_sizes.split(",") if s.strip()]
    if sizes:
        _commit_table(sizes)
    if workers < 3:
        print("recovery needs -np 3 or more (the job goes on with --min-np 2)")
        return 0 if sizes else 2
    command = [*run, "--min-np", "2", sys.executable, "-m", __name__, "--worker", *rest]
    print(f"\nrecovery: {' '.join(command[2:])}")
    print(f"{'run':>4} {'recovery s':>11} {'steady step ms':>15} {'commit() ms':>12}")
    recoveries = []
    for index in range(options.runs):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        dying = [float(v) for v in re.findall(r"DYING wall=([\d.]+)", out)]
        first = [float(v) for v in re.findall(r"FIRSTSTEP wall=([\d.]+)", out)]
        steady = re.search(r"STEADY step_ms=([\d.]+) commit_ms=([\d.]+)", out)
        if done.returncode != 0 or len(dying) != 1 or len(first) != workers - 1 or not steady:
            print(f"run {index} failed (exit {done.returncode}):\n{out[-3000:]}")
            return 1
        recoveries.append(max(first) - dying[0])
        print(f"{index:>4} {recoveries[-1]:>11.2f} {float(steady[1]):>15.2f} "
              f"{float(steady[2]):>12.2f}", flush=True)
    print(f"median recovery {statistics.median(recoveries):.2f} s over {len(recoveries)} runs")
    return 0


if __name__ == "__main__":
    opts = parser().parse_args()
    if opts.worker:
        _worker(opts)
    else:
        sys.exit(drive([sys.executable, "-m", "gradsync", "run", "-np", "4"], opts,
                       sys.argv[1:], 4, None))
