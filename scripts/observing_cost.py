"""What observing a job costs, counted: calls per operation and per pace round (issue 41, item 5).

Run as ``gradsync run -np 2 python3 scripts/observing_cost.py``. Times on a shared machine
move with its load; counts do not. So this counts, on rank 0, the Python functions and the
built-in (C) functions called while a job runs its operations, with observing on (the
defaults: the flight recorder's ring of 2,000, the pace meter, the publisher) and off (as
``gradsync bench train --overhead``'s ``gs-off``: the ring at 0, the meter and the publisher
paused), over the same operations:

- ``hvd``: steps of the MLP of ``gradsync bench train`` (batch 32) under
  ``DistributedOptimizer`` (the Horovod API's negotiation thread, one fused allreduce of
  the gradients a step);
- ``numpy``: 4-element allreduces of the NumPy API, synchronous (the express lane or the
  engine inline) and asynchronous (the progress thread), one ``synchronize`` each;
- ``torch``: ``dist.all_reduce`` of 4 elements on a group of the torch backend "gradsync".

Each call is charged to the file of the code that runs it (a C function to the file of its
caller), so the columns ``flight_recorder``, ``pace`` and ``straggler_watch`` are what the
recorder and the meter call on the operations' threads (the caller's, the negotiation's,
the progress thread's, the torch lanes'); ``all`` is every call there and ``clock reads``
the calls of the ``time`` module's clocks. gradsync's service threads (heartbeats, the abort
watch, the listener) idle alike on and off and are left out; the publisher's thread is
counted alone: one ``Publisher.round`` with the ring full, after 125 steps of the MLP (a
second of them, at 8 ms a step), made here on the training thread: its calls by function
and the CPU time it held (``time.thread_time``, which a busy machine moves less than wall
time). Prints one table per front door.
"""

import collections
import gc
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradsync as gs
import gradsync.torch as hvd
from gradsync import job
from gradsync.flight_recorder import recorder
from gradsync.liveness.pace import meter

OBSERVING = ("flight_recorder.py", "liveness/pace.py", "liveness/straggler_watch.py",
             "liveness/traffic.py", "timeline.py")

_counting = False
_calls: collections.Counter = collections.Counter()
_round: "collections.Counter | None" = None  # what a publisher round calls, by name
_SERVICE = ("gradsync-pace", "gradsync-heartbeat", "gradsync-abort-watch",
            "gradsync-listener", "gradsync-handshake", "gradsync-pulse", "gradsync-stall")
_CLOCKS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
           "thread_time", "thread_time_ns"}


def _profile(frame, event, arg):
    if not _counting or event not in ("call", "c_call"):
        return
    if threading.current_thread().name.startswith(_SERVICE):
        return  # the service threads idle alike on and off; the publisher is counted apart
    where = frame.f_code.co_filename
    for name in OBSERVING:
        if where.endswith(name):
            _calls[name.rsplit("/", 1)[-1][:-3]] += 1
            break
    _calls["all"] += 1
    if event == "c_call":
        called = getattr(arg, "__name__", "")
        if called in _CLOCKS and getattr(arg, "__module__", None) == "time":
            _calls["clock reads"] += 1
    if _round is not None:
        short = where.split("gradsync/")[-1]
        _round[f"{short}:{frame.f_code.co_name}" if event == "call" else
               f"C {getattr(arg, '__qualname__', arg)} from {short}"] += 1


def _collected(phase, info):
    if _counting and phase == "start":
        _calls[f"gc{info['generation']}"] += 1


def counted(fn, ops: int) -> dict:
    """Calls per operation while ``fn`` runs ``ops`` operations (on every thread but the
    publisher's), and the garbage collections of each generation meanwhile (in all)."""
    global _counting
    _calls.clear()
    _counting = True
    try:
        fn()
    finally:
        _counting = False
    return {k: v if k.startswith("gc") else v / ops for k, v in _calls.items()}


