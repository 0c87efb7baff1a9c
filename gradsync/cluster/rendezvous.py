"""How ranks find each other: torch.distributed's TCPStore, namespaced by job.

The store carries only small control data: each rank's address, port, host and pid; the job
secret when no launcher provided one; barrier counters; and the job's *abort record*, the first
failure any rank reported, which every waiting rank polls so that one rank's error ends the
collective everywhere instead of leaving the others to hang.

What a job costs the store grows with its size, so every request this process makes through a
``Store`` view is counted by operation (``request_counts``): the scale bench and the tests read
the counts to check that the whole rendezvous is O(N) requests for the job, not O(N^2). The
address table is the one place that would be quadratic if done naively (every rank reading
every rank's key); ``gather_table`` makes it one gather by rank 0 (``multi_get``) and one read
of the published table per rank.

The bytes the store sends back are counted too (``served_bytes``): there the table is still
quadratic, N ranks reading one key of N entries, so it is published compressed (zlib): a
World's entry is a host name, an address, a port and a pid, about 40 bytes of text, of which
the port and pid (about 5 bytes of information) are all that differs from the neighbours'
entries. That divides the bytes by about 3 (one rank per host) to 4 (8 per host); it does not
change their growth (docs/scale.md says what would).

A store this process hosts (``host_store``: rank 0's, the launcher's) listens on an IPv4 socket
of its own making whenever its clients reach it at an IPv4 address. torch's server looks up the
host name of every client that connects, on the thread that serves all of them; on the
dual-stack socket torch opens itself a client on loopback is ``::ffff:127.0.0.1``, which
``/etc/hosts`` does not answer, so the look-up goes to DNS, and where the DNS server drops it
every client waits 5 s (docs/troubleshooting.md, "The rendezvous store stalls for 5 s"). On an
IPv4 socket the same client is ``127.0.0.1``, which ``/etc/hosts`` answers at once.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
import zlib
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import GradsyncTimeoutError, PeerLostError

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["Store", "host_store", "request_counts", "served_bytes", "BELL_COUNT", "bell_key"]

_ABORT = "abort"
BELL_COUNT = "bell/count"
"""The count of a root World's rings (``Store.rings``), in the root's namespace."""


def bell_key(n: int) -> str:
    """The key of ring ``n`` (from 1) of a root World's bell: it holds the ringing job's id."""
    return f"bell/{n}"

_BASES: dict = {}
_COUNTS: collections.Counter = collections.Counter()
_BYTES: collections.Counter = collections.Counter()
_COUNTS_LOCK = threading.Lock()


def request_counts() -> dict[str, int]:
    """The store requests this process has made since it started, by operation name.

    Summed over every ``Store`` view and clone of this process (the World's, its sub-worlds',
    the heartbeat's). Names are the torch ``Store`` methods called: ``set``, ``get``, ``add``,
    ``check``, ``compare_set``, ``multi_get``. Each counts one call; on the wire torch's
    TCPStore turns a ``get`` into a wait then a get (two round trips) and a ``multi_get`` into
    a wait on all its keys then one get of all of them.

    Returns:
        A new dict ``{operation: count}`` (operations never called are absent).
    """
    with _COUNTS_LOCK:
        return dict(_COUNTS)


def served_bytes() -> dict[str, int]:
    """The bytes of the values the store returned to this process since it started, by
    operation (``get``, ``multi_get``), summed as ``request_counts`` is.

    Returns:
        A new dict ``{operation: bytes}``.
    """
    with _COUNTS_LOCK:
        return dict(_BYTES)


def _count(operation: str) -> None:
    with _COUNTS_LOCK:
        _COUNTS[operation] += 1


def _served(operation: str, values) -> None:
    with _COUNTS_LOCK:
        _BYTES[operation] += sum(len(v) for v in values)


def host_store(reached_at: str, port: int, timeout: float, world_size: int | None = None, *,
               client_addr: str | None = None, wait_for_workers: bool = False) -> "TCPStore":
    """A TCPStore server in this process, and this process's client of it.

    Where the clients reach the store at a literal IPv4 address, the server listens on an IPv4
    socket made here (``store_listener``; module docstring: no client waits on DNS). A host
    name may resolve to an IPv6 address, and an IPv6 address needs an IPv6 socket: for those
    the server opens torch's own dual-stack socket.

    Args:
        reached_at: the address every client is given for the store (``MASTER_ADDR``, the
            launcher's ``store_address``).
        port: the port to listen on; 0 for a free one (the store's ``.port`` says which).
        timeout: seconds the store's requests wait.
        world_size: the clients the server counts (``TCPStore``'s ``world_size``).
        client_addr: where this process's own client connects (default ``reached_at``): the
            launcher's connects on loopback whatever address the ranks are given.
        wait_for_workers: wait here until ``world_size`` clients connected.

    Raises:
        OSError: the port cannot be bound; RuntimeError: torch cannot start the store.
    """
    host = client_addr or reached_at
    listener = store_listener(reached_at, port)
    if listener is None:
        from torch.distributed import TCPStore

        return TCPStore(host, port, world_size, True, timedelta(seconds=timeout),
                        wait_for_workers=wait_for_workers)
    port = listener.getsockname()[1]
    return serve_store(listener.detach(), port, host, timeout, world_size,
                       wait_for_workers=wait_for_workers)


def store_listener(reached_at: str, port: int) -> "socket.socket | None":
    """The listening IPv4 socket of a store its clients reach at ``reached_at``, bound to
    ``port`` (0: a free one), or None where ``reached_at`` is not a literal IPv4 address.

    Bound to that address when it is a loopback one (only this host can reach it there, so
    no other interface need be open), else to 0.0.0.0, every IPv4 interface, as torch's own
    socket would listen on every one. Made without torch: the launcher binds it and hands it
    to the process that serves the store (``run/keeper.py``), so the ranks can be given the
    port before torch is imported anywhere.

    Raises:
        OSError: the port cannot be bound.
    """
    try:
        address = ipaddress.ip_address(reached_at)
    except ValueError:  # a host name
        return None
    if address.version != 4:
        return None
    bind = reached_at if address.is_loopback else "0.0.0.0"
    # create_server sets SO_REUSEADDR, as torch does on its own socket: a fixed port (a
    # MASTER_PORT used again) binds while the last job's connections linger in TIME_WAIT. The
    # backlog is the kernel's cap: many ranks connect at once, some before the store serves.
    return socket.create_server((bind, port), family=socket.AF_INET, backlog=socket.SOMAXCONN)


def serve_store(fd: int, port: int, host: str, timeout: float, world_size: int | None = None,
                *, wait_for_workers: bool = False) -> "TCPStore":
    """A TCPStore server on the listening socket ``fd`` (``store_listener``'s, detached, bound
    to ``port``), and this process's client of it, connecting at ``host``.

    The store owns ``fd`` from here on and closes it with itself. torch also closes one it
    adopted when the start fails; one it never reached is still the same socket (the same
    inode: a number torch closed and another thread reused would be another file) and is
    closed here, so a failed start leaves no port bound.

    Raises:
        OSError: ``fd`` is no listening socket; RuntimeError: torch cannot start the store.
    """
    inode = os.fstat(fd).st_ino
    try:
        from torch.distributed import TCPStore

        return TCPStore(host, port, world_size, True, timedelta(seconds=timeout),
                        wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        try:
            if os.fstat(fd).st_ino == inode:
                os.close(fd)
        except OSError:
            pass
        raise


class Store:
    """A thread-safe, job-scoped view of a torch TCPStore.

    Args:
        addr, port: where the store listens.
        is_server: host the store in this process (rank 0 under torchrun/SLURM/mpirun).
        job: the job id; every key is prefixed with it.
        timeout: seconds to wait for the store and for keys.
        world_size: number of ranks (for the server's bookkeeping).
    """

    def __init__(self, addr: str, port: int, is_server: bool, job: str, timeout: float,
                 world_size: int):
        from torch.distributed import TCPStore

        key = (addr, port, is_server)
        base = _BASES.get(key)
        if base is None:
            try:
                if is_server:
                    base = host_store(addr, port, timeout, world_size)
                else:
                    base = TCPStore(addr, port, None, False, timedelta(seconds=timeout),
                                    wait_for_workers=False)
            except (RuntimeError, OSError) as exc:
                # A client that cannot reach the store is most often behind a firewall.
                hint = "" if is_server else (
                    f"; is TCP port {port} of {addr} open to this host (a firewall between "
                    f"the hosts)? open it, or give an address this host can reach "
                    f"(MASTER_ADDR, GRADSYNC_STORE_ADDR)")
                raise GradsyncTimeoutError(f"could not reach the rendezvous store at "
                                           f"{addr}:{port} within {timeout:.0f}s: {exc}"
                                           f"{hint}") from None
            # Kept for the life of the process: a store hosted here must outlive this rank's
            # shutdown (other ranks may still read the abort record), and a later init() of
            # the same job reuses it (under a new key prefix, see World.connect).
            _BASES[key] = base
        self._init(base, job, timeout)

    @classmethod
    def over(cls, base, job: str, timeout: float) -> "Store":
        """A job-scoped view of an existing torch ``Store`` (the one ``init_process_group``
        hands a backend, or another World's base for a sub-world).

        Args:
            base: any ``torch.distributed.Store``; it is not closed or owned.
            job: the key prefix; each World over one base needs its own.
            timeout: seconds to wait for keys.
        """
        self = cls.__new__(cls)
        self._init(base, job, timeout)
        return self

    def child(self, base, job: str, timeout: float) -> "Store":
        """The store of a sub-world of this store's World: ``job``'s view over ``base``. A
        plain view here; an elastic generation's store gives one whose waits also give up
        when the generation is abandoned (``elastic/worker.py``, ``_GenerationStore``)."""
        return Store.over(base, job, timeout)

    def _init(self, base, job: str, timeout: float) -> None:
        from torch.distributed import PrefixStore

        self.timeout = timeout
        self._base = base
        self._job = job
        self._store = PrefixStore(f"gradsync/{job}/", base)
        self._lock = threading.Lock()
        self._bell: str | None = None  # rings (the root World's job id)

    @property
    def job(self) -> str:
        """The job id that scopes this view's keys."""
        return self._job

    @property
    def base(self):
        """The torch store under this view (not owned)."""
        return self._base

    def clone_private(self) -> "Store":
        """The same job's view over a connection of its own, for a thread that must never
        wait behind another thread's blocking ``get`` (the heartbeat). A base store that
        cannot be cloned (not a TCPStore) is shared instead."""
        clone = getattr(self._base, "clone", None)
        try:
            base = clone() if clone is not None else self._base
        except (RuntimeError, OSError):
            base = self._base
        twin = Store.__new__(Store)
        twin._init(base, self._job, self.timeout)
        twin._bell = self._bell
        return twin

    def rings(self, root_job: str) -> None:
        """Makes this view, a sub-world's, ring its root World's bell when a record it posts
        wins: the sub-world's watches in every process are kept by one thread per process
        that waits on the bell, not one per sub-world (``abort_watch.Doorbell``)."""
        self._bell = root_job

    def move_to(self, base) -> None:
        """Moves this view onto ``base``, another client of the same store: a sub-world that
        met over a connection of its own (whose blocking waits hold up nobody) goes on over
        a client shared with others once it makes only requests that answer at once."""
        from torch.distributed import PrefixStore

        with self._lock:
            self._base = base
            self._store = PrefixStore(f"gradsync/{self._job}/", base)

    def set(self, key: str, value: str | bytes) -> None:
        _count("set")
        with self._lock:
            # torch's stub says str; its binding takes bytes too (the compressed table).
            self._store.set(key, value)  # type: ignore[arg-type]

    def get(self, key: str, timeout: float | None = None) -> bytes:
        _count("get")
        with self._lock:
            self._store.set_timeout(timedelta(seconds=timeout or self.timeout))
            try:
                value = self._store.get(key)
                _served("get", (value,))
                return value
            except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError)
                raise GradsyncTimeoutError(f"waiting for '{key}' in the rendezvous store: "
                                           f"{exc}") from None
            finally:
                self._store.set_timeout(timedelta(seconds=self.timeout))

    def get_many(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, in one request (``multi_get``); waits until all
        are set, for at most ``timeout`` (default: the store's)."""
        multi_get = getattr(self._store, "multi_get", None)
        if multi_get is None:  # a torch without it: one request per key
            return [self.get(key, timeout) for key in keys]
        _count("multi_get")
        with self._lock:
            self._store.set_timeout(timedelta(seconds=timeout or self.timeout))
            try:
                values = multi_get(keys)
                _served("multi_get", values)
                return values
            except RuntimeError as exc:
                raise GradsyncTimeoutError(f"waiting for {len(keys)} keys ({keys[0]} ..) in "
                                           f"the rendezvous store: {exc}") from None
            finally:
                self._store.set_timeout(timedelta(seconds=self.timeout))

    def gather_table(self, name: str, rank: int, size: int, entry: str,
                     timeout: float | None = None) -> list[str]:
        """Every rank's ``entry``, in rank order, in O(1) requests per rank.

        Each other rank sets its entry and counts itself in; the last to arrive says so, and
        rank 0 then reads all the entries in one ``multi_get`` and publishes them as one key,
        which each other rank reads: 3 requests per rank (rank 0: 3 in all), where each
        rank reading every entry would be ``size``. Rank 0 waits through ``get`` (which a
        subclass may make abortable), never inside the ``multi_get``.
        Collective: every rank of the job calls it with the same ``name`` (used once).
        The table travels as the entries joined by newlines, compressed (module docstring:
        about 13 bytes a rank for the World's entries, 40 uncompressed), so an entry must
        hold no newline.
        """
        if "\n" in entry:
            raise ValueError("a table entry must not contain a newline")
        if rank != 0:
            self.set(f"{name}/{rank}", entry)
            if self.add(f"{name}/arrived", 1) == size - 1:
                self.set(f"{name}/all", "1")
            return zlib.decompress(self.get(name, timeout)).decode().split("\n")
        table = [entry]
        if size > 1:
            self.get(f"{name}/all", timeout)
            table += [v.decode() for v in self.get_many([f"{name}/{r}" for r in range(1, size)],
                                                        timeout)]
        self.set(name, zlib.compress("\n".join(table).encode()))
        return table

    def add(self, key: str, amount: int) -> int:
        _count("add")
        with self._lock:
            return self._store.add(key, amount)

    def check(self, key: str) -> bool:
        _count("check")
        with self._lock:
            return self._store.check([key])

    def shared_secret(self, rank: int) -> bytes:
        """The job secret, made by rank 0, when no launcher provided one."""
        if rank == 0:
            self.set("secret", secrets.token_hex(32))
        return self.read_secret()

    def read_secret(self) -> bytes:
        """The job secret that rank 0 made (``shared_secret``); waits for it."""
        return bytes.fromhex(self.get("secret").decode())

    def barrier(self, name: str, size: int, timeout: float) -> None:
        """Returns once all ``size`` ranks reached barrier ``name`` (each name used once)."""
        arrived = self.add(f"barrier/{name}", 1)
        if arrived == size:
            self.set(f"barrier/{name}/done", "1")
        self.get(f"barrier/{name}/done", timeout)

    def post_abort(self, record: dict) -> dict:
        """Records this failure unless another rank's came first; returns the winning one."""
        text = json.dumps(record)
        _count("compare_set")
        with self._lock:
            current = self._store.compare_set(_ABORT, "", text)
        if self._bell is not None and current == text.encode():
            self._ring(self._bell)
        return json.loads(current)

    def _ring(self, root_job: str) -> None:
        """Rings the root World's bell (``root_job``'s) with this job's id (two requests per
        record posted). A failed ring is only late: each bell looks at every record it keeps
        at its re-arm."""
        root = Store.over(self._base, root_job, self.timeout)
        try:
            root.set(bell_key(root.add(BELL_COUNT, 1)), self._job)
        except (RuntimeError, OSError):
            pass

    def read_abort(self) -> dict | None:
        """The job's abort record, or None. Raises PeerLostError if the store is gone."""
        try:
            if not self.check(_ABORT):
                return None
            return json.loads(self.get(_ABORT))
        except (RuntimeError, OSError) as exc:
            raise PeerLostError(f"lost the rendezvous store: {exc} (its host, usually rank 0 "
                                f"or the launcher, has probably died)") from None

    def wait_keys(self, keys: list[str], timeout: float) -> dict[str, bytes]:
        """Gets whichever of ``keys`` appear within ``timeout``; missing ones are left out."""
        found: dict[str, bytes] = {}
        end = time.monotonic() + timeout
        while True:
            for key in keys:
                if key not in found and self.check(key):
                    found[key] = self.get(key)
            if len(found) == len(keys) or time.monotonic() >= end:
                return found
            time.sleep(0.02)
