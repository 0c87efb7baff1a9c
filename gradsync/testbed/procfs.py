"""What a process holds, read from ``/proc``: the figures behind "sockets per rank", and
whether a process has ended.

For ``bench scale``'s ranks and the tests' rank scripts alike.
"""

from __future__ import annotations

import os

from gradsync.transport.shm import process_start_time

__all__ = ["gone", "sockets"]


def sockets() -> int:
    """The sockets this process holds open (TCP and Unix), each counted once.

    A socket is its inode (``socket:[N]``), not a descriptor: the heartbeat's native beater
    writes to a ``dup`` of each link's descriptor (``gradsync/liveness/beater.py``), which is the
    same connection and the same kernel socket, and counts once here.
    """
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:"):
            held.add(target)
    return len(held)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: exited, or a zombie its parent has not reaped (its
    sockets are closed and its ports refuse).

    A process may end while its ``/proc`` entry is read (``ProcessLookupError`` mid-read);
    that is an end too. Where ``/proc`` hides other users' processes, ``kill(pid, 0)`` says.
    """
    start = process_start_time(pid)
    if start is None:
        return True
    if start >= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False
