"""The ballot of a negotiation cycle (gradsync/pipeline/ballot.py), without processes: several ranks
are simulated by one ``Agreement`` and one ``Ballot`` each, their ballots ANDed as the vote does."""

import numpy as np

from gradsync.pipeline.agreement import Agreement, Signature
from gradsync.pipeline.ballot import IDLE, QUIET, STOP, Ballot, bits_of, words_for


def sig(shape=(4,)) -> Signature:
    return Signature("allreduce", "float32", shape, "SUM", None, 1.0, 1.0, False)


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def cached(n: int, names: list[str]) -> list[Agreement]:
    """n ranks' tables, each with ``names`` run once (bits 0, 1, ... in that order)."""
    tables = [Agreement(r, list(range(n))) for r in range(n)]
    for a in tables:
        for name in names:
            a.ran(name, sig())
    return tables


def test_words_hold_the_flags_then_one_bit_per_cache_entry():
    assert [words_for(s) for s in (0, 1, 64, 65, 1024)] == [1, 2, 2, 3, 17]
    words = np.zeros(3, dtype=np.uint64)
    words[0], words[1] = 1 << 63, (1 << 0) | (1 << 63)
    assert list(bits_of(words)) == [63, 64, 127]
    assert list(bits_of(np.zeros(2, dtype=np.uint64))) == []
    assert STOP & QUIET == STOP & IDLE == QUIET & IDLE == 0


def test_only_bits_every_rank_voted_for_survive_the_and():
    names = [f"g{i}" for i in range(70)]  # two words of bits
    tables, ballots = cached(2, names), [Ballot(), Ballot()]
    for name in names:
        ballots[0].add(name, sig(), f"q0.{name}")
    for name in ("g69", "g3"):
        ballots[1].add(name, sig(), f"q1.{name}")
    cast = [b.cast(a.bit, a.cache.span, 60.0) for a, b in zip(tables, ballots)]
    assert all(demoted == [] for _, demoted in cast)
    assert cast[0][0].size == 3 and int(cast[0][0][2]) == (1 << 6) - 1  # g64..g69
    both = np.bitwise_and(cast[0][0], cast[1][0])
    ready = tables[0].voted(bits_of(both[1:]))
    assert [name for name, _ in ready] == ["g3", "g69"]  # lowest bit first
    assert ready[0][1] == {0: sig(), 1: sig()}
    assert ballots[0].pop("g3") == "q0.g3" and len(ballots[0]) == 69
    # what was not ready is voted for again in the next cycle
    words, _ = ballots[0].cast(tables[0].bit, tables[0].cache.span, 60.0)
    assert list(bits_of(words[1:])) == [i for i in range(70) if i != 3]


def test_a_request_leaves_the_ballot_when_its_bit_is_gone_or_it_waited_too_long():
    clock = Clock()
    table, ballot = cached(2, ["a", "b", "c"])[0], Ballot(clock)
    ballot.add("a", sig(), "qa")
    ballot.add("new", sig(), "qn")  # never ran: no bit
    ballot.add("b", sig(shape=(5,)), "qb")  # cached with another shape: no bit
    clock.now += 1.0
    ballot.add("c", sig(), "qc")
    words, demoted = ballot.cast(table.bit, table.cache.span, 60.0)
    assert [(name, item) for name, _, item, _ in demoted] == [("new", "qn"), ("b", "qb")]
    assert list(bits_of(words[1:])) == [0, 2] and int(words[0]) == 0
    clock.now += 59.5  # 'a' has waited 60.5 s, 'c' 59.5 s
    words, demoted = ballot.cast(table.bit, table.cache.span, 60.0)
    assert [(name, waited) for name, _, _, waited in demoted] == [("a", 60.5)]
    assert list(bits_of(words[1:])) == [2] and "a" not in ballot and "c" in ballot
