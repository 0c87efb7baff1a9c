"""The "gradsync" backend under faults: abort, shutdown and a stopped rank end every rank's
collectives within seconds, never at the group's timeout (30 minutes by default).

Run by tests/test_backend_faults.py (forked_jobs.spawn: each rank's own exit and output count).
Every rank agrees on a moment ``T`` (rank 0's clock plus 1.5 s, broadcast), then:

- ``abort [RANK]``: ranks 0 .. N-2 start an ``all_reduce`` that rank N-1 does not join, so it
  stays in flight; at ``T`` rank RANK (default 0) calls ``abort()`` on the default group:
  one with the all_reduce in flight, or N-1, with nothing in flight. Rank N-1 issues its own
  ``all_reduce`` 0.5 s after ``T`` (after its abort). Every rank's collective must fail,
  naming the rank that aborted.
- ``shutdown``: the same, but rank 0 calls ``destroy_process_group()`` (the group's
  ``shutdown``) with its ``all_reduce`` still in flight, and rank N-1 issues its own after
  shutdown's grace (``SHUTDOWN_GRACE_S``), which would have let the all_reduce finish.
- ``stop DIR``: DDP training; at ``T`` rank N-1 stops itself (SIGSTOP, after arranging its own
  SIGKILL), in its first step at or after ``T``, before its backward pass, while the others
  wait for it in theirs. It prints ``STOP <seconds>`` (from ``T`` to its stop). Each other
  rank, once it caught its error, leaves a file in DIR; the stopped rank's SIGKILL waits for
  all of them (at most 30 s), so the job ends as soon as the check is done.

Each rank that saw the expected failure prints ``caught <class>: <message>`` and
``AFTER <seconds>`` (from ``T`` to the error), and exits 3.
"""

import os
import signal
import sys
import time

import common  # (deadline; the stopped rank's lifeline)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync  # noqa: F401  (registers the backend)
from gradsync.torch.backend.group import SHUTDOWN_GRACE_S

mode = sys.argv[1]
dist.init_process_group("gradsync")
R, N = dist.get_rank(), dist.get_world_size()
moment = [time.time() + 1.5]
dist.broadcast_object_list(moment, 0)
T = moment[0]


def until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def caught(exc: BaseException) -> None:
    print(f"rank {R}: caught {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    print(f"AFTER rank={R} {time.time() - T:.2f}", flush=True)
    if mode == "stop":  # the stopped rank's lifeline waits for every survivor's file
        common.reported(sys.argv[2], R)
    sys.exit(3)


if mode in ("abort", "shutdown"):
    ender = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # the rank that aborts
    t = torch.ones(1000)
    try:
        if R == N - 1:  # after shutdown's grace, which would let the all_reduce finish
            until(T + (SHUTDOWN_GRACE_S if mode == "shutdown" else 0.0))
            if R == ender:
                dist.distributed_c10d._get_default_group().abort()
            else:
                until(T + 0.5 + (SHUTDOWN_GRACE_S if mode == "shutdown" else 0.0))
            dist.all_reduce(t)
        else:
            work = dist.all_reduce(t, async_op=True)
            if R == ender:
                until(T)
                if mode == "abort":
                    dist.distributed_c10d._get_default_group().abort()
                else:
                    dist.destroy_process_group()
            work.wait()
    except dist.DistBackendError as exc:
        caught(exc)
    sys.exit(f"rank {R}: the all_reduce finished after the group's {mode}")

if mode == "stop":
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(1000):
            x = torch.randn(8, 64)
            loss = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long))
            if R == N - 1 and time.time() >= T:
                # A stopped process cannot end itself: a lifeline ends it once every survivor
                # has caught its error (their files in DIR), or after 30 s if one never does.
                common.lifeline(sys.argv[2], N - 1)
                print(f"STOP rank={R} {time.time() - T:.2f}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            loss.backward()
            opt.step()
            time.sleep(0.01)
    except RuntimeError as exc:  # DDP's backward re-raises the Work's error as RuntimeError
        caught(exc)
    sys.exit(f"rank {R}: trained 1000 steps without noticing the stopped rank")
