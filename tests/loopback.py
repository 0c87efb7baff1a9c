"""A torch TCPStore hosted by a test, listening on 127.0.0.1 only, so no client waits on DNS.

torch's TCPStore server looks up the host name of each client that connects
(docs/troubleshooting.md, "The rendezvous store stalls for 5 s"). Listening on both IPv4 and
IPv6, as it does when it opens its own socket, it sees a client on loopback as
``::ffff:127.0.0.1``, which /etc/hosts does not answer, so the lookup goes to the DNS server;
where that server drops the query (this project's machines) glibc waits 5 s, and every client
of the store with it. Measured here (2026-11-29): 32 clients cloned from a test's store took
5.1 and 10.1 s on a store of its own socket, 0.06 and 0.12 s on one given an IPv4 socket
(``master_listen_fd``), where the lookup of ``127.0.0.1`` is answered by /etc/hosts.

What the tests check never depends on that wait; a store that ranks started by the runtime
itself host (the launcher's, rank 0's) still opens its own socket.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def store(timeout: float, world_size: int | None = None, wait_for_workers: bool = False):
    """A TCPStore server in this process on an IPv4 socket of 127.0.0.1 (the store owns the
    socket and closes it with itself)."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)  # many ranks connect at once
    port = listener.getsockname()[1]
    return TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=timeout),
                    wait_for_workers=wait_for_workers, master_listen_fd=listener.detach())
