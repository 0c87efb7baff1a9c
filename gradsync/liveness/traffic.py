"""Bytes per second per tier: what crossed the host's shared memory, what crossed the network.

A job's cost on a slow link is the bytes it puts there (DESIGN.md, "Bytes are the cost on slow
links"), so ``gradsync top`` shows, per rank, the bytes it moved through each *tier* of the
topology (``topology.py``): ``local`` (between ranks of one host: shared memory, or TCP
through the loopback where shared memory is off), ``host`` (between hosts of one group: the
NICs) and, where the topology names groups of hosts, ``group`` (between groups).

Nothing is counted on an operation's path for this. The transports keep counters anyway:

- a shared-memory pair's two rings have byte positions that only grow (``transport/shm.py``):
  what this rank wrote out and read in;
- a TCP pair's socket has the kernel's counts (``TCP_INFO``: bytes the peer acknowledged,
  bytes received), one system call to read;
- the host's shared segment (``transport/host_segment.py``) adds each collective's payload to
  one integer it owns (an allreduce's twice, in and out), the one write per operation here;
  ``World.host_traffic`` hands it over.

``Traffic.rates`` reads them all once an interval, on the pace publisher's thread
(``straggler_watch.py``), and returns bytes per second per tier since its last call: each
pair's count against its count then, so a pair made or closed in between adds what it
moved since (never a negative rate). The counts are the wire's, headers and heartbeats
included, where the MB/s of payload that top showed before counted the operations' inputs.

Worked example: ranks 0 and 1 on host a, rank 2 on host b, a ring allreduce of 4 MB. Rank 1
sends about 2·(N-1)/N·4 MB = 5.3 MB to its ring successor and receives as much from its
predecessor: if those are rank 0 (shared memory) and rank 2 (TCP), its ``local`` and
``host`` tiers each move about 5.3 MB per allreduce.
"""

from __future__ import annotations

import time

__all__ = ["Traffic"]


class Traffic:
    """One World's bytes per tier, read from its transports' counters.

    Args:
        world: the World (its pairs, its host's shared segment, its topology).
        clock: monotonic seconds (tests give their own).
    """

    def __init__(self, world, clock=time.monotonic):
        self._world, self._clock = world, clock
        topo = getattr(world, "topology", None)  # (a stand-in World of a test may have none)
        self.tiers = ["local", "host"] + (
            ["group"] if topo is not None and len(topo.groups) > 1 else [])
        """The tiers this job's topology has (``local`` and ``host`` always)."""
        self._last: dict = {}  # counter key -> its count at the last call
        self._at = clock()

    def counts(self) -> dict:
        """Each counter's bytes so far, by ``(tier, id of its pair or segment)``: this World's
        and its live sub-worlds' (``World.subworlds``: the Horovod API's process sets run on
        sub-worlds with pairs and a segment of their own); a pair or segment two Worlds
        share is counted once."""
        found = {}
        worlds, seen = [self._world], set()
        while worlds:
            world = worlds.pop()
            if id(world) in seen:
                continue
            seen.add(id(world))
            worlds.extend(list(getattr(world, "subworlds", ())))
            topo, me = getattr(world, "topology", None), world.rank
            if topo is None:
                continue
            comm = getattr(world, "comm", None)
            # One C-level copy of the dict under the GIL: pairs made on demand by another
            # thread meanwhile cannot break the loop.
            for peer, pair in list(comm.pairs.items()) if comm is not None else ():
                found[(topo.tier(me, peer), id(pair))] = pair.moved()
            segment = world.host_traffic()  # (the segment's key, its bytes), or None
            if segment is not None:
                found[("local", segment[0])] = segment[1]
        return found

    def rates(self) -> dict:
        """Bytes per second per tier since the last call (the first: since construction)."""
        now = self._clock()
        counts = self.counts()
        moved = dict.fromkeys(self.tiers, 0)
        for key, count in counts.items():
            moved[key[0]] = moved.get(key[0], 0) + max(count - self._last.get(key, 0), 0)
        self._last = counts
        seconds = max(now - self._at, 1e-3)
        self._at = now
        return {tier: round(n / seconds) for tier, n in moved.items()}
