"""Stragglers named and ``gradsync top`` in a real job (tests/test_stragglers.py).

Each step sleeps (the step's "compute"), then allreduces, then marks the step
(``gradsync.mark_step``); every rank posts its pace every 0.1 s (``straggler_interval``).

    pace.py               ``phases`` with the last rank slowed: what the job of 3 ranks of
                          tests/small_jobs.py runs (after the other scripts: it leaves a
                          second job's worth of state in the process)
    pace.py phases SLOW   40 steps of 60 ms: the first 20 on every rank alike (fault-free),
                          the next 20 with rank SLOW sleeping 30% longer. Rank 0 then waits
                          (a poll with a deadline) until steps 1-40 are judged and prints
                          RESULT with the report and every straggler warning it logged
    pace.py hvd SLOW      the phases through the Horovod API: each step sleeps, then a
                          forward and backward pass of a small model whose gradients
                          DistributedOptimizer reduces; its step() marks the steps
    pace.py data [SLOW]   the phases, but rank SLOW's extra 30% is a wait for its batches
                          (an iterable that sleeps in ``next()``, through ``gradsync.metered``)
    pace.py ddp [SLOW]    the phases through torch's DDP over the backend "gradsync" alone
                          (no ``gradsync.init``): a small model's forward and backward, no
                          ``mark_step`` (the backward passes mark the steps)
    pace.py top SLOW      steps of 30 ms, rank SLOW twice as slow, until rank 0 has named it;
                          rank 0 then runs ``gradsync top --once <the launcher's job id>``
                          while every rank keeps stepping, and prints its table (TOP lines)
"""

import json
import logging
import os
import subprocess
import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

mode = sys.argv[1] if len(sys.argv) > 1 else "phases"
slow = int(sys.argv[2]) if len(sys.argv) > 2 else -1
if mode == "ddp":
    import torch
    import torch.distributed as dist

    os.environ["GRADSYNC_STRAGGLER_INTERVAL"] = "0.1"  # read when the group is made
    dist.init_process_group("gradsync")
    del os.environ["GRADSYNC_STRAGGLER_INTERVAL"]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.ones(8, 64)
    R, N = dist.get_rank(), dist.get_world_size()
elif mode == "hvd":
    import torch

    import gradsync.torch as hvd

    hvd.init(straggler_interval=0.1)
    model = torch.nn.Linear(64, 64)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    batch = torch.ones(8, 64)
else:
    gs.init(straggler_interval=0.1)
if mode != "ddp":
    R, N = gs.rank(), gs.size()
slow = N - 1 if slow < 0 else slow
warned = []


class Warnings(logging.Handler):
    def emit(self, record):
        if "straggler" in record.getMessage():
            warned.append(record.getMessage())


handler = Warnings(logging.WARNING)
logging.getLogger("gradsync").addHandler(handler)


def batches(wait: float):
    """An endless loader whose every batch takes ``wait`` seconds to come."""
    while True:
        time.sleep(wait)
        yield None


loader = None


def step(base: float, slowed: float) -> None:
    """One step: ``base`` seconds of "compute" (``1 + slowed`` times as many), then the
    collective; in mode ``data`` the ``slowed`` part is a wait for the step's batch."""
    global loader
    if mode == "data":
        if loader is None or slowed != loader[0]:
            loader = (slowed, gs.metered(batches(base * slowed)))
        next(loader[1])
        time.sleep(base)
    else:
        time.sleep(base * (1.0 + slowed))
    if mode == "ddp":
        optimizer.zero_grad()
        model(batch).sum().backward()  # marks the step (torch/backend/backward.py)
        optimizer.step()
        return
    if mode == "hvd":
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()  # marks the step
        return
    gs.allreduce(np.ones(1024), name="grad")
    gs.mark_step()


def wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


if mode in ("phases", "hvd", "data", "ddp"):
    for n in range(40):
        step(0.06, 0.3 if n >= 20 and R == slow else 0.0)
    if R == 0:
        wait_for(lambda: gs.stragglers().step >= 40, 20)
        report = gs.stragglers()
        print("RESULT " + json.dumps({"step": report.step,
                                      "named": [p.rank for p in report.named],
                                      "paces": [p.__dict__ for p in report.named],
                                      "ranks": len(report.ranks), "warnings": warned}),
              flush=True)
elif mode == "top":
    top, stop, deadline = None, 0.0, time.monotonic() + 40
    while not stop:
        step(0.03, 1.0 if R == slow else 0.0)
        if R == 0:
            if top is None and slow in [p.rank for p in gs.stragglers().named]:
                top = subprocess.Popen([sys.executable, "-m", "gradsync", "top", "--once",
                                        os.environ["GRADSYNC_JOB_ID"]],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
            ended = top is not None and top.poll() is not None
            stop = float(ended or time.monotonic() > deadline)
        stop = float(gs.allreduce(np.array([stop]), op=gs.Max, name="stop")[0])
    if R == 0:
        if top is not None and top.poll() is None:
            top.kill()  # past the deadline: its output so far says why
        out = top.communicate()[0] if top is not None else "top never started"
        for line in out.splitlines():
            print(f"TOP|{line}", flush=True)
        print(f"RESULT top exit {None if top is None else top.returncode}", flush=True)
if mode == "ddp":
    dist.barrier()
    dist.destroy_process_group()
else:
    gs.barrier()
if mode == "hvd":
    hvd.shutdown()
if mode != "ddp":
    gs.shutdown()
logging.getLogger("gradsync").removeHandler(handler)
