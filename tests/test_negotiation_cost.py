"""What a steady-state negotiation cycle costs one rank, counted: N Controllers
(gradsync/pipeline/negotiation.py) as threads over in-memory pairs (``transport.local``), each
rank's sends counted per collective. A cycle of cached operations must cost each rank at most
⌊log2 N⌋ + 1 messages of one ballot (a flags word and the cache bits), with no gather."""

import math
import types

import pytest

from gradsync.pipeline.negotiation import Controller, Request
from gradsync.transport import frame
from gradsync.transport.local import local_comms


class Counting:
    """A Comm that records, per collective (``begin``), the messages and bytes it sends."""

    def __init__(self, comm):
        self._comm = comm
        self.records: list[list] = []  # [description, messages, bytes], one per collective

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def begin(self, description, check=True):
        self.records.append([description, 0, 0])
        self._comm.begin(description, check)

    def begin_signed(self, description, signature):
        self.records.append([description, 0, 0])
        self._comm.begin_signed(description, signature)

    def exchange(self, sends=(), recvs=(), lend=False):
        record = self.records[-1]
        for _, buf in sends:
            record[1] += 1
            record[2] += frame.HEADER_SIZE + memoryview(buf).nbytes
        self._comm.exchange(sends, recvs, lend)


class FakeWorld(types.SimpleNamespace):
    """A namespace that can be weakly referenced, as the flight recorder's tracks refer to
    their World."""


def world(rank: int, size: int, comm) -> FakeWorld:
    """What a Controller reads of a World, across hosts (no shared-memory group)."""
    config = types.SimpleNamespace(check_collectives=True, chunk_bytes=1 << 16,
                                   stall_warning=60.0, timeout=60.0, stall_report=0.0,
                                   abort_poll_interval=0.1)
    return FakeWorld(rank=rank, size=size, comm=comm, config=config, shares_host=False,
                     hierarchical=False, fail=lambda exc: exc,
                     env=types.SimpleNamespace(job_id="negotiation-cost"))


def steady_cycles(n: int, names: int = 4, steps: int = 5):
    """Runs ``steps`` steady steps of ``names`` cached operations on ``n`` ranks after one
    warm-up step; returns per rank the negotiation collectives of the steady steps, and the
    controllers' (cycles, gathers) counted over them."""
    comms = [Counting(c) for c in local_comms(n, timeout=120.0)]
    ctls = [Controller(world(r, n, comms[r]), "global", list(range(n)), 1 << 20)
            for r in range(n)]

    def step():
        handles = [ctl.submit(Request(f"op{j}", "barrier", "none", (), run=lambda w: None))
                   for ctl in ctls for j in range(names)]
        for h in handles:
            h.wait(120)

    try:
        step()  # every name is new: described in full, gathered, then cached
        start = [len(c.records) for c in comms]
        before = [(ctl.cycles, ctl.gathers) for ctl in ctls]
        for _ in range(steps):
            step()
        counted = [(ctl.cycles - c0, ctl.gathers - g0) for ctl, (c0, g0) in zip(ctls, before)]
        # Collectives begun after the snapshot; an idle cycle may straddle it: it is dropped.
        records = [[list(r) for r in c.records[s + 1:]] for c, s in zip(comms, start)]
    finally:
        for ctl in ctls:
            ctl.stop(timeout=0)  # every rank asks; the loops end together
        for ctl in ctls:
            ctl.stop(timeout=60)
    assert not any(ctl.running for ctl in ctls)
    return records, counted


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 13, 16, 32, 64])
def test_a_steady_cycle_costs_a_rank_log_n_messages_of_one_ballot(n):
    records, counted = steady_cycles(n)
    ballot = 8 * 2  # the flags word and one word of bits (4 cached names)
    bound = math.floor(math.log2(n)) + 1
    for rank, (mine, (cycles, gathers)) in enumerate(zip(records, counted)):
        assert cycles >= 5 and gathers == 0, (rank, cycles, gathers)  # no gather at all
        negotiation = [r for r in mine if "negotiat" in r[0]]
        assert negotiation, (rank, mine)
        for description, messages, nbytes in negotiation:
            # recursive doubling: log2 of the largest power of two, +1 to fold a rank in
            assert messages <= bound, (rank, description, messages, bound)
            assert nbytes == messages * (frame.HEADER_SIZE + ballot), (rank, nbytes, messages)
    most = max(m for mine in records for d, m, _ in mine if "negotiat" in d)
    assert most == (bound if n & (n - 1) else bound - 1)  # the bound is reached, not loose


def test_the_cost_grows_with_log_n_not_n():
    # The bytes a rank sends per steady cycle at 64 ranks are within 7 ballots of 2 ranks'.
    per_cycle = {}
    for n in (2, 64):
        records, _ = steady_cycles(n, steps=2)
        per_cycle[n] = max(b for mine in records for d, _, b in mine if "negotiat" in d)
    assert per_cycle[64] <= 6 * per_cycle[2], per_cycle


if __name__ == "__main__":  # the table of docs/scale.md: PYTHONPATH=. python3 tests/<this file>
    print("N  messages  bytes  (the busiest rank, per steady cycle, frame headers included)")
    for n in (2, 3, 4, 8, 16, 32, 64):
        records, _ = steady_cycles(n, steps=3)
        cycles = [(m, b) for mine in records for d, m, b in mine if "negotiat" in d]
        print(n, max(m for m, _ in cycles), max(b for _, b in cycles))
