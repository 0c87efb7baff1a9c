"""The flight recorder and the stall report in a real job (tests/test_flight_recorder.py).

    flight.py stall DIR      rank 1 sleeps in a loop of user code while the others wait in an
                             allreduce; each waiting rank prints its stall report (REPORT
                             lines) and the seconds from the allreduce's start to the report,
                             then writes DIR/reported.<rank>, which ends rank 1's sleep
    flight.py hvd-stall DIR  the same through the Horovod API (``hvd.allreduce``)
    flight.py mismatch       two agreed allreduces, then rank 1 issues an allreduce of another
                             size; every rank prints RESULT with the error it got (the dumps
                             go to GRADSYNC_FLIGHT_RECORDER_DIR)
    flight.py torch-mismatch the same through the torch backend (started as torchrun starts
                             ranks: harness.spawn)
"""

import logging
import os
import sys
import threading
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

mode = sys.argv[1]
if mode == "torch-mismatch":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gradsync")
    R = dist.get_rank()
    dist.all_reduce(torch.ones(8))
    dist.all_reduce(torch.ones(8))
    try:
        dist.all_reduce(torch.ones(12 if R == 1 else 8))
        print(f"RESULT rank={R} no error", flush=True)
    except RuntimeError as exc:
        print(f"RESULT rank={R} {type(exc).__name__}", flush=True)
    sys.exit(0)
elif mode == "hvd-stall":
    import torch

    import gradsync.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(4), name="warm-up")

    def step():
        hvd.allreduce(torch.ones(4), name="step")
else:
    gs.init()
    gs.allreduce(np.ones(4), name="warm-up")

    def step():
        gs.allreduce(np.ones(4), name="step")
R, N = gs.rank(), gs.size()


def sleepy_user_function(directory: str) -> None:
    """User code that does not reach the collective: a loop of short sleeps, until every
    waiting rank has reported (the sleeping frame the reports must show)."""
    waiting = [r for r in range(N) if r != 1]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(directory, f"reported.{r}")) for r in waiting):
        if time.monotonic() > deadline:
            sys.exit(f"rank {R}: the waiting ranks did not report within 60 s")
        time.sleep(0.05)


class Catch(logging.Handler):
    """Keeps the first stall report of the gradsync logger; sets ``seen``."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = threading.Event()
        self.text = ""
        self.at = 0.0

    def emit(self, record):
        text = record.getMessage()
        if "stall report" in text and not self.seen.is_set():
            self.text, self.at = text, time.monotonic()
            self.seen.set()


if mode in ("stall", "hvd-stall"):
    directory = sys.argv[2]
    if R == 1:
        sleepy_user_function(directory)
        step()
    else:
        catch = Catch()
        logging.getLogger("gradsync").addHandler(catch)
        start = time.monotonic()

        def when_reported():
            catch.seen.wait(60)
            print(f"SECONDS rank={R} {catch.at - start:.2f}", flush=True)
            for line in catch.text.splitlines():
                print(f"REPORT rank={R} {line}", flush=True)
            open(os.path.join(directory, f"reported.{R}"), "w").close()

        waiter = threading.Thread(target=when_reported)
        waiter.start()
        step()
        waiter.join()
    print(f"RESULT rank={R} ok", flush=True)
elif mode == "mismatch":
    gs.allreduce(np.ones(8), name="grad.a")
    gs.allreduce(np.ones(8), name="grad.b")
    try:
        gs.allreduce(np.ones(12 if R == 1 else 8), name="grad.c")
        print(f"RESULT rank={R} no error", flush=True)
    except gs.GradsyncError as exc:
        print(f"RESULT rank={R} {type(exc).__name__}", flush=True)
gs.shutdown()
