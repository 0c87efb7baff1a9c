"""The world: this process's view of the job once ``init()`` has connected it.

``World.connect`` runs the rendezvous, derives the local and cross ranks from the host names,
gives every other rank a pair (shared memory to ranks on the same host, TCP to the others,
unless ``transport`` forces one) and, when every rank is on one host, sets up the host's
shared-memory allreduce group.

What it costs grows with the job, so it is kept to what the algorithms use:

- **The address table in O(N) store requests.** Every rank needs every rank's host (topology,
  local and cross ranks) and pid (error messages), but only the addresses of the peers it
  talks to. Each rank posts one entry; rank 0 gathers them in one request and publishes the
  table, compressed, as one key that every rank reads (``Store.gather_table``): about 3
  requests per rank, and about 12·N bytes read per rank.
- **TCP connections on demand.** A TCP pair holds no socket until an exchange first uses it;
  then one end dials the other's listener (``transport/tcp.py`` says how both ends agree on
  one connection). After an allreduce a rank holds the connections its algorithm used: 2 for
  a ring, log2 N for recursive doubling, not N - 1.
- **One listener per process.** A sub-world (``subworld``: the Horovod API's process sets,
  the torch backend's point-to-point lanes) takes its members' addresses from the World it
  is carved from and accepts on that World's listener, as a route of its own job id
  (``tcp.Route``): it adds no listener and no store requests beyond its barrier. The
  listener closes with the root World that made it; an elastic generation is a new root
  World with a new listener and job id, so generations never see each other's connections.

It also owns failure handling: the first rank to see a distributed error posts it as the job's
abort record; every rank that waits polls the record (``on_idle``) and raises the same error,
so one failure ends the collective on every rank within about ``abort_poll_interval``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .. import _native
from ..cluster import topology
from ..cluster.launch_env import LaunchEnv
from ..cluster.rendezvous import Store
from ..collectives import hierarchical, planner
from ..config import Config
from ..errors import (AuthenticationError, CollectiveMismatchError, ConfigError, GradsyncError,
                      GradsyncTimeoutError, PeerLostError, ProtocolError)
from ..flight_recorder import recorder
from ..liveness import stall
from ..transport import frame, tcp
from ..transport.base import Pair, different_collective
from ..transport.comm import Comm

if TYPE_CHECKING:
    import numpy as np

    from ..liveness.heartbeat import Heartbeat
    from ..transport.host_segment import ShmGroup

__all__ = ["World", "PeerInfo", "listen_addr"]

log = logging.getLogger("gradsync")

_ERRORS = {cls.__name__: cls for cls in
           (PeerLostError, CollectiveMismatchError, GradsyncTimeoutError, AuthenticationError,
            ProtocolError, GradsyncError)}
_MISMATCH_GRACE = 2.0
STORE_LOSS_GRACE = 5.0
"""Seconds a rank waiting in a collective goes on waiting after it found the rendezvous
store gone, before it raises that loss (``World.on_idle``). A store hosted by rank 0 (a plain
``env://`` start, ``MASTER_ADDR`` at rank 0) goes when rank 0 ends, and rank 0 may end as
soon as its own part of the last collective is done, while another rank still receives its
last bytes from live peers (a shaped link retransmitting: measured on 4 emulated hosts at 100
Mbit/s, the run ended with a PeerLostError on two ranks). The collective's data and the
heartbeat still tell a lost peer within their own bounds; the store only carries the abort
record, which is unreadable from then on."""
_generations = itertools.count()


@dataclass(frozen=True)
class PeerInfo:
    rank: int
    host: str
    addr: str
    port: int
    pid: int


def firewall_hint(host: str) -> str:
    """What to open when a rank cannot reach a peer on ``host``: its listening port is one
    the kernel picks from the ephemeral range, so the whole range must be open."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = ports.read().split()
    except (OSError, ValueError):
        low, high = "32768", "60999"  # Linux's default range
    return (f"is a firewall between this host and {host}? ranks listen on TCP ports "
            f"{low}-{high} (the kernel's ephemeral range): open them between the job's hosts, "
            f"or choose the interface the ranks use (GRADSYNC_ADDR, gradsync run "
            f"--network-interface)")


def interface_address(name: str) -> str:
    """The IPv4 address of this host's network interface ``name`` (e.g. ``eth1``).

    Raises:
        ConfigError: no such interface, or it has no IPv4 address.
    """
    import fcntl  # Linux only, as gradsync; imported here to keep the module importable
    import struct

    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ConfigError(f"network interface {name!r} does not exist on this host "
                          f"(it has {', '.join(names)})")
    siocgifaddr = 0x8915  # <linux/sockios.h>: an interface's address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
        except OSError:
            raise ConfigError(f"network interface {name!r} has no IPv4 address") from None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: the name (16), then a sockaddr_in


def listen_addr(config: Config, env: LaunchEnv) -> str:
    """The address this rank listens on: ``config.addr``, else one the other hosts reach."""
    if config.addr:
        # An interface name (gradsync run --network-interface, HOROVOD_GLOO_IFACE) stands for
        # its address on each host: one setting serves every host of the job.
        names = [n for _, n in socket.if_nameindex()]
        if config.addr in names:
            return interface_address(config.addr)
        try:
            socket.getaddrinfo(config.addr, None)
        except OSError:
            raise ConfigError(f"GRADSYNC_ADDR={config.addr!r} is neither an address of this "
                              f"host nor one of its network interfaces ({', '.join(names)})"
                              ) from None
        return config.addr
    if env.store_addr in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    # The address of the interface that routes to the store is one the other hosts can reach.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((env.store_addr, env.store_port or 1))
        return probe.getsockname()[0]
    except OSError:
        return "0.0.0.0"
    finally:
        probe.close()


def _dial(peer: PeerInfo, env: LaunchEnv, secret: bytes, timeout: float, alive) -> \
        "socket.socket | None":
    """Connects to ``peer``'s listener for a pair made on demand (``tcp.Route.open``): the
    socket, or None when the peer answered that it is dialing this rank itself."""
    try:
        return tcp.connect(peer.addr, peer.port, env.rank, peer.rank, secret, env.job_id,
                           time.monotonic() + timeout, alive, crossing=True)
    except GradsyncTimeoutError as exc:
        raise GradsyncTimeoutError(f"{exc}; {firewall_hint(peer.host)}") from None
    except PeerLostError as exc:
        raise PeerLostError(f"{exc} [rank {peer.rank} on host {peer.host}, pid {peer.pid}]",
                            peer=peer.rank) from None


class World:
    """Identity, connections and failure handling of one initialised process."""

    def __init__(self, config: Config, env: LaunchEnv, store: Store, peers: list[PeerInfo],
                 comm: Comm, shm_group: "ShmGroup | None", listener: tcp.Listener,
                 route: "tcp.Route | None" = None, owns_listener: bool = True):
        self.config, self.env, self.store = config, env, store
        self.rank, self.size = env.rank, env.size
        self.peers = peers
        self.comm = comm
        self.shm_group = shm_group
        """The host's shared segment (``transport/host_segment.py``) when every rank of this
        World is on this host, else None: a transport, like ``comm``. Only the transport, the
        set-up that opens it, this class and ``operations`` (which runs the ``shm``
        algorithm on it) reach it (tests/test_structure.py); the front doors ask the
        questions of "The host's segment" below."""
        self.shares_host = shm_group is not None
        """Whether every rank of this World shares this host's segment: small calls have the
        segment's roads and buffers can be shared (``small_road``, ``shared_buffer``)."""
        self.subworlds: "weakref.WeakSet[World]" = weakref.WeakSet()
        """The sub-worlds made from this one while they live (the Horovod API's process sets
        run on them): ``liveness/traffic.py`` counts their bytes with this World's."""
        self.listener = listener
        """The process's listener: this World's own, or for a sub-world its root World's."""
        self.route = route
        self._owns_listener = owns_listener
        hosts = list(dict.fromkeys(p.host for p in peers))  # in order of first rank
        mine = [p.rank for p in peers if p.host == env.hostname]
        self.local_rank, self.local_size = mine.index(self.rank), len(mine)
        same_local = [h for h in hosts
                      if sum(1 for p in peers if p.host == h) > self.local_rank]
        self.cross_rank, self.cross_size = same_local.index(env.hostname), len(same_local)
        self.local_ranks = mine
        self.single_host = len(hosts) == 1
        spec = topology.load(config.topology) if config.topology else None
        self.topology = topology.Topology.from_hosts([p.host for p in peers], spec)
        self.ring_order = self.topology.ring_order()
        self.levels = hierarchical.levels_of(self.topology)
        # Hierarchical allgather and broadcast pay off when some host has several ranks.
        self.hierarchical = not self.single_host and len(hosts) < self.size
        # Decided once per size, not per call (``operations.allreduce``).
        self.plans = planner.Plans(self.size, config, shm_group is not None, self.topology,
                                   announce=self.rank == 0)
        self.descriptions: dict[tuple, tuple[str, int]] = {}
        self.failure: GradsyncError | None = None
        self.heartbeat: Heartbeat | None = None  # once connect() has started it
        self.root: tuple[str, list[int]] = (env.job_id, list(range(self.size)))
        """The job id of the World at the root of this one's tree of sub-worlds, and the
        rank there of each rank here (this World's own, for a World that is no sub-world)."""
        self.generation = -1
        """The elastic generation this World is (``elastic.worker.join`` sets it); -1
        outside elastic jobs."""
        self._next_poll = 0.0
        self._stall_warned = -1
        self._store_lost: float | None = None  # when a wait first found the store gone
        comm.on_idle = self.on_idle

    # ------------------------------------------------------------------ set-up
    @classmethod
    def connect(cls, config: Config, env: LaunchEnv, store: Store | None = None,
                root: "tuple[str, list[int]] | None" = None,
                members: "tuple[World, list[int]] | None" = None) -> "World":
        """Joins this rank to ``env``'s job: a pair to every other rank, TCP ones on demand.

        Args:
            config: the settings.
            env: this rank's identity; ``env.job_id`` names the job's store keys and segments.
            store: the rendezvous, already scoped to this job (``Store.over``); None makes one
                from ``env`` (the TCPStore the launcher described). A caller that passes one
                gives every World it connects its own ``env.job_id``.
            root: for a sub-world (``subworld``), the job id of the World at the root of its
                tree and the root rank of each of its ranks. The root World's abort record
                is the one the launcher watches.
            members: for a sub-world, the World it is carved from and the ranks there of
                its ranks: their addresses, hosts and pids and this process's listener are
                that World's, so the sub-world exchanges no addresses and opens no listener.
        """
        if env.size > 1 and (config.heartbeat_timeout or (
                config.shm_fast and config.transport != "tcp"
                and env.local_size in (None, env.size))):
            # The host's ShmGroup will want the compiled kernel, the heartbeat its beater
            # (beater.py): a first use on this machine compiles it here, before the connect
            # deadline starts (the job's other ranks on this host wait on the build's lock,
            # not on a deadline), never inside it.
            _native.load("_shmfast")
        if store is None:
            # A process that shuts down and initialises again joins a new incarnation of the
            # job: its store keys, handshakes and segments must not meet the previous one's.
            # Every rank counts its own init() calls, and all ranks make the same number.
            generation = next(_generations)
            if generation:
                env = dataclasses.replace(env, job_id=f"{env.job_id}.{generation}")
            store = Store(env.store_addr, env.store_port, env.store_is_server, env.job_id,
                          config.connect_timeout, env.size)
        deadline = time.monotonic() + config.connect_timeout
        try:
            return cls._connect(config, env, store, deadline, root, members)
        except GradsyncError as exc:
            # Tell the others, who would otherwise wait for this rank until their deadline.
            try:
                winner = store.post_abort({"kind": type(exc).__name__, "rank": env.rank,
                                           "message": f"init failed: {exc}",
                                           "peer": getattr(exc, "peer", None)})
            except (GradsyncError, RuntimeError, OSError):
                raise exc from None
            if winner["rank"] != env.rank:
                cls_ = _ERRORS.get(winner["kind"], GradsyncError)
                raise cls_(f"rank {winner['rank']} reported: {winner['message']}") from exc
            raise

    @classmethod
    def _connect(cls, config: Config, env: LaunchEnv, store: Store, deadline: float,
                 root: "tuple[str, list[int]] | None",
                 members: "tuple[World, list[int]] | None") -> "World":
        if members is None:
            secret = env.secret or store.shared_secret(env.rank)
            addr = listen_addr(config, env)
            # Listening before the entry is posted: a peer that reads it may dial at once.
            listener = tcp.Listener(addr, env.rank, secret, None)
            try:
                entry = json.dumps([env.hostname, addr, listener.port, os.getpid()],
                                   separators=(",", ":"))
                table = store.gather_table("peers", env.rank, env.size, entry,
                                           max(1.0, deadline - time.monotonic()))
                peers = [PeerInfo(r, *json.loads(e)) for r, e in enumerate(table)]
                return cls._join(config, env, store, deadline, root, peers, listener, True)
            except BaseException:
                listener.close()
                raise
        parent, ranks = members
        peers = [dataclasses.replace(parent.peers[g], rank=i) for i, g in enumerate(ranks)]
        return cls._join(config, env, store, deadline, root, peers, parent.listener, False)

    @classmethod
    def _join(cls, config: Config, env: LaunchEnv, store: Store, deadline: float,
              root: "tuple[str, list[int]] | None", peers: list[PeerInfo],
              listener: tcp.Listener, owns_listener: bool) -> "World":
        """The rest of ``_connect`` once the peers are known: pairs, shared memory, barrier."""
        local = {p.rank for p in peers if p.host == env.hostname} - {env.rank}
        if config.transport == "shm" and len(local) != env.size - 1:
            raise ConfigError("GRADSYNC_TRANSPORT=shm needs every rank on this host, but ranks "
                              f"{sorted(p.rank for p in peers if p.host != env.hostname)} are "
                              "on other hosts")
        from . import _shm_setup

        # The platform is the host's, so every rank of a host takes the same answer.
        use_shm = (set() if config.transport == "tcp" or (local and not _shm_setup.usable(config))
                   else local)
        # Only ranks on different hosts (all of them, with transport=tcp) get a TCP pair,
        # connected when an exchange first uses it. The route goes up before the barrier:
        # no peer dials before every member has passed it.
        tcp_peers = set(range(env.size)) - use_shm - {env.rank}
        route = listener.route(env.job_id, env.rank, tcp_peers)
        try:
            comm: Comm | None = None

            def alive() -> None:  # while dialing: the abort record, as any wait polls it
                # A pair dials on its first exchange, which comes after ``comm`` is made below.
                assert comm is not None
                comm.on_idle(0.0)

            pairs: dict[int, Pair] = {
                r: tcp.TcpPair(r, None, config.tcp_splice, functools.partial(
                    route.open, r, functools.partial(_dial, peers[r], env, listener.secret,
                                                     config.connect_timeout, alive)))
                for r in sorted(tcp_peers)}
            shm_group = None
            if use_shm:
                pairs, shm_group = _shm_setup.connect(config, env, store, peers, pairs, use_shm,
                                                      deadline)
            comm = Comm(env.rank, env.size, pairs, config.timeout,
                        segment_trials=None if config.tune_segments else 0)
            store.barrier("connected", env.size, max(1.0, deadline - time.monotonic()))
        except BaseException:
            route.close()
            raise
        world = cls(config, env, store, peers, comm, shm_group, listener, route, owns_listener)
        if root is not None:
            world.root = root
        stall.serve(world, owns_listener)  # the ranks' stall reports may ask this process
        if config.heartbeat_timeout and env.size > 1:
            from ..liveness.heartbeat import Heartbeat
            world.heartbeat = Heartbeat(
                store, env.rank, env.size, config.heartbeat_interval, config.heartbeat_timeout,
                lambda r: f"rank {r} on host {peers[r].host} (pid {peers[r].pid})",
                root, secret=listener.secret, addr=peers[env.rank].addr).start()
        # Once per job (and per elastic generation) at INFO: who this process is, so that a
        # user can attach a profiler to a rank, and how it reaches its peers. A sub-world (a
        # process set, a torch group's lane) says it at DEBUG: its ranks already said it.
        log.log(logging.INFO if owns_listener else logging.DEBUG,
                "rank %d of %d on host %s (pid %d, local rank %d of %d): worker; peers: %d "
                "over shared memory%s, %d over tcp (connected on first use)", env.rank,
                env.size, env.hostname, os.getpid(), world.local_rank, world.local_size,
                len(use_shm), " (and the host's shared-memory allreduce group)"
                if shm_group is not None else "", len(tcp_peers))
        return world

    def subworld(self, ranks, name: str, base=None) -> "World":
        """A World of its own over ``ranks`` (global ranks of this World, this rank among them).

        Collective over ``ranks`` only: each of them calls it with the same ranks and name,
        the others need not. The sub-world has its own connections (shared memory inside a
        host, TCP between hosts), sequence numbers, progress and abort record, so its
        collectives never interleave with this World's or another sub-world's on a
        connection, and it can run at the same time as they do. Its rank ``i`` is
        ``ranks[i]``; ``name`` must be unique among the sub-worlds of this World. It takes
        its members' addresses from this World and accepts on this process's listener
        (a route of its own job id), so it costs no listener and, beyond its barrier, no
        store requests; its TCP connections, like this World's, are made on first use.

        ``base`` is the torch store to meet over (default: this World's). Sub-worlds that
        connect at the same time from several threads need one each (``store.clone()``): a
        blocking wait on a shared TCPStore client holds its only connection.
        """
        ranks = list(ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not among {ranks}")
        env = dataclasses.replace(
            self.env, rank=ranks.index(self.rank), size=len(ranks), local_rank=None,
            local_size=None, cross_rank=None, cross_size=None, servers=0,
            secret=self.listener.secret, job_id=f"{self.env.job_id}/{name}")
        store = self.store.child(self.store.base if base is None else base, env.job_id,
                                 self.config.connect_timeout)
        root_job, root_ranks = self.root
        store.rings(root_job)  # its records wake the root's bell (abort_watch.Doorbell)
        sub = World.connect(self.config, env, store,
                            root=(root_job, [root_ranks[r] for r in ranks]),
                            members=(self, ranks))
        self.subworlds.add(sub)
        return sub

    # ------------------------------------------------------------------ the host's segment
    # The questions the front doors ask of the host's shared segment, answered here once, so
    # that none of them holds the segment (tests/test_structure.py).

    def small_road(self, op, dtype: "np.dtype",
                   nbytes: int) -> "tuple[Callable[..., None], int] | None":
        """The segment's compiled one-step allreduce for a call of ``nbytes`` of ``dtype``
        reduced by ``op`` (a ``ReduceOp``), and its kernel code; None where that call cannot
        take it (no segment, 0 bytes or more than its one-step road, an op or dtype the
        compiled road lacks, or the road not built). The function is bound once here, for a
        prepared allreduce (``pipeline/operations.Prepared``) to call per call as
        ``run(flat, code, divisor, deadline, on_idle, signature)``."""
        group = self.shm_group
        if group is None or not 0 < nbytes <= group.small_bytes:
            return None
        code = group.fast_code(op, dtype)
        return None if code is None else (group.allreduce_express, code)

    def small_run(self, description: str, signature: int, code: int,
                  divisor: int) -> "Callable[[np.ndarray], None] | None":
        """A prepared small allreduce's run in one compiled call (the Comm's begin with
        ``description`` and ``signature``, then the segment's ``allreduce_express`` with the
        kernel ``code`` from ``small_road``: ``SmallRoad.compiled_run``), or None where the
        segment's compiled road is not built."""
        group = self.shm_group
        if group is None:
            return None
        return group.compiled_run(self.comm, description, signature, code, divisor,
                                  self.on_group_idle)

    def host_allreduce(self, flat: "np.ndarray", reducer, finish, op, divisor: int,
                       trunc: bool) -> None:
        """Reduces ``flat`` in place over the host's segment (the planner's ``shm``
        algorithm, taken only where the whole World shares it): ``reducer`` folds two blocks,
        ``finish`` (or None) scales each finished block; ``op`` (or None), ``divisor`` and
        ``trunc`` let the compiled road divide an Average itself. Waits up to the
        ``timeout`` setting, watching the peers' liveness while it does."""
        assert self.shm_group is not None, "the shm algorithm needs the host's segment"
        self.shm_group.allreduce(flat, reducer, time.monotonic() + self.config.timeout,
                                 self.on_group_idle, self.comm.signature, finish, op,
                                 divisor, trunc)

    def host_broadcast(self, data: "np.ndarray", root: int) -> None:
        """Copies root's bytes (``data``, uint8) into every rank's over the host's segment."""
        assert self.shm_group is not None, "a broadcast over the segment needs one"
        self.shm_group.broadcast(data, root, time.monotonic() + self.config.timeout,
                                 self.on_group_idle, self.comm.signature)

    def host_barrier(self) -> None:
        """Returns once every rank of the World, all on this host, has entered it."""
        assert self.shm_group is not None, "a barrier over the segment needs one"
        self.shm_group.barrier(time.monotonic() + self.config.timeout, self.on_group_idle,
                               self.comm.signature)

    def shared_above(self) -> "int | None":
        """The bytes above which an allreduce's buffer is worth sharing with the host's other
        ranks (``shared_buffer``): the segment's one-step road takes smaller ones faster.
        None without a segment."""
        return None if self.shm_group is None else self.shm_group.small_bytes

    def shared_buffer(self, nbytes: int) -> "np.ndarray | None":
        """``nbytes`` of zeros (uint8) that the host's other ranks map, for allreduces without
        the segment's copies (``ShmGroup.shared_buffer``); None without a segment or where
        none can be made. Give it back with ``release_shared``."""
        group = self.shm_group
        return None if group is None else group.shared_buffer(nbytes)

    def adopt_above(self) -> "int | None":
        """The bytes from which an allreduce agrees among the ranks whether it runs on their
        shared buffers (``adopt_shared``: a buffer adopted on one rank only meets the others
        on the segment's slots). None without a segment."""
        return None if self.shm_group is None else self.shm_group.slot_bytes

    def adopt_shared(self, address: int, fd: int, nbytes: int) -> bool:
        """Takes the ``nbytes`` at ``address``, mapped from the shared file open as ``fd``
        (torch's ``UntypedStorage._share_fd_cpu_``), as a shared buffer that the caller
        keeps owning (``ShmGroup.adopt``); whether it is one. Allreduces of at least
        ``adopt_above`` bytes that start there run without the segment's copies where
        every rank passes such a buffer."""
        group = self.shm_group
        return group is not None and group.adopt(address, fd, nbytes)

    def release_shared(self, address: int) -> None:
        """Forgets the shared buffer whose first byte is at ``address`` (``shared_buffer``)."""
        if self.shm_group is not None:
            self.shm_group.release(address)

    def release_shared_with(self, owner: object, address: int) -> None:
        """Forgets the shared buffer at ``address`` once ``owner`` (what views it) is gone. The
        finalizer holds the segment, not this World, which may be collected before it."""
        if self.shm_group is not None:
            weakref.finalize(owner, self.shm_group.release, address)

    def is_shared(self, data: "np.ndarray") -> bool:
        """Whether an allreduce of ``data`` runs on shared buffers (``shared_buffer``)."""
        group = self.shm_group
        return group is not None and group.is_shared(data)

    def host_traffic(self) -> "tuple[int, int] | None":
        """The segment's byte count for ``liveness/traffic.py``: a key the same in every
        World that holds this segment, and the bytes this rank moved through it so far
        (``ShmGroup.moved``). None without a segment."""
        group = self.shm_group
        return None if group is None else (id(group), group.moved)

    # ------------------------------------------------------------------ failures
    def on_idle(self, waited: float) -> None:
        """Called by every wait while nothing moves: looks at the abort record (through the
        heartbeat's abort watch, which holds it in memory: no store request), raises a lost
        peer that the heartbeat found, warns on stalls."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.config.abort_poll_interval
        beat = self.heartbeat
        if beat is not None and beat.won and self.failure is None:
            beat.check()  # the job's record is this rank's own post: no store request
        # The record first: it is the job's first failure, which every rank must raise (a
        # neighbour that exits after a mismatch closes its heartbeat link too).
        try:
            record = (beat if beat is not None else self.store).read_abort()
        except PeerLostError:
            # The store's host is gone: raised once that has lasted STORE_LOSS_GRACE, so
            # that a collective whose data still arrives from live peers can finish (a
            # store's host that ended cleanly before this rank's last bytes came).
            if self._store_lost is None:
                self._store_lost = now
            if now - self._store_lost >= STORE_LOSS_GRACE:
                raise
            record = None
        if record is not None and record["rank"] != self.rank:
            raise self._from_record(record)
        if beat is not None and self.failure is None:
            beat.check()
        if waited > self.config.stall_warning and self._stall_warned != self.comm.seq:
            self._stall_warned = self.comm.seq
            log.warning("rank %d has waited %.0fs in collective #%d %s; are all ranks issuing "
                        "it?", self.rank, waited, self.comm.seq, self.comm.description)
        stall.watch(self, waited)

    def on_group_idle(self, waited: float) -> None:
        """``on_idle`` for waits in the host's shared-memory group, which read no frames: also
        looks at the frames waiting on this rank's pairs. A peer whose next frame belongs to
        this collective but carries another signature issued a collective that goes over
        pairs (a ring's reduce-scatter, say) where this rank issued one of the group's (a
        barrier): each would otherwise wait for the other until the timeout."""
        polled = self._next_poll
        self.on_idle(waited)
        comm = self.comm
        if self._next_poll == polled or not comm.signature:
            return  # only as often as the abort record; not with the check off
        for pair in comm.pairs.values():
            h = pair.peek_header()
            if (h is not None and h.kind == frame.Kind.DATA and h.seq == comm.seq
                    and h.signature != comm.signature):
                raise different_collective(pair.peer, h, comm.seq, comm.description,
                                           comm.signature)

    def fail(self, exc: GradsyncError) -> GradsyncError:
        """Records ``exc`` as the job's failure (unless another rank's came first).

        Returns the error this rank should raise: for a mismatch, one that lists what every
        rank issued.
        """
        if self.failure is not None:
            return self.failure
        # ``silent`` as the heartbeat's own post says it: this rank's collective may raise the
        # heartbeat's silent peer and post it before the heartbeat thread does, and without
        # it the launcher waits 5 s for the peer to exit instead of killing it at once.
        record = {"kind": type(exc).__name__, "rank": self.rank, "message": str(exc),
                  "peer": getattr(exc, "peer", None),
                  "silent": bool(getattr(exc, "silent", False))}
        try:
            if isinstance(exc, CollectiveMismatchError):
                self._post_description()
            # A record this process already holds is the winner: no store request (a store
            # stalled for seconds would hold up this rank's error; see heartbeat._arm).
            known = self.heartbeat.known_record() if self.heartbeat is not None else None
            winner = known if known is not None else self.store.post_abort(record)
        except (GradsyncError, RuntimeError, OSError):
            winner = record
        if winner["rank"] != self.rank:
            self.failure = self._from_record(winner)
        elif winner.get("message") != record["message"]:
            # This rank's heartbeat thread posted the job's first failure before this error
            # (often a peer that exited because of it): that failure is the one to raise.
            self.failure = self._from_record(winner)
        elif isinstance(exc, CollectiveMismatchError):
            self.failure = CollectiveMismatchError(self._mismatch_report())
        else:
            self.failure = exc
        recorder.on_failure(self, self.failure)  # the flight recorder's dump, once
        return self.failure

    def _from_record(self, record: dict) -> GradsyncError:
        if self.failure is not None:
            return self.failure
        cls = _ERRORS.get(record["kind"], GradsyncError)
        if cls is CollectiveMismatchError:
            self._post_description()
            error: GradsyncError = cls(self._mismatch_report())
        else:
            # rank -1: gradsync run itself (an elastic job's launcher re-formed the job)
            who = "the launcher" if record["rank"] < 0 else f"rank {record['rank']}"
            # This rank's own record (its heartbeat thread's) needs no "reported by".
            error = cls(record["message"] if record["rank"] == self.rank else
                        f"{who} reported: {record['message']}")
            if isinstance(error, PeerLostError):
                error.peer = record.get("peer")
                error.silent = bool(record.get("silent", False))
        self.failure = error
        recorder.on_failure(self, error)
        return error

    def _post_description(self) -> None:
        try:
            self._set_description()
        except (RuntimeError, OSError):
            pass

    def _set_description(self) -> None:
        self.store.set(f"issued/{self.rank}",
                       f"#{self.comm.seq} {self.comm.description}" if self.comm.seq else
                       "no collective yet")

    def _mismatch_report(self) -> str:
        keys = [f"issued/{r}" for r in range(self.size)]
        try:
            found = self.store.wait_keys(keys, _MISMATCH_GRACE)
        except (RuntimeError, OSError):  # the store's host left: report what this rank knows
            found = {f"issued/{self.rank}": f"#{self.comm.seq} {self.comm.description}".encode()}
        groups: dict[str, list[int]] = {}
        for r in range(self.size):
            what = found.get(f"issued/{r}", b"(not in a collective: did not answer)").decode()
            groups.setdefault(what, []).append(r)
        lines = [f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {what}"
                 for what, rs in sorted(groups.items(), key=lambda kv: kv[1])]
        return ("ranks issued different collectives (all ranks must issue the same "
                "collectives in the same order):\n  " + "\n  ".join(lines))

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.comm.close()
        if self.shm_group is not None:
            self.shm_group.close()
        if self.route is not None:
            self.route.close()
        if self._owns_listener:  # a root World: its sub-worlds' routes close with it
            self.listener.close()
