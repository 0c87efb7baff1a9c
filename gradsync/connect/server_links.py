"""A worker's connections to a job's serving ranks: parameter servers and data servers.

A job may set its last ranks apart to serve the workers (``gradsync.ps`` and ``gradsync.data``).
Both kinds of service meet their workers the same way, outside the training job's own
connections (their ranks are not members of the World):

1. each server opens a region endpoint (``transport/regions.py``) on its own job name,
   ``<job id>.<service>``, and publishes its address in the job's store under
   ``<service>/server/<index>`` (``publish``);
2. each worker opens an endpoint of its own on the same job name, reads every server's
   address from the store and connects to each (``connect_servers``): an authenticated
   connection per server, with the job's secret, which worker 0 wrote to the store in
   ``init()``.

What travels on those connections is each service's own protocol. This module knows the
store, the transport and the World's listen address, so ``transport/`` need not know the
World.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from ..cluster.rendezvous import Store
from ..errors import PeerLostError
from ..transport import regions
from .world import listen_addr

if TYPE_CHECKING:
    from ..transport.region_peer import RemotePeer

__all__ = ["open_store", "publish", "connect_servers", "unique_id"]


def open_store(config, env) -> Store:
    """The job's store, as this rank's launcher described it."""
    return Store(env.store_addr, env.store_port, env.store_is_server, env.job_id,
                 config.connect_timeout, env.size)


def publish(store: Store, service: str, index: int, endpoint: regions.Endpoint) -> None:
    """Makes server ``index`` of ``service`` reachable at ``endpoint`` (its workers wait for
    this key): its address, port and host name."""
    store.set(f"{service}/server/{index}", json.dumps({"addr": endpoint.addr,
                                                       "port": endpoint.port,
                                                       "host": endpoint.host,
                                                       "ident": endpoint.ident}))


def unique_id(store: Store, service: str) -> int:
    """An endpoint id for ``service`` that no other worker of the job has had (0, 1, ...)."""
    return store.add(f"{service}/worker-ids", 1) - 1


def connect_servers(config, env, store: Store, service: str, first_rank: int, count: int,
                    noun: str, ident: int | None = None,
                    lost: Callable[[int, BaseException], None] | None = None,
                    silence: float | None = None) -> tuple[regions.Endpoint, list]:
    """This worker's endpoint for ``service`` and a connection to each of its servers.

    Args:
        config, env: this rank's configuration and launch environment.
        store: the job's store (``open_store``).
        service: the service's name, ``"ps"`` or ``"data"``: the endpoint's job name and the
            store keys' prefix.
        first_rank, count: the servers are ranks ``first_rank .. first_rank + count - 1``.
        noun: how messages name a server, as ``"data server"``.
        ident: this worker's endpoint id (default: its rank; ``unique_id`` in an elastic
            job).
        lost: for a service that goes on without a lost server (the data servers): called
            with the server's index and the PeerLostError when a server that published its
            address is gone (its connection fails, or it refuses connections for
            ``tcp.REFUSED_GRACE`` seconds); its place in the list is then None. Without it,
            that error is raised.
        silence: seconds a server may leave a reply without a byte before it counts as lost
            (stopped or cut off: ``region_peer.RemotePeer``); None: the config's timeout.

    Returns:
        The endpoint and the connections (``region_peer.RemotePeer``), in server order. On
        any error both are closed before it is raised, so that the servers see this worker
        as gone.
    """
    secret = env.secret or store.read_secret()
    ident = env.rank if ident is None else ident
    endpoint = regions.Endpoint(ident, env.hostname, secret, f"{env.job_id}.{service}",
                                addr=listen_addr(config, env), timeout=config.timeout,
                                direct=config.transport != "tcp", label=f"worker {ident}")
    deadline = time.monotonic() + config.connect_timeout
    peers: list[RemotePeer | None] = []  # None: a lost server's place (``lost``)
    try:
        for index in range(count):
            info = json.loads(store.get(f"{service}/server/{index}", config.connect_timeout))
            # The server's own endpoint id (its launch rank), which a worker started with
            # another job size (an elastic job's new worker) could not compute.
            rank = info.get("ident", first_rank + index)
            try:
                # A published server listens: one that refuses connections has ended.
                peers.append(endpoint.connect(rank, info["addr"], info["port"], deadline,
                                              f"{noun} {index} (rank {rank})",
                                              listening=lost is not None,
                                              silence=silence))
            except PeerLostError as exc:
                if lost is None:
                    raise
                lost(index, exc)
                peers.append(None)
    except BaseException:
        for peer in peers:
            if peer is not None:
                peer.close()
        endpoint.close()
        raise
    return endpoint, peers
