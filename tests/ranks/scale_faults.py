"""Failures and first contacts among many ranks; each rank prints one RESULT line.

    scale_faults.py kill=VICTIM      VICTIM SIGKILLs itself while every other rank waits in
                                     an allreduce for it
    scale_faults.py lost=VICTIM      VICTIM SIGKILLs itself once every init() returned, before any
                                     collective: the others' first collective (an alltoall,
                                     which needs every peer) meets a peer that is gone
    scale_faults.py first-use        an alltoall first of all (every pair's first message, every
                                     rank sending and receiving at once), then objects and
                                     allreduces: all correct
    scale_faults.py secret=BAD       rank BAD has another secret than the rest; every rank
                                     reports its error, shuts down and returns (a job of
                                     tests/ranks/suite.py goes on to its next entry)
    scale_faults.py sockets          every rank on a host of its own (this script names it), a
                                     few allreduces of three sizes, then each rank counts the
                                     TCP sockets it holds

Run by tests/test_scale.py through tests/ranks/forked.py as an entry of tests/ranks/suite.py
(``scale_faults.py:kill=37`` after scale.py in the 128-rank job; the shared 64-rank job of
tests/scale_jobs.py, ``lost=21`` its last entry): one mode per run, in an ``init()`` of its
own, ending with ``shutdown()`` or, for a killed rank's peers, the rank's end. Lines:

    DYING wall=<time.time()>                    the victim, just before it dies
    RESULT rank=<r> wall=<time.time()> <ErrorType>: <message>   a rank that caught an error
    RESULT rank=<r> ok ...                      a rank that saw everything right
    SOCKETS rank=<r> count=<n>                  sockets in /proc/self/fd (store, listener and
                                                peers alike), after the allreduces

A wrong result ends the rank with exit status 1 and names it; a caught GradsyncError exits 17,
but in ``secret``, where no rank is lost: there the rank shuts down and returns.
"""

import os
import signal
import sys
import time

import common  # (deadline)
import numpy as np

mode, _, arg = sys.argv[1].partition("=")
job_hostname = os.environ.get("GRADSYNC_HOSTNAME")
if mode == "secret":  # set before init reads it; the secret guards every TCP connection
    os.environ["GRADSYNC_SECRET"] = ("ab" if os.environ["RANK"] == arg else "cd") * 32
elif mode == "sockets":  # every peer a TCP connection: a host of its own, by name
    os.environ["GRADSYNC_HOSTNAME"] = f"own{os.environ['RANK']}"

import gradsync as gs  # noqa: E402
from gradsync import job  # noqa: E402
from gradsync.testbed.procfs import sockets  # noqa: E402

R = int(os.environ["RANK"])


def report(exc: BaseException) -> None:
    one_line = str(exc).replace("\n", " | ")
    print(f"RESULT rank={R} wall={time.time():.6f} {type(exc).__name__}: {one_line}",
          flush=True)


def die() -> None:
    print(f"DYING wall={time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def equal(what, got, want) -> None:
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        sys.exit(f"rank {R}: {what}: got {np.asarray(got).ravel()[:6]} want "
                 f"{np.asarray(want).ravel()[:6]}")




try:
    # A timeout far beyond the bounds checked: an error that comes from it comes too late.
    gs.init(timeout=60)
    N = gs.size()
    if mode == "kill":
        victim = int(arg)
        gs.allreduce(np.ones(10), name="warm-up")
        gs.barrier()
        store = job.world().store
        if R == victim:
            # Every other rank has counted itself on its way into the allreduce (a store
            # request, no peer contact): a sleep of 3 s did not promise it with 128 ranks on
            # 2 cores.
            common.until(lambda: int(store.add("kill/entering", 0)) >= N - 1,
                         "every other rank on its way into the allreduce", timeout=200,
                         every=0.05)
            die()
        store.add("kill/entering", 1)
        gs.allreduce(np.ones(1000, dtype=np.float32), name="waits for the victim")
        print(f"RESULT rank={R} ok: no error", flush=True)
    elif mode == "lost":
        victim = int(arg)
        # The victim dies once every rank's init() has returned (counted in the store, which
        # is no peer contact): on 2 cores the last init ends seconds after the first, and a
        # rank still in init() cannot be inside the collective whose detection is measured.
        store = job.world().store
        store.add("lost/inited", 1)
        if R == victim:
            store.set("lost/pid", str(os.getpid()))
            common.until(lambda: int(store.add("lost/inited", 0)) >= N, "every init()",
                         timeout=200)
            die()
        # The victim is dead before this rank's collective begins (its process has exited:
        # its port refuses, its sockets are closed).
        pid = int(store.get("lost/pid", 200))
        common.until(lambda: common.gone(pid), f"the end of rank {victim}", timeout=200,
                     every=0.02)
        # A rank that takes more than 3 s to raise shows where it was (its log's tail).
        import faulthandler
        faulthandler.dump_traceback_later(3.0)
        gs.alltoall(np.full((N, 1), R, dtype=np.int32), name="meets the lost peer")
        print(f"RESULT rank={R} ok: no error", flush=True)
    elif mode == "first-use":
        out = gs.alltoall(np.arange(N, dtype=np.int64)[:, None] + 1000 * R, name="first")
        equal("alltoall first", out, (1000 * np.arange(N) + R)[:, None])
        equal("allgather_object", gs.allgather_object(R), list(range(N)))
        for count in [1, 1000, 100_000]:
            equal(f"allreduce[{count}]", gs.allreduce(np.full(count, R, dtype=np.float32),
                                                      op=gs.Sum), np.full(count, N * (N - 1) / 2))
        gs.barrier()
        print(f"RESULT rank={R} ok: first use", flush=True)
    elif mode == "secret":
        gs.alltoall(np.full((N, 1), R, dtype=np.int32), name="every pair")
        gs.barrier()
        print(f"RESULT rank={R} ok: no error", flush=True)
    elif mode == "sockets":
        for count in [1, 1000, 262_144] * 2:  # small, medium and 1 MiB: every size's algorithm
            got = gs.allreduce(np.full(count, R, dtype=np.float32), op=gs.Sum)
            equal(f"allreduce[{count}]", got, np.full(count, N * (N - 1) / 2))
        print(f"SOCKETS rank={R} count={sockets()}", flush=True)
        gs.barrier()  # nobody leaves while another still counts
        print(f"RESULT rank={R} ok: sockets counted", flush=True)
    else:
        sys.exit(f"unknown mode {mode}")
    gs.shutdown()
except gs.GradsyncError as exc:
    report(exc)
    if mode != "secret":
        os._exit(17)  # a peer is dead: no later init() could meet it
    # Every rank is alive and failed the same way: the World ends as after any failure, and
    # the next entry's init() is a fresh job of the same ranks (tests/ranks/silent.py does
    # the same after its failures).
    gs.shutdown()
# The job's own secret and host name again, for the entries after this one in a suite's job.
if mode == "secret":
    os.environ.pop("GRADSYNC_SECRET")  # forked.py's ranks start without one (scale_jobs.py)
if job_hostname is None:
    os.environ.pop("GRADSYNC_HOSTNAME", None)
else:
    os.environ["GRADSYNC_HOSTNAME"] = job_hostname
