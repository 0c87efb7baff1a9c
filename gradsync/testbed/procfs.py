"""What a process holds, read from ``/proc/self``: the figures behind "sockets per rank".

One function, for ``bench scale``'s ranks and the tests' rank scripts alike.
"""

from __future__ import annotations

import os

__all__ = ["sockets"]


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
