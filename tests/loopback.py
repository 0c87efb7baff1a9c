"""A torch TCPStore hosted by a test, listening on 127.0.0.1 only, so no client waits on DNS.

torch's TCPStore server looks up the host name of each client that connects
(docs/troubleshooting.md, "The rendezvous store stalls for 5 s"). Listening on both IPv4 and
IPv6, as it does when it opens its own socket, it sees a client on loopback as
``::ffff:127.0.0.1``, which /etc/hosts does not answer, so the lookup goes to the DNS server;
where that server drops the query (this project's machines) glibc waits 5 s, and every client
of the store with it. Measured here (2026-11-29): 32 clients cloned from a test's store took
5.1 and 10.1 s on a store of its own socket, 0.06 and 0.12 s on one given an IPv4 socket
(``master_listen_fd``), where the lookup of ``127.0.0.1`` is answered by /etc/hosts.

The stores the runtime hosts (rank 0's, the launcher's) are made the same way, by
``gradsync.cluster.rendezvous.host_store``: given the loopback address, it listens on an IPv4
socket of 127.0.0.1 (tests/test_store_ipv4.py checks both).
"""

from __future__ import annotations

from gradsync.cluster.rendezvous import host_store


def store(timeout: float, world_size: int | None = None, wait_for_workers: bool = False):
    """A TCPStore server in this process on an IPv4 socket of 127.0.0.1, on a free port
    (``.port``; the store owns the socket and closes it with itself)."""
    return host_store("127.0.0.1", 0, timeout, world_size, wait_for_workers=wait_for_workers)
