"""What a small synchronous allreduce costs in Python, counted: the pipeline's fast case (issue 39).

Run as ``python3 scripts/small_call_cost.py [named|unnamed|torch|one-rank]`` with
``PYTHONPATH`` set to the tree to count (it counts any tree since issue 39's, and the one
before, whose express lane it reaches the same way). Times on a shared machine move with its
load; counts do not. So, in one process, with no peer:

- ``named``, ``unnamed``, ``torch``: ``gs.allreduce_`` of 4 KiB (a NumPy array, the same
  unnamed, a torch tensor) on a World of two ranks on one host whose segment is a stand-in:
  its compiled call does nothing, so what is counted is all the work between the public
  call and the C call of a real job (the api, the prepared operation's lookup, the engine's
  claim, record, failure check and release, the Comm's begin), in Python or, since session
  31, compiled (``_shmfast.c``'s Quick, Inline and Prepared: the stand-in has the segment's
  slots and no compiled group, so the compiled run hands each call to its
  ``allreduce_express``, one Python call where a real job makes the kernel's). Nothing is
  exchanged, so the wait for a peer, which a real 4 KiB allreduce adds, is not in it.
- ``one-rank``: ``gs.allreduce(np.ones(4, np.float32), name="w")`` after ``gs.init()`` alone,
  docs/benchmarks.md's ``onerank.py`` call.

It prints the Python functions entered and the built-in (C) functions called per call
(``sys.setprofile``), and nanoseconds per call (the median of 9 loops; on a busy machine only
a hint). With ``--instructions`` it prints instead the machine instructions per call, counted
by valgrind (``valgrind --tool=callgrind``, which must be installed): the script runs itself
twice under it, with 1,000 and 6,000 calls, and divides the difference by 5,000, so the
start-up cancels out (about a minute; BLAS threads are pinned to one, whose idle spinning
would count). The same tree gives the same count to within a few instructions.
"""

import os
import statistics
import subprocess
import sys
import threading
import time

MODES = ("named", "unnamed", "torch", "one-rank")


class _Segment:
    """The host segment's stand-in: its compiled one-step call does nothing. Its compiled
    group is missing as far as a compiled prepared run can tell (``_fast_group`` None), so
    that run hands each call to this ``allreduce_express``: one Python call where the real
    one makes the C kernel's."""

    __slots__ = ("_failed", "_segment", "moved", "_seq", "_fast_group")
    small_bytes = 32768

    def __init__(self):
        self._failed = self._fast_group = None
        self._segment, self.moved, self._seq = "mapped", 0, 0

    def allreduce_express(self, flat, code, divisor, deadline, on_idle, signature):
        pass


class _World:
    """A World of two ranks on one host, as ``api`` and ``pipeline`` see it."""

    def __init__(self):
        from gradsync.collectives import planner
        from gradsync.config import load_config
        from gradsync.transport.comm import Comm

        self.config = load_config({}, environ={})
        self.size, self.rank, self.shares_host = 2, 0, True
        self.failure = None
        self.comm = Comm(0, 2, {}, self.config.timeout)
        self.plans = planner.Plans(2, self.config, True, None, announce=False)
        self.descriptions: dict = {}
        self.express: dict = {}  # the express lane's memory, in the trees before issue 39's
        self.segment = _Segment()

    def small_road(self, op, dtype, nbytes):
        return (self.segment.allreduce_express, 1) if 0 < nbytes <= 32768 else None

    def small_run(self, description, signature, code, divisor):
        from gradsync import _native

        module = _native.load("_shmfast", build=False)
        if module is None or not hasattr(module, "Prepared"):
            return None  # a tree before the compiled prepared run: its Python closure
        return module.Prepared(self.segment, self.comm, description, signature, code, divisor,
                               self.on_group_idle)

    def on_group_idle(self, waited):
        pass

    def fail(self, exc):
        if self.failure is None:
            self.failure = exc
        return self.failure


def _call(mode: str):
    """The call to count, ready to run (after one run that prepares it)."""
    import numpy as np

    import gradsync as gs
    from gradsync import job

    if mode == "one-rank":
        gs.init()
        assert gs.size() == 1, "one-rank: run it alone, not under a launcher"
        call = lambda: gs.allreduce(np.ones(4, np.float32), name="w")  # noqa: E731
    else:
        from gradsync.flight_recorder import recorder
        from gradsync.pipeline.engine import Engine

        world = _World()
        engine = Engine(world, recorder.track("numpy:cost", "numpy API", [0, 1], "numpy",
                                              world.config.timeout, world))
        job._job = current = job.Job.__new__(job.Job)  # (its slots, as a job's: no start)
        current.world, current.engine, current.pace = world, engine, None
        if mode == "torch":
            import torch

            x = torch.ones(1024)
        else:
            x = np.ones(1024, np.float32)
        name = None if mode == "unnamed" else "bench"
        call = lambda: gs.allreduce_(x, op=gs.Sum, name=name)  # noqa: E731
        call()  # the full road would raise here: the stand-in has no shm algorithm
        assert world.comm.seq == 1, "the call did not begin one collective"
    for _ in range(2000):
        call()
    return call


def _counts(call) -> tuple[float, float]:
    """Python functions entered and C functions called per ``call()``, on this thread."""
    python = builtin = 0

    def profile(frame, event, arg):
        nonlocal python, builtin
        if event == "call":
            python += 1
        elif event == "c_call":
            builtin += 1

    n = 1000
    sys.setprofile(profile)
    try:
        for _ in range(n):
            call()
    finally:
        sys.setprofile(None)
    return python / n, (builtin - 1) / n  # the last c_call is setprofile's own


def _instructions(mode: str) -> int:
    """Machine instructions per call, by valgrind's count (see the module docstring)."""
    collected = []
    for n in (1000, 6000):
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             __file__, mode, f"--loop={n}"],
            capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        found = [line for line in run.stderr.splitlines() if "Collected :" in line]
        if run.returncode or not found:
            raise SystemExit(f"valgrind failed ({run.returncode}): {run.stderr[-2000:]}")
        collected.append(int(found[-1].rsplit(":", 1)[1]))
    return round((collected[1] - collected[0]) / 5000)


def main() -> None:
    args = sys.argv[1:]
    mode = next((a for a in args if not a.startswith("--")), "named")
    if mode not in MODES:
        raise SystemExit(f"the mode is one of {', '.join(MODES)}, not {mode!r}")
    loop = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--loop=")), None)
    if "--instructions" in args:
        print(f"{mode}: {_instructions(mode)} instructions per call (valgrind)")
        return
    call = _call(mode)
    if loop is not None:  # under valgrind (``_instructions``): the calls alone
        for _ in range(loop):
            call()
        return
    python, builtin = _counts(call)
    runs = []
    for _ in range(9):
        began = time.perf_counter_ns()
        for _ in range(20_000):
            call()
        runs.append((time.perf_counter_ns() - began) / 20_000)
    print(f"{mode}: {python:g} Python functions and {builtin:g} C functions per call; "
          f"{statistics.median(runs):.0f} ns per call (median of 9 loops, min "
          f"{min(runs):.0f}; {threading.active_count()} threads)")


if __name__ == "__main__":
    main()
