"""Where a 4 KiB allreduce's time goes, 2 ranks on one host, beside Open MPI's (issue 39).

Run as ``mpirun -np 2 --allow-run-as-root --bind-to core -x MASTER_ADDR=127.0.0.1 -x
MASTER_PORT=29533 python3 scripts/small_call_split.py`` (gradsync adopts mpirun's ranks, as
``gradsync bench allreduce --compare mpi`` does). In the same processes, rounds taking turns,
it times three calls on the same 4 KiB float32 array, each iteration after a barrier:

- ``public``: ``gs.allreduce_(x, op=gs.Sum, name="bench")``, the bench's gradsync call (the
  pipeline's small-call fast case: the API's checks, the engine's claim, the flight
  recorder's record, the Comm's begin, the host segment's call, the release);
- ``segment``: the host segment's compiled one-step call alone (``World.small_road``'s
  kernel, what the fast case ends in), with none of the bookkeeping above;
- ``mpi``: mpi4py's ``Allreduce(IN_PLACE, x)``.

and each after either barrier (``MPI_Barrier``, ``gs.barrier``: the bench times gradsync after
its own). It prints, per call and barrier, the median over 5,000 iterations of the slower
rank's time, one figure per round. ``public`` less ``segment`` is the Python on the way.
"""

import statistics
import time

import numpy as np
from mpi4py import MPI

import gradsync as gs
from gradsync import job
from gradsync.bench.allreduce import _timed  # the bench's own loop: a barrier, then the call

ROUNDS, ITERATIONS, WARMUP = 3, 5000, 500


def main() -> None:
    gs.init()
    world, comm = job.world(), MPI.COMM_WORLD
    x = np.ones(1024, np.float32)
    road = world.small_road(gs.Sum, x.dtype, x.nbytes)
    if road is None:
        raise SystemExit("no compiled small road here: run 2 ranks on one host")
    kernel, code = road
    on_idle, timeout = world.on_group_idle, world.config.timeout

    calls = {
        "public": lambda: gs.allreduce_(x, op=gs.Sum, name="bench"),
        "segment": lambda: kernel(x, code, 0, time.monotonic() + timeout, on_idle, 0),
        "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
    }
    barriers = {"MPI_Barrier": comm.Barrier, "gs.barrier": gs.barrier}

    def timed(fn, barrier) -> float:
        for _ in range(WARMUP):
            barrier()
            fn()
        slower = _timed(fn, barrier, ITERATIONS,
                        lambda a: gs.allreduce(a, op=gs.Max, name="split.samples"))
        return statistics.median(slower) * 1e6

    results: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for label, fn in calls.items():
            for after, barrier in barriers.items():
                results.setdefault(f"{label} after {after}", []).append(timed(fn, barrier))
    if gs.rank() == 0:
        for key, figures in results.items():
            print(f"{key:28s} {' '.join(f'{t:6.2f}' for t in figures)} us")
    gs.shutdown()


if __name__ == "__main__":
    main()
