"""A rank that stops, dies, computes or fails on its own: what the others see, and when.

    silent.py DIR ENTRY [ENTRY ...]   ENTRY = MODE:VICTIM:TRANSPORT[:FIELD=VALUE,...]
    silent.py VICTIM TRANSPORT MODE [DIR]
                                      one mode (by hand: DIR defaults to a folder named by the
                                      job's launcher and store port)

The entries run in turn in the same processes, each in a fresh ``init()`` (TRANSPORT and the
Config fields given as its keyword arguments) ended by ``shutdown()``: one start-up for
several checks (tests/test_heartbeat.py's job). The modes, VICTIM being the rank that acts:

    stop    VICTIM stops itself (SIGSTOP); every other rank prints one RESULT line and ELAPSED
            (seconds from the stop to its error), then leaves a file in the entry's folder of
            DIR; VICTIM's lifeline kills it once all of them are there (at most 30 s)
    busy    VICTIM computes in Python for 1.5 heartbeat timeouts before joining the
            collectives: slow is not silent
    hold    VICTIM holds the GIL in one C call for 1.5 heartbeat timeouts before joining the
            collectives (as a long ``import torch`` on a loaded machine does); it prints HELD
            (the longest gap between the ticks of a Python thread meanwhile: the GIL was not
            let go)
    slow    busy and hold at once, the second by rank VICTIM + 1: both ranks slow past the
            timeout in the same 1.5 timeouts (one wait for the two checks)
    kill    VICTIM kills itself (SIGKILL) while the others sleep, in no collective: after 1 s
            each prints the abort record (RECORD), which only its heartbeat links can have
            posted that soon
    idle    VICTIM sleeps 3 s while the others wait for it in an allreduce; every rank prints
            STORE (its store requests per second over those 3 s)
    post    VICTIM posts an abort record while the others wait for it in an allreduce; they
            print ELAPSED and RESULT as for ``stop`` and leave their files, which VICTIM waits
            for before it shuts down

Every line an entry prints starts with ``[MODE:VICTIM:TRANSPORT] `` (its tag), and the first is
``RANK rank=R`` (this process's rank in that entry's job); an entry that returned on a rank
prints ``DONE rank=R`` after its ``shutdown()``. After ``stop`` and ``kill`` the job goes on
without the victim: every later rank moves down one (RANK, WORLD_SIZE and the local ones: the
ranks share one host), and the next ``init()`` meets the survivors alone. A survivor of the
last entry ends as when each mode was a job of its own: exit 17 after ``stop`` and ``post``,
0 after ``kill``. A rank that meets an error where its mode expects none (busy, hold, idle)
prints it and exits 17: the job ends there, and the checks of the entries after it fail.
"""

import ctypes
import os
import signal
import tempfile
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


def run(mode: str, victim: int, transport: str, settings: dict, directory: str,
        last: bool) -> None:
    """One entry (the module's docstring) in a fresh ``init()``; returns after ``shutdown()``,
    or ends the process (the victim of stop and kill; a survivor of the last entry)."""
    tag = f"{mode}:{victim}:{transport}"

    def say(text: str) -> None:
        print(f"[{tag}] {text}", flush=True)

    gs.init(transport=transport, timeout=120, **settings)
    R, N = gs.rank(), gs.size()
    say(f"RANK rank={R}")
    os.makedirs(directory, exist_ok=True)  # the survivors' files (stop, post)
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
            if last:
                os._exit(0)
        else:
            before = requests[0]
            if R == victim:
                time.sleep(3.0)
            gs.allreduce(np.ones(10), name="after the wait")
            say(f"STORE rank={R} {(requests[0] - before) / (time.time() - stopped_at):.2f}")
        return _leave(say, R, mode, victim)
    if R == victim or (mode == "slow" and R == victim + 1):
        time.sleep(max(0.0, stopped_at - time.time()))
        if mode == "slow":  # VICTIM busy, VICTIM + 1 holding the GIL, both at once
            mode = "busy" if R == victim else "hold"
        if mode == "stop":
            # Without a launcher (harness.spawn, forked ranks) nobody ends a stopped rank: its
            # lifeline does, once every other rank has its error (under a launcher, before the
            # stop's grace ends).
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
            # Not before the others have their error: closing this rank's World sooner would
            # end their allreduce by its closed connections instead of the record.
            common.until(lambda: len(os.listdir(directory)) >= N - 1, "the others' errors")
            return _leave(say, R, mode, victim)
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
        if mode in ("stop", "post"):
            common.reported(directory, R)  # the stopped rank's lifeline waits for these
        if last or mode not in ("stop", "post"):
            os._exit(17)
    return _leave(say, R, mode, victim)


def _leave(say, rank: int, mode: str, victim: int) -> None:
    """Ends the entry's job on this rank; after a stop or a kill, renumbers this rank for the
    next one, which goes on without the victim."""
    gs.shutdown()
    say(f"DONE rank={rank}")
    if mode in ("stop", "kill"):
        size = int(os.environ["WORLD_SIZE"]) - 1
        rank -= rank > victim
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)})


def entry(text: str):
    """``MODE:VICTIM:TRANSPORT[:FIELD=VALUE,...]`` as (mode, victim, transport, settings)."""
    mode, victim, transport, *rest = text.split(":")
    settings = dict(item.split("=", 1) for item in rest[0].split(",")) if rest else {}
    return mode, int(victim), transport, {field: float(value) for field, value in
                                          settings.items()}


if sys.argv[1].isdigit():  # VICTIM TRANSPORT MODE [DIR]
    # by hand under gradsync run (docs/elastic.md): a folder of this job's, the same on every
    # rank (its launcher and store port)
    job_of = [os.environ.get(name, "") for name in ("GRADSYNC_LAUNCHER_PID",
                                                     "GRADSYNC_STORE_PORT", "MASTER_PORT")]
    folder = sys.argv[4] if len(sys.argv) > 4 else \
        os.path.join(tempfile.gettempdir(), "gs-silent-" + "-".join(job_of))
    entries = [f"{sys.argv[3]}:{sys.argv[1]}:{sys.argv[2]}"]
else:
    folder, entries = sys.argv[1], sys.argv[2:]
for index, text in enumerate(entries):
    mode, victim, transport, settings = entry(text)
    run(mode, victim, transport, settings, os.path.join(folder, str(index)),
        last=index == len(entries) - 1)
