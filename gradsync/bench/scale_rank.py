"""The rank side of ``gradsync bench scale``: one process of the job, or of its limit.

Every rank of both jobs starts the same way, through a one-line bootstrap that takes the wall
clock before anything else is imported (``python3 -c "import time; t = time.time(); from
gradsync.bench.scale_rank import main; main(t)" ...``), so that the *start* phase (launch to
the rank's first line) and the *import* phase (torch, torch.distributed, gradsync) are
measured alike in both jobs. Then:

- ``--mode limit``: the floor of any runtime's start-up. The rank connects to the job's
  TCPStore and meets the others there once (each adds one to a counter; the rank that brings
  it to N sets a key every rank waits for), with no gradsync World.
- ``--mode gradsync``: ``gradsync.init()``, timed per phase (below); then a small and a
  1 MiB allreduce, each first once (connections made on first use are paid there) and then
  ``--iters`` times after a barrier (the steady state), every result checked against its
  closed form (rank r contributes r + 1, so the sum is N (N + 1) / 2, exact in float32).

**Phases of init(), timed from outside.** Nothing in gradsync is edited for the benchmark:
before ``init()`` this module wraps the functions ``init()`` passes through (``SPECS``: the
configuration, the store's connection, the store requests, the listener, the TCP and
shared-memory set-up, the closing barrier, the World's plans, the heartbeat, the engine), and
each wrapper adds the time spent inside it to its phase. Only the outermost wrapped call counts
(a barrier's own ``add`` and ``get`` are the barrier's time, not the store's), only on the main
thread (the heartbeat's thread uses the store too) and only while ``init()`` runs; what no
wrapper covers is ``other``. A function that a later gradsync no longer has is skipped, and
its phase reads "n/a": the benchmark keeps working while ``world.py`` changes under it.

**What is counted.** Sockets: the distinct sockets among the entries of ``/proc/self/fd``
(``testbed.procfs``: a descriptor's dup, as the heartbeat's native beater holds, is the same
socket; the store's client connections, the listener, each TCP pair; shared-memory pairs hold
none). Memory:
``VmRSS`` from ``/proc/self/status`` (and its private part, ``RssAnon``), before ``init()``
(after the imports: the baseline), after it and after the allreduces. Store requests: ``gradsync.cluster.rendezvous.request_counts()``,
this process's requests by operation since it started, where the running gradsync has it
(None otherwise). Every figure is one line ``GSSCALE <json>`` on stdout; the driver
(``scale.py``) reads it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import threading
import time
from typing import Callable
from ..testbed.procfs import sockets

__all__ = ["SPECS", "PREFIX", "PhaseClock", "instrument", "sockets", "rss_mib",
           "request_counts", "main"]

PREFIX = "GSSCALE "
"""The start of the one line each rank prints, before its JSON."""

SPECS: tuple[tuple[str, str, str], ...] = (
    ("config", "gradsync.api", "load_config"),
    ("config", "gradsync.cluster.launch_env", "detect"),
    ("compile", "gradsync._native", "load"),
    ("store", "gradsync.cluster.rendezvous", "Store.__init__"),
    ("address table", "gradsync.cluster.rendezvous", "Store.gather_table"),
    ("store requests", "gradsync.cluster.rendezvous", "Store.*"),
    ("listen", "gradsync.transport.tcp", "Listener.__init__"),
    ("tcp connect", "gradsync.transport.tcp", "connect"),
    ("tcp connect", "gradsync.transport.tcp", "Listener.wait_for"),
    ("shm", "gradsync.connect._shm_setup", "connect"),
    ("barrier", "gradsync.cluster.rendezvous", "Store.barrier"),
    ("world", "gradsync.connect.world", "World.__init__"),
    ("heartbeat", "gradsync.liveness.heartbeat", "Heartbeat.__init__"),
    ("heartbeat", "gradsync.liveness.heartbeat", "Heartbeat.start"),
    ("engine", "gradsync.pipeline.engine", "Engine.__init__"),
)
"""(phase, module, function) per wrapped function of ``init()``, in the order ``init()``
reaches them; ``Class.*`` is every public method of the class not named elsewhere."""

_SMALL = 4  # float32 elements of the small allreduce: 16 bytes
_LARGE = (1 << 20) // 4  # 1 MiB


class PhaseClock:
    """Adds the time spent in wrapped functions to their phases, while ``active``.

    Only the outermost wrapped call on the thread that made the clock counts, so nested
    phases are never counted twice and other threads' calls are never counted at all.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.active = False
        self._depth = 0
        self._thread = threading.get_ident()

    def wrap(self, phase: str, fn: Callable) -> Callable:
        """``fn``, timed into ``phase``."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.active or self._depth or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start
        return timed


def instrument(clock: PhaseClock, specs=SPECS) -> list[str]:
    """Wraps every function of ``specs`` that exists; returns the phases that got one."""
    named = {(module, attr) for _, module, attr in specs}
    phases = []
    for phase, module_name, attr in specs:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is None:
            continue
        if name == "*":
            names = [n for n, v in vars(owner).items()
                     if not n.startswith("_") and callable(v) and not isinstance(
                         v, (staticmethod, classmethod))
                     and (module_name, f"{owner_name}.{n}") not in named]
        else:
            names = [name] if callable(vars(owner).get(name) if isinstance(owner, type)
                                       else getattr(owner, name, None)) else []
        for n in names:
            setattr(owner, n, clock.wrap(phase, getattr(owner, n)))
        if names and phase not in phases:
            phases.append(phase)
    return phases




def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory, MiB: all of it (``VmRSS``), or its private anonymous
    part (``RssAnon``: what each more rank costs, the libraries' pages being shared)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(f"no {field} line in /proc/self/status")


def request_counts() -> dict[str, int] | None:
    """This process's store requests by operation, or None where gradsync cannot count them."""
    import gradsync.cluster.rendezvous

    counts = getattr(gradsync.cluster.rendezvous, "request_counts", None)
    return None if counts is None else dict(counts())


