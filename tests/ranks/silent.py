"""A rank that stops, dies, computes or fails on its own: what the others see, and when.

    silent.py VICTIM TRANSPORT stop DIR
                                      VICTIM stops itself (SIGSTOP); every other rank prints
                                      one RESULT line and ELAPSED (seconds from the stop to
                                      its error), then leaves a file in DIR; VICTIM's lifeline
                                      kills it once all of them are there (at most 30 s)
    silent.py VICTIM TRANSPORT busy   VICTIM computes in Python for 1.5 heartbeat timeouts
                                      before joining the collectives: slow is not silent
    silent.py VICTIM TRANSPORT hold   VICTIM holds the GIL in one C call for 1.5 heartbeat
                                      timeouts before joining the collectives (as a long
                                      ``import torch`` on a loaded machine does); it prints
                                      HELD (the longest gap between the ticks of a Python
                                      thread meanwhile: the GIL was not let go)
    silent.py VICTIM TRANSPORT kill   VICTIM kills itself (SIGKILL) while the others sleep,
                                      in no collective: after 1 s each prints the abort
                                      record (RECORD), which only its heartbeat links can
                                      have posted that soon
    silent.py VICTIM TRANSPORT idle   VICTIM sleeps 3 s while the others wait for it in an
                                      allreduce; every rank prints STORE (its store requests
                                      per second over those 3 s)
    silent.py VICTIM TRANSPORT post   VICTIM posts an abort record while the others wait for
                                      it in an allreduce; they print ELAPSED as for ``stop``

    silent.py VICTIM - MODE:TRANSPORT[:FIELD=VALUE,...] ...
                                      the modes in turn in the same ranks, each with its own
                                      ``init()`` (TRANSPORT and the Config fields given as its
                                      keyword arguments) and ``shutdown()``: one start-up for
                                      several checks (tests/test_heartbeat.py's calm job:
                                      busy, hold, idle, then post, which ends the job)

Every line a mode prints starts with ``[MODE] ``; a mode that returned on a rank prints
``[MODE] DONE rank=R`` after its ``shutdown()``. The modes that end their rank (stop, kill,
post) can only come last.
"""

import ctypes
import os
import signal
import threading
import sys
import time

import common  # (deadline; the stopped rank's lifeline)
import numpy as np

import gradsync as gs
from gradsync import job
from gradsync.cluster.rendezvous import Store

requests = [0]
for name in ("set", "get", "add", "check", "post_abort"):
    def counted(self, *args, _call=getattr(Store, name), **kwargs):
        requests[0] += 1  # one request to the store (read_abort and barrier are made of these)
        return _call(self, *args, **kwargs)
    setattr(Store, name, counted)


def run(victim: int, mode: str, transport: str, settings: dict, directory: str = "") -> int:
    """One mode (the module's docstring) in a fresh ``init()``; returns this rank after
    ``shutdown()`` for busy, hold and idle, ends the process for the others."""

    def say(text: str) -> None:
        print(f"[{mode}] {text}", flush=True)

    gs.init(transport=transport, timeout=120, **settings)
    R, N = gs.rank(), gs.size()
    gs.allreduce(np.ones(10), name="warm-up")
    stopped_at = gs.broadcast_object(time.time() + 0.5, 0)  # when the victim acts, by the clock
    if mode in ("kill", "idle"):
        time.sleep(max(0.0, stopped_at - time.time()))
        if mode == "kill" and R == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "kill":
            time.sleep(1.0)
            record = job.world().store.read_abort()
            say(f"RECORD rank={R} {record}")
            os._exit(0)
        before = requests[0]
        if R == victim:
            time.sleep(3.0)
        gs.allreduce(np.ones(10), name="after the wait")
        say(f"STORE rank={R} {(requests[0] - before) / (time.time() - stopped_at):.2f}")
        gs.shutdown()
        return R
    if R == victim:
        time.sleep(max(0.0, stopped_at - time.time()))
        if mode == "stop":
            # Without a launcher (harness.spawn) nobody ends a stopped rank: its lifeline does,
            # once every other rank has its error (under a launcher, before the stop's grace
            # ends).
            common.lifeline(directory, N - 1)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "hold":
            ticks, ticked, done = [], threading.Event(), threading.Event()

            def tick():
                while not done.is_set():
                    ticks.append(time.monotonic())
                    ticked.set()
                    done.wait(0.01)

            ticker = threading.Thread(target=tick)
            ticker.start()
            ticked.wait()
            # ctypes.pythonapi is a PyDLL: its calls keep the GIL, here for the whole sleep.
            ctypes.pythonapi.usleep(int(1.5 * job.world().config.heartbeat_timeout * 1e6))
            ticks.append(time.monotonic())
            done.set()
            ticker.join()
            ticks.sort()
            say(f"HELD rank={R} {max(b - a for a, b in zip(ticks, ticks[1:])):.2f}")
        elif mode == "post":
            job.world().store.post_abort({"kind": "GradsyncError", "rank": R, "peer": None,
                                          "message": "posted on purpose"})
            time.sleep(30)
        else:  # busy: longer than the timeout, in Python (the native beater beats meanwhile)
            end = time.monotonic() + 1.5 * job.world().config.heartbeat_timeout
            while time.monotonic() < end:
                sum(i * i for i in range(1000))
    try:
        for step in range(1000 if mode in ("stop", "post") else 20):
            gs.allreduce(np.ones(1000), name=f"step{step}")
        say(f"RESULT rank={R} no error")
    except gs.GradsyncError as exc:
        say(f"ELAPSED rank={R} {time.time() - stopped_at:.2f}")
        say(f"RESULT rank={R} {type(exc).__name__}: {exc}".replace("\n", " | "))
        if mode == "stop":
            common.reported(directory, R)  # the stopped rank's lifeline waits for these
        os._exit(17)
    gs.shutdown()
    return R


def entry(text: str):
    """``MODE:TRANSPORT[:FIELD=VALUE,...]`` as (mode, transport, settings)."""
    mode, transport, *rest = text.split(":")
    settings = dict(item.split("=", 1) for item in rest[0].split(",")) if rest else {}
    return mode, transport, {field: float(value) for field, value in settings.items()}


victim = int(sys.argv[1])
if sys.argv[2] == "-":
    runs = [entry(text) for text in sys.argv[3:]]
else:
    runs = [(sys.argv[3], sys.argv[2], {})]
for mode, transport, settings in runs:
    rank = run(victim, mode, transport, settings, sys.argv[4] if mode == "stop" else "")
    print(f"[{mode}] DONE rank={rank}", flush=True)
