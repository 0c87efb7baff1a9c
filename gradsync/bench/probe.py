"""``gradsync probe``: measure each tier's latency and bandwidth, write a topology file.

    gradsync probe -np 4 [-H h0:2,h1:2] --out topo.json

Every rank runs this module (relaunched through ``gradsync run``). For each tier that the
job spans (local, host, group), the first pair of ranks that the tier separates measures:

    latency     half the median round trip of an 8-byte message (ping-pong)
    bandwidth   bytes / time of a one-way stream of 16 MiB messages, acknowledged once

over gradsync's own transports (shared-memory rings inside a host, TCP between hosts), so
the figures are what the collectives will see. Every rank also times folding 16 MiB of
float32 into another (``reduce_bandwidth``). Rank 0 writes the file (with the groups of a
``GRADSYNC_TOPOLOGY`` file, if one was given) and prints it; ``gradsync plan --topology`` and
``GRADSYNC_TOPOLOGY`` read it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

__all__ = ["parser", "run", "main"]

_STREAM = 16 << 20


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gradsync-topology.json", help="file to write (rank 0)")
    p.add_argument("--pings", type=int, default=200, help="round trips for the latency")
    p.add_argument("--streams", type=int, default=8, help="16 MiB messages for the bandwidth")
    return p


def _pair_for(topo, tier: str) -> "tuple[int, int] | None":
    for a in range(topo.size):
        for b in range(a + 1, topo.size):
            if topo.tier(a, b) == tier:
                return a, b
    return None


def _measure(comm, a: int, b: int, pings: int, streams: int) -> "tuple[float, float]":
    """Latency and bandwidth between ranks ``a`` and ``b`` (called on both)."""
    me_first = comm.rank == a
    peer = b if me_first else a
    small = np.zeros(8, dtype=np.uint8)
    trips = []
    for _ in range(pings):
        start = time.perf_counter()
        if me_first:
            comm.exchange(sends=[(peer, small)])
            comm.exchange(recvs=[(peer, small)])
        else:
            comm.exchange(recvs=[(peer, small)])
            comm.exchange(sends=[(peer, small)])
        trips.append(time.perf_counter() - start)
    big = np.ones(_STREAM, dtype=np.uint8)
    # A warm-up message, acknowledged, so that the clock starts with empty socket buffers.
    comm.exchange(sends=[(peer, big)]) if me_first else comm.exchange(recvs=[(peer, big)])
    comm.exchange(recvs=[(peer, small)]) if me_first else comm.exchange(sends=[(peer, small)])
    start = time.perf_counter()
    for _ in range(streams):
        comm.exchange(sends=[(peer, big)]) if me_first else comm.exchange(recvs=[(peer, big)])
    comm.exchange(recvs=[(peer, small)]) if me_first else comm.exchange(sends=[(peer, small)])
    elapsed = time.perf_counter() - start
    return statistics.median(trips) / 2, streams * _STREAM / elapsed


def _reduce_bandwidth() -> float:
    dst, src = np.ones(_STREAM // 4, dtype=np.float32), np.ones(_STREAM // 4, dtype=np.float32)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        np.add(dst, src, out=dst)
        times.append(time.perf_counter() - start)
    return dst.nbytes / statistics.median(times)


def run(args) -> dict:
    import gradsync as gs
    from gradsync import job
    from gradsync.cluster.topology import TIERS, Tier, Topology, to_dict

    gs.init()
    world = job.world()
    topo: Topology = world.topology
    tiers = dict(topo.tiers)
    measured = {}
    for tier in TIERS:
        pair = _pair_for(topo, tier)
        if pair is None:
            continue
        world.comm.begin(f"probe tier {tier} between ranks {pair}")
        if world.rank in pair:
            latency, bandwidth = _measure(world.comm, *pair, args.pings, args.streams)
            measured[tier] = (pair, latency, bandwidth)
        result = gs.broadcast_object(measured.get(tier), root_rank=pair[0], name=f"probe.{tier}")
        measured[tier] = result
        tiers[tier] = Tier(bandwidth=result[2], latency=result[1])
    reduce_bw = float(np.median(gs.allgather_object(_reduce_bandwidth(), name="probe.reduce")))
    probed = Topology(topo.hosts, topo.host_of, topo.groups, topo.group_of, tiers, reduce_bw,
                      topo.declared | frozenset(measured))
    if world.rank == 0:
        out = to_dict(probed)
        out["measured"] = {t: {"ranks": list(m[0]), "latency_us": round(m[1] * 1e6, 2),
                               "bandwidth_GBps": round(m[2] / 1e9, 4)}
                           for t, m in measured.items()}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out["measured"], indent=1), flush=True)
        print(f"wrote {args.out}", flush=True)
    gs.barrier()  # the file exists before any rank returns (a next init may read it)
    gs.shutdown()
    return to_dict(probed)


def main(argv: "list[str] | None" = None) -> int:
    run(parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
