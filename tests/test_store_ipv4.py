"""The stores gradsync hosts listen on IPv4 when their clients reach them at an IPv4 address.

torch's store server looks up the host name of every client that connects. On the dual-stack
socket torch opens itself, a client on loopback is ``::ffff:127.0.0.1``, which /etc/hosts
does not answer, so the look-up goes to DNS and, where the DNS server drops it, every client
waits 5 s (docs/troubleshooting.md, "The rendezvous store stalls for 5 s"). On an IPv4 socket
the client is ``127.0.0.1``, which /etc/hosts answers. ``rendezvous.host_store`` makes that
socket for the launcher's store (``start_store``) and rank 0's (``Store``).

How it is seen, in this one process: ``/proc/self/net/tcp`` and ``tcp6`` list the TCP sockets
of the network namespace by family, with their local and remote address and state. A store's
port has one listening socket, in ``tcp`` when the server listens on IPv4; the connection it
accepted from its own client (the launcher's, rank 0's) is there too, from ``127.0.0.1``, the
peer whose name the server looks up. On a dual-stack socket both rows are in ``tcp6``, the
peer ``::ffff:127.0.0.1``. (On a host without IPv6 torch's own socket is IPv4 too, and these
checks cannot tell the two apart.)
"""

from __future__ import annotations

import socket

import pytest

from gradsync.cluster import rendezvous
from gradsync.cluster.rendezvous import Store, host_store
from gradsync.run.launcher import start_store

_LISTEN, _ESTABLISHED = "0A", "01"  # the kernel's TCP states, as /proc/net/tcp writes them


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order, x86: little
    endian), in the usual notation."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1]
                   for i in range(0, len(hex_address), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _sockets(port: int) -> list[tuple[str, str, str, str]]:
    """(family file, state, local address, remote address) of every TCP socket of this
    network namespace whose local port is ``port``: the store's listening socket and the
    connections it accepted (a client's own socket has another local port)."""
    rows = []
    for family in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{family}") as table:
            next(table)  # the header
            for line in table:
                local, remote, state = line.split()[1:4]
                address, _, hex_port = local.rpartition(":")
                if int(hex_port, 16) == port:
                    rows.append((family, state, _address(address),
                                 _address(remote.rpartition(":")[0])))
    return sorted(rows)


def _served_over_ipv4(store, listening_on: str) -> None:
    """The store listens on IPv4 only, on ``listening_on``, and its own client is an IPv4
    peer from 127.0.0.1."""
    # A request answered: the server has accepted its client's connection by now.
    store.set("k", "v")
    assert store.get("k") == b"v"
    rows = _sockets(store.port)
    assert ("tcp", _LISTEN, listening_on, "0.0.0.0") in rows, rows
    assert ("tcp", _ESTABLISHED, "127.0.0.1", "127.0.0.1") in rows, rows
    assert [row for row in rows if row[0] == "tcp6"] == [], rows


def test_the_launchers_store_of_a_one_host_job_listens_on_ipv4_loopback():
    # A one-host job's ranks are given 127.0.0.1 (store_address): only this host reaches it.
    store = start_store("127.0.0.1")
    assert store.port != 0  # port 0: bound here, and the port the kernel chose read back
    _served_over_ipv4(store, "127.0.0.1")


def test_the_launchers_store_for_other_hosts_listens_on_every_ipv4_interface():
    # The ranks are given an address of this host that other hosts reach (192.0.2.1 is a
    # documentation address: nothing connects to it here); the launcher's own client
    # connects on loopback, so the socket serves every IPv4 interface.
    store = start_store("192.0.2.1")
    _served_over_ipv4(store, "0.0.0.0")


def test_rank_0s_store_listens_on_ipv4(monkeypatch):
    # Rank 0 hosts the store under torchrun, SLURM or mpirun, at MASTER_ADDR. Store keeps
    # its torch stores for the life of the process; this one goes with the test.
    monkeypatch.setattr(rendezvous, "_BASES", {})
    view = Store("127.0.0.1", 0, True, "ipv4", 10.0, 1)
    _served_over_ipv4(view.base, "127.0.0.1")


class _FakeTCPStore:
    """Records how the store would be started; closes the descriptor it is handed, as
    torch's store does with itself."""

    def __init__(self, host, port, world_size, is_master, timeout, wait_for_workers=True,
                 master_listen_fd=None):
        self.host, self.port = host, port
        self.bound = None
        if master_listen_fd is not None:
            with socket.socket(fileno=master_listen_fd) as listener:
                self.bound = (listener.family, listener.getsockname())


@pytest.mark.parametrize("reached_at, client_addr, bound", [
    ("127.0.0.1", None, ("127.0.0.1", "127.0.0.1")),
    ("10.1.2.3", None, ("0.0.0.0", "10.1.2.3")),
    ("10.1.2.3", "127.0.0.1", ("0.0.0.0", "127.0.0.1")),
    ("0.0.0.0", None, ("0.0.0.0", "0.0.0.0")),
    # A host name may resolve to IPv6, an IPv6 address needs IPv6: torch's own socket.
    ("node01", None, None),
    ("localhost", None, None),
    ("::1", None, None),
    ("fe80::1", None, None),
])
def test_only_an_ipv4_address_gets_an_ipv4_socket(monkeypatch, reached_at, client_addr, bound):
    monkeypatch.setattr("torch.distributed.TCPStore", _FakeTCPStore)
    store = host_store(reached_at, 0, 5.0, client_addr=client_addr)
    if bound is None:
        assert (store.bound, store.host, store.port) == (None, reached_at, 0)
        return
    listen_on, host = bound
    assert store.bound == (socket.AF_INET, (listen_on, store.port)) and store.port != 0
    assert store.host == host


def test_a_store_that_fails_to_start_leaves_no_port_bound(monkeypatch):
    # torch never reached the descriptor (it failed before): host_store closes it.
    ports = []

    def failing(host, port, *args, **kwargs):
        ports.append(port)
        raise RuntimeError("torch failed")

    monkeypatch.setattr("torch.distributed.TCPStore", failing)
    with pytest.raises(RuntimeError, match="torch failed"):
        host_store("127.0.0.1", 0, 5.0)
    assert ports[0] != 0 and _sockets(ports[0]) == []
