"""Rank side of tests/test_connections.py: what a rank holds and asks of the store.

Every rank plays a host of its own (``GRADSYNC_HOSTNAME``, which this script sets for its own
``init()`` and puts back after its ``shutdown()``), so every pair of ranks is a TCP pair,
connected on demand, whatever hosts the job gave its ranks.

    connections.py sockets     init (store requests counted), a ring allreduce, a doubling
                               allreduce, then a ring allreduce in a sub-world: after each,
                               the TCP pairs connected and the sockets in /proc/self/fd
    connections.py patterns    first uses that are sends only (both ends), receives only
    connections.py killed V    rank V is SIGKILLed before any pair connects; the others
                               allreduce and report the error (spawned without a launcher)
    connections.py sockets,patterns
                               the modes in turn, each in a fresh job of the same ranks
                               (``shutdown()`` then ``init()``: one start-up for both)

Started on its own (forked from one process: tests/test_connections.py through
``forked_jobs.spawn``, tests/scale_jobs.py) or as the first entry of the shared 64-rank job
(tests/scale_jobs.py): the store requests it reports are the process's since its start, so
``sockets`` must be the first mode of the process to call ``init()``.

Each mode prints one line, ``RESULT rank=R {...}``: a JSON object, ``"mode"`` among its fields.
"""

import json
import os
import signal
import sys
import time

import common  # (deadline)
import numpy as np

import gradsync as gs
from gradsync import job
from gradsync.cluster import rendezvous
from gradsync.testbed.procfs import sockets


def connected(w) -> list[int]:
    return sorted(r for r, p in w.comm.pairs.items() if p.is_socket and p.connected)


def report(**fields) -> None:
    print(f"RESULT rank={R} {json.dumps(dict(mode=mode, **fields))}", flush=True)


def run(mode: str) -> None:
    """One mode of the module's docstring, in the World that ``init()`` made last."""
    if mode == "sockets":
        before = {"sockets": sockets(), "tcp": connected(world)}
        x = np.full(1000, R + 1.0)
        gs.allreduce(x, op=gs.Sum, algorithm="ring")
        ring = {"sockets": sockets(), "tcp": connected(world)}
        y = gs.allreduce(x, op=gs.Sum, algorithm="doubling")
        assert np.allclose(y, N * (N + 1) / 2), y
        doubling = {"sockets": sockets(), "tcp": connected(world)}
        # A sub-world of every rank, over this World's store client: only its own TCP pairs add
        # sockets (no listener, no store client).
        sub = world.subworld(range(N), "everyone")
        from gradsync.pipeline import operations

        z = np.full(1000, 1.0)
        operations.allreduce(sub, z, z.dtype, gs.Sum, name="sub", shape=z.shape, algorithm="ring")
        assert np.allclose(z, N), z
        # A dial that crossed another is refused busy and closed by the listener's thread a moment
        # later: wait (briefly) until only the sockets that stay are left.
        expected = doubling["sockets"] + len(connected(sub)) + (sub.heartbeat is not None)
        settle = time.monotonic() + 3.0
        while sockets() > expected and time.monotonic() < settle:
            time.sleep(0.05)
        subworld = {"sockets": sockets(), "tcp": connected(sub),
                    "shares_listener": sub.listener is world.listener,
                    "heartbeat": sub.heartbeat is not None}
        report(init=init_requests, before=before, ring=ring, doubling=doubling, subworld=subworld,
               listener_busy=world.listener.busy)
        sub.close()
    elif mode == "patterns":
        # Ranks meet in pairs (0, 1), (2, 3), ..: neither end of a pair has used it before.
        peer = R ^ 1
        comm = world.comm
        out, got = np.full(64, float(R)), np.empty(64)
        comm.begin("both send first")  # sends that must complete before either end receives
        comm.exchange(sends=[(peer, out)])
        comm.exchange(recvs=[(peer, got)])
        assert got[0] == peer, got
        # The next pairs, (0, 2), (1, 3), ..: the lower rank's first use is a receive, then the
        # higher rank's is.
        peer = R ^ 2
        comm.begin("one end receives first")
        if R < peer:
            comm.exchange(recvs=[(peer, got)])
            comm.exchange(sends=[(peer, out)])
        else:
            comm.exchange(sends=[(peer, out)])
            comm.exchange(recvs=[(peer, got)])
        assert got[0] == peer, got
        report(tcp=connected(world))
    elif mode == "killed":
        victim = int(sys.argv[2])
        if R == victim:
            world.store.set("killed/pid", str(os.getpid()))  # a store request: no peer contact
            os.kill(os.getpid(), signal.SIGKILL)
        # The victim is gone before anyone dials it.
        pid = int(world.store.get("killed/pid", 30))
        common.until(lambda: common.gone(pid), f"the end of rank {victim}")
        start = time.monotonic()
        try:
            gs.allreduce(np.ones(100), name="after", algorithm="ring")
            report(error="none", elapsed=time.monotonic() - start)
        except gs.GradsyncError as exc:
            report(error=f"{type(exc).__name__}: {exc}", elapsed=time.monotonic() - start)
            os._exit(17)


job_hostname = os.environ.get("GRADSYNC_HOSTNAME")
os.environ["GRADSYNC_HOSTNAME"] = f"host{os.environ['RANK']}"
for i, mode in enumerate(sys.argv[1].split(",")):
    if i:
        gs.shutdown()
    gs.init(timeout=20)
    init_requests = rendezvous.request_counts()
    R, N = gs.rank(), gs.size()
    world = job.world()
    run(mode)
gs.shutdown()
# The job's own host name again, for the entries after this one in a suite's job.
if job_hostname is None:
    os.environ.pop("GRADSYNC_HOSTNAME", None)
else:
    os.environ["GRADSYNC_HOSTNAME"] = job_hostname