def _limit(options, marks: dict) -> dict:
    """Meets the other ranks once at the store, as cheaply as anything can."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                     timedelta(seconds=options.timeout), wait_for_workers=False)
    key = f"limit/{os.environ['GRADSYNC_JOB_ID']}"
    if store.add(f"{key}/arrived", 1) == int(os.environ["WORLD_SIZE"]):
        store.set(f"{key}/go", "1")
    store.get(f"{key}/go")  # waits up to the store's timeout
    marks["met"] = time.time()
    return {"sockets_met": sockets()}


def _allreduce(gradsync, np, elements: int, rank: int, size: int, iters: int) -> dict:
    """First and steady times (ms) of an allreduce of ``elements`` float32, each checked."""
    data = np.full(elements, rank + 1, dtype=np.float32)
    expected = size * (size + 1) / 2

    def once() -> float:
        start = time.perf_counter()
        out = gradsync.allreduce(data, op=gradsync.Sum, name=f"scale.{elements}")
        took = time.perf_counter() - start
        if not np.all(np.asarray(out) == expected):
            raise AssertionError(f"rank {rank}: allreduce of {elements} float32 gave "
                                 f"{np.asarray(out)[:4]}..., expected {expected} everywhere")
        return took * 1e3

    first = once()
    gradsync.barrier()
    steady = [once() for _ in range(iters)]
    return {"bytes": elements * 4, "first_ms": first,
            "steady_ms": statistics.median(steady) if steady else None}


def _gradsync(options, marks: dict, report: dict) -> None:
    import numpy as np

    import gradsync

    clock = PhaseClock()
    report["phases_instrumented"] = instrument(clock)
    report["requests_before"] = request_counts()
    marks["init_called"] = time.time()
    clock.active = True
    try:
        gradsync.init()
    finally:
        clock.active = False
    marks["init_done"] = time.time()
    report["phases"] = clock.totals
    report["sockets_init"] = sockets()
    report["rss_init_mib"] = rss_mib()
    report["anon_init_mib"] = rss_mib("RssAnon")
    report["requests_init"] = request_counts()
    rank, size = gradsync.rank(), gradsync.size()
    report["allreduce"] = {
        "small": _allreduce(gradsync, np, _SMALL, rank, size, options.iters),
        "1MiB": _allreduce(gradsync, np, _LARGE, rank, size, options.iters)}
    report["sockets_end"] = sockets()
    report["rss_end_mib"] = rss_mib()
    report["anon_end_mib"] = rss_mib("RssAnon")
    report["requests_end"] = request_counts()


def main(boot: float, argv: list[str] | None = None) -> None:
    """Runs one rank; ``boot``: the wall clock at the bootstrap's first line."""
    p = argparse.ArgumentParser(prog="gradsync.bench.scale_rank")
    p.add_argument("--mode", choices=("limit", "gradsync"), required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0)
    options = p.parse_args(argv)
    marks = {"boot": boot}
    import torch  # noqa: F401  (what a rank imports, timed alike in both jobs)
    import torch.distributed  # noqa: F401

    import gradsync  # noqa: F401
    marks["imported"] = time.time()
    report: dict = {"rank": int(os.environ["RANK"]), "host": os.environ["GRADSYNC_HOSTNAME"],
                    "sockets_before": sockets(), "rss_before_mib": rss_mib(),
                    "anon_before_mib": rss_mib("RssAnon")}
    if options.mode == "limit":
        report.update(_limit(options, marks))
    else:
        _gradsync(options, marks, report)
    report["marks"] = marks
    print(PREFIX + json.dumps(report), flush=True)
