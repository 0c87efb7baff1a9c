"""Failure scenarios; each rank prints one RESULT line that the test checks.

    faults.py kill VICTIM      VICTIM SIGKILLs itself in the middle of a 64 MiB allreduce
    faults.py mismatch WHAT[:TRANSPORT[:ALGORITHM]][,...]
                               rank 1 issues a different collective (shape/dtype/op/name/kind);
                               each WHAT in turn, in a fresh job of the same ranks
                               (``shutdown()`` then ``init()``: one start-up for all), over
                               TRANSPORT (``init()``'s argument; the default else) with
                               ALGORITHM (else $FAULT_ALGORITHM), each with its own RESULT
                               line, ``RESULT rank=R what=ENTRY ...``; WHAT ``intruders`` runs
                               the intruders' check (below) as one of them
    faults.py intruders        garbage, truncated and wrong-secret connections mid-job
    faults.py exit-early       rank 1 returns before the last allreduce
"""

import os
import signal
import socket
import sys
import threading
import time

import common  # (deadline)
import numpy as np

import gradsync as gs
from gradsync import job

mode = sys.argv[1]
TIMEOUT = float(os.environ.get("FAULT_TIMEOUT", "20"))
gs.init(timeout=TIMEOUT)
R, N = gs.rank(), gs.size()


def report(exc: BaseException) -> None:
    one_line = str(exc).replace("\n", " | ")
    print(f"RESULT rank={R} {type(exc).__name__}: {one_line}", flush=True)
    os._exit(17)


def mismatch(what: str, algorithm: str) -> None:
    """Rank 1 issues a collective that differs from the others' in ``what``."""
    shape, dtype, op, name = (10, 4), np.float32, gs.Sum, "grad.fc1"
    odd = R == 1
    if odd and what == "shape":
        shape = (10, 5)
    if odd and what == "dtype":
        dtype = np.float64
    if odd and what == "op":
        op = gs.Max
    if odd and what == "name":
        name = "grad.fc2"
    x = np.ones(shape, dtype=dtype)
    if odd and what == "kind":
        gs.broadcast(x, 0, name=name)
    else:
        gs.allreduce(x, op=op, name=name, algorithm=algorithm)


def intruders() -> str:
    """Rank 0 sends garbage, an absurd length, a truncated frame and a bad MAC to every other
    rank's listener; then the job goes on. Returns this rank's RESULT."""
    from gradsync.transport import frame

    world = job.world()
    if R == 0:
        for peer in world.peers[1:]:
            for payload in (b"GET / HTTP/1.1\r\n\r\n",                       # garbage
                            frame.pack(frame.Kind.PROOF, 0, 0, 0, 1 << 40),  # absurd length
                            frame.pack(frame.Kind.PROOF, 0, 0, 0, 80)[:20],  # truncated
                            frame.pack(frame.Kind.PROOF, 0, 0, 0, 80) + b"\0" * 80):  # bad MAC
                with socket.create_connection((peer.addr, peer.port)) as s:
                    s.settimeout(5)
                    try:
                        s.sendall(payload)
                        s.shutdown(socket.SHUT_WR)  # EOF: a truncated frame ends here
                        while s.recv(4096):
                            pass
                    except OSError:
                        pass
    y = gs.allreduce(np.full(1000, R, dtype=np.float64), op=gs.Sum)
    assert (y == N * (N - 1) / 2).all()
    gs.barrier()
    return f"ok rejected={world.listener.rejected}"


gs.allreduce(np.ones(10), name="warm-up")
start = time.monotonic()
try:
    if mode == "kill":
        victim = int(sys.argv[2])
        x = np.ones(16 << 20, dtype=np.float32)
        if R == victim:
            threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()
        for _ in range(50):
            gs.allreduce_(x, name="big", algorithm=os.environ.get("FAULT_ALGORITHM", "auto"))
        print(f"RESULT rank={R} no error", flush=True)
    elif mode == "mismatch":
        for i, entry in enumerate(sys.argv[2].split(",")):
            what, transport, algorithm = (entry.split(":") + ["", ""])[:3]
            if i or transport:  # the one before failed its job (as any mismatch does), or
                # this one needs other settings: a fresh job in these ranks
                gs.shutdown()
                gs.init(timeout=TIMEOUT, **({"transport": transport} if transport else {}))
                gs.allreduce(np.ones(10), name="warm-up")
            if what == "intruders":
                print(f"RESULT rank={R} what={entry} {intruders()}", flush=True)
                continue
            try:
                mismatch(what, algorithm or os.environ.get("FAULT_ALGORITHM", "auto"))
            except gs.CollectiveMismatchError as exc:
                one_line = str(exc).replace("\n", " | ")
                print(f"RESULT rank={R} what={entry} {type(exc).__name__}: {one_line}",
                      flush=True)
            else:
                print(f"RESULT rank={R} what={entry} no error", flush=True)
        os._exit(0)  # as report() leaves: the last job failed, no goodbye to wait for
    elif mode == "intruders":
        print(f"RESULT rank={R} {intruders()}", flush=True)
    elif mode == "exit-early":
        store = job.world().store
        if R == 1:
            store.set("early/pid", str(os.getpid()))  # a store request: no peer contact
            print(f"RESULT rank={R} left", flush=True)
            os._exit(0)
        # Rank 1 has returned before the others' last allreduce begins.
        pid = int(store.get("early/pid", 30))
        common.until(lambda: common.gone(pid), "the end of rank 1")
        gs.allreduce(np.ones(10), name="after")
        print(f"RESULT rank={R} no error", flush=True)
except gs.GradsyncError as exc:
    print(f"ELAPSED rank={R} {time.monotonic() - start:.2f}", flush=True)
    report(exc)
