"""Rank side of tests/test_connections.py's process-set test: the store clients a process holds
as Horovod-API process sets are added, used and removed.

Run by ``gradsync run -np 3`` (the launcher hosts the store, so every socket to the store's
port in this process is a client of this rank). Each rank counts those sockets after
``hvd.init()`` (the job's World and the global set's: the store client, the root World's
abort watch, the sets' shared client, the root's bell) and again after three more sets
(``[0, 1]``, ``[1, 2]``, ``[0, 2]``: two of them with this rank in) have each run an
allreduce, and after they are removed. Prints one ``RESULT`` line of JSON.
"""

import json
import os
import socket
import time

import common  # noqa: F401  (deadline)
import torch

import gradsync.torch as hvd
from gradsync import job

hvd.init()
R, N = hvd.rank(), hvd.size()
PORT = job.world().env.store_port


def store_clients() -> int:
    """This process's TCP sockets connected to the store's port."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == PORT:
                count += 1
        except (OSError, IndexError):
            pass  # a listener, a unix socket, or not connected
        finally:
            sock.close()
    return count


def settled(limit: int, seconds: float = 5.0) -> int:
    """The count once it is at most ``limit`` (a meeting's client closes when its last
    reference goes), or what it is after ``seconds``."""
    end = time.monotonic() + seconds
    while (count := store_clients()) > limit and time.monotonic() < end:
        time.sleep(0.05)
    return count


assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="global").tolist() == [N] * 3
at_init = store_clients()
sets = [hvd.add_process_set(ranks) for ranks in ([0, 1], [1, 2], [0, 2])]
mine = [ps for ps in sets if R in ps.ranks]
for ps in mine:
    got = hvd.allreduce(torch.full((3,), R + 1.0), op=hvd.Sum, name=f"set{ps.process_set_id}",
                        process_set=ps)
    assert got.tolist() == [float(sum(r + 1 for r in ps.ranks))] * 3, (ps, got)
with_sets = settled(at_init)
for ps in sets:
    hvd.remove_process_set(ps)
removed = settled(at_init)
print(f"RESULT rank={R} " + json.dumps({"init": at_init, "sets": with_sets,
                                         "removed": removed, "member_of": len(mine)}),
      flush=True)
hvd.shutdown()
