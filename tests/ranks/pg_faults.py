"""Failures on the "gradsync" backend end in an error on every rank, never a hang.

Run by tests/test_distributed_backend.py (forked_jobs.spawn, so each rank's own exit and
message count). Modes:

- ``kill``: DDP training; the last rank kills itself (SIGKILL) in its third step, before its
  backward pass, while the others are in their allreduces. The survivors' backward must raise,
  naming the lost rank.
- ``mismatch``: DDP over models whose layers differ on the last rank; then an all_reduce of
  different shapes. Every rank must raise; the second must be a MismatchBackendError that
  lists what each rank issued.

- ``roads FIRST SECOND``: the last rank issues collective SECOND where the others issue
  FIRST, one of them going over the pairs (a ring: reduce_scatter_tensor,
  all_gather_into_tensor) and the other through the host's shared-memory group (all_reduce,
  barrier), so no rank reads a frame of the other's. Every rank must raise a
  MismatchBackendError that lists both, within seconds, not at the timeout.

Each rank prints ``caught <class>: <message>`` and exits 3 when it saw the expected error.
"""

import os
import signal
import sys
import time

import common  # noqa: F401  (deadline)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync  # noqa: F401  (registers the backend)
from gradsync.torch.backend import BackendError, MismatchBackendError

mode = sys.argv[1]
dist.init_process_group("gradsync")
R, N = dist.get_rank(), dist.get_world_size()


def caught(exc: BaseException) -> None:
    print(f"rank {R}: caught {type(exc).__name__}: {exc}", flush=True)


if mode == "kill":
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(100):
            x = torch.randn(8, 256)
            loss = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long))
            if step == 2 and R == N - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
    except RuntimeError as exc:  # DDP's backward re-raises the Work's error as RuntimeError
        caught(exc)
        sys.exit(3)
    sys.exit(f"rank {R}: trained 100 steps without noticing the lost rank")

if mode == "mismatch":
    width = 17 if R == N - 1 else 16
    try:
        DDP(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))
    except RuntimeError as exc:
        caught(exc)
    else:
        sys.exit(f"rank {R}: DDP accepted models of different shapes")
    t = torch.zeros(5 + (R == N - 1))
    try:
        dist.all_reduce(t)
    except MismatchBackendError as exc:
        caught(exc)
        assert isinstance(exc, dist.DistBackendError) and isinstance(exc, BackendError)
        sys.exit(3)
    sys.exit(f"rank {R}: all_reduce of different shapes did not raise")

if mode == "roads":
    def issue(what: str) -> None:
        n = 1 << 12
        if what == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(N * n))
        elif what == "all_gather_into_tensor":
            dist.all_gather_into_tensor(torch.empty(N * n), torch.ones(n))
        elif what == "all_reduce":
            dist.all_reduce(torch.ones(n))
        else:
            dist.barrier()

    first, second = sys.argv[2], sys.argv[3]
    started = time.monotonic()
    try:
        issue(second if R == N - 1 else first)
    except MismatchBackendError as exc:
        caught(exc)
        print(f"rank {R}: raised after {time.monotonic() - started:.1f}s", flush=True)
        sys.exit(3)
    sys.exit(f"rank {R}: {first} against {second} did not raise")