def observe(on: bool, entries: int) -> None:
    """Observing on (the job's settings) or off (``gs-off`` of ``bench train --overhead``)."""
    recorder.resize(entries if on else 0)
    meter.pause(on)
    pace = job.current().pace
    if pace is not None:
        pace.paused = not on


def table(title: str, rows: dict) -> None:
    print(f"{title}: calls per operation; gc: collections of each generation, in all")
    keys = ["all", "flight_recorder", "pace", "straggler_watch", "clock reads", "gc0", "gc1",
            "gc2"]
    print("  " + "".join(f"{k:>16}" for k in ["mode"] + keys[:5])
          + "".join(f"{k:>6}" for k in keys[5:]))
    for mode, found in rows.items():
        print("  " + f"{mode:>16}" + "".join(f"{found.get(k, 0):>16.1f}" for k in keys[:5])
              + "".join(f"{found.get(k, 0):>6}" for k in keys[5:]))


def main() -> None:
    gc.callbacks.append(_collected)
    threading.setprofile(_profile)  # before init: the threads gradsync starts inherit it
    sys.setprofile(_profile)
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    entries = recorder.size
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    store = dist.PrefixStore("observing-cost", job.world().store.base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    group = dist.new_group(backend="gradsync")

    def steps(n):
        def run():
            for _ in range(n):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        return run

    small = np.ones(4, dtype=np.float32)

    def numpy_ops(n):
        def run():
            for i in range(n):
                gs.allreduce(small, name="cost.sync")
                gs.synchronize(gs.allreduce_async(small, name="cost.async"))
        return run

    tensor = torch.ones(4)

    def torch_ops(n):
        def run():
            for _ in range(n):
                dist.all_reduce(tensor, group=group)
        return run

    fronts = {"hvd (per step)": (steps, 40), "numpy (per 2 ops)": (numpy_ops, 200),
              "torch (per op)": (torch_ops, 200)}
    for fn, n in fronts.values():  # warm up, and fill the ring
        fn(n)()
    numpy_ops(1000)()
    results = {}
    for title, (fn, n) in fronts.items():
        rows = {}
        for mode in ("on", "off", "on again"):
            observe(mode != "off", entries)
            gs.barrier()
            rows[mode] = counted(fn(n), n)
        results[title] = rows
    observe(True, entries)
    gs.barrier()

    # One publisher round, on this thread, after a second of the MLP's steps (125 steps of
    # 8 ms) on a ring full of operations posted before.
    pace = job.current().pace
    if pace is not None:
        pace.stop()
        numpy_ops(entries // 2)()
        pace.summary()
        steps(125)()
        global _counting, _round
        _calls.clear()
        _round = collections.Counter()
        began = time.thread_time_ns()
        _counting = True
        try:
            pace.round()
        finally:
            _counting = False
        counted_ms = (time.thread_time_ns() - began) / 1e6
        round_calls, round_what, _round = dict(_calls), _round, None
        # The same again without the profiler (whose own calls the time above includes),
        # five times: the median.
        spent = []
        for _ in range(5):
            steps(125)()
            sys.setprofile(None)
            began = time.thread_time_ns()
            pace.round()
            spent.append((time.thread_time_ns() - began) / 1e6)
            sys.setprofile(_profile)
        cpu_ms = sorted(spent)[2]
    gs.barrier()
    if rank == 0:
        for title, rows in results.items():
            table(title, rows)
        if pace is not None:
            print(f"one publisher round (rank 0, ring of {recorder.size} full, 125 steps "
                  "since the last): "
                  f"{round_calls.get('all', 0)} calls, of them flight_recorder "
                  f"{round_calls.get('flight_recorder', 0)}, straggler_watch "
                  f"{round_calls.get('straggler_watch', 0)}, traffic "
                  f"{round_calls.get('traffic', 0)}; {cpu_ms:.2f} ms of CPU (median of 5; "
                  f"{counted_ms:.2f} while counted); the most called:")
            for what, count in round_what.most_common(12):
                print(f"  {count:>6}  {what}")
    sys.setprofile(None)
    threading.setprofile(None)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
