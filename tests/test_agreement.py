"""The agreement table of name negotiation (gradsync/pipeline/agreement.py), without processes:
several ranks are simulated by one ``Agreement`` each, fed the same cycles, as the Controller
does."""

import pickle

import pytest

from gradsync.errors import CollectiveMismatchError
from gradsync.pipeline.agreement import (JOIN, Agreement, Signature, Stall, agreed, describe,
                                         mismatch_error)
from gradsync.pipeline.negotiation import Request
from gradsync.pipeline.negotiation_wire import from_wire, to_wire


def sig(kind="allreduce", dtype="float32", shape=(4,), op="SUM", root=None, prescale=1.0,
        postscale=1.0, shared=False) -> Signature:
    return Signature(kind=kind, dtype=dtype, shape=shape, op=op, root=root, prescale=prescale,
                     postscale=postscale, shared=shared)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def world(n: int, ranks=None, clock=None) -> list[Agreement]:
    """One Agreement per rank of an n-rank World."""
    ranks = list(range(n)) if ranks is None else ranks
    return [Agreement(r, ranks, clock=clock or Clock()) for r in range(n)]


def cycle(agreements: list[Agreement], issued: list[list]) -> list:
    """One gathered cycle: every rank absorbs every rank's full announcements; returns the
    ready names (with signatures), the same on every rank."""
    results = [a.absorb([list(pairs) for pairs in issued]) for a in agreements]
    assert all(r == results[0] for r in results), results  # every rank decides the same
    return results[0][0]


def names(ready) -> list[str]:
    return [name for name, _ in ready]


def test_an_operation_is_ready_once_every_rank_announced_it_whatever_the_order():
    ranks = world(3)
    s = sig()
    ready = cycle(ranks, [[("a", s), ("b", s), ("c", s)], [("c", s), ("b", s)], [("b", s)]])
    assert names(ready) == ["b"]
    assert "a" in ranks[0] and "c" in ranks[2] and "b" not in ranks[1]
    ready = cycle(ranks, [[], [("a", s)], [("c", s), ("a", s)]])
    # agreed order: the order the names first entered the table (a before c: rank 0 read first)
    assert names(ready) == ["a", "c"]
    assert ready[0][1] == {0: s, 1: s, 2: s}
    assert cycle(ranks, [[], [], []]) == []
    assert ranks[0].absorb([[], [], []]) == ([], False)
    assert ranks[0].absorb([[("d", s)], [], []])[1] is True  # something was announced


def test_ready_names_come_out_in_the_order_they_first_appeared():
    ranks = world(2)
    s = sig()
    cycle(ranks, [[("x", s), ("y", s)], [("z", s)]])
    assert names(cycle(ranks, [[("z", s)], [("y", s), ("x", s)]])) == ["x", "y", "z"]


def test_ranks_that_disagree_are_named_in_the_mismatch():
    ranks = world(3, ranks=[0, 1, 2])
    ready = cycle(ranks, [[("w", sig(shape=(4,)))], [("w", sig(shape=(4,)))],
                          [("w", sig(shape=(5,)))]])
    (name, by_rank), = ready
    assert not agreed(by_rank)
    error = mismatch_error(name, by_rank, ranks[0].ranks)
    assert isinstance(error, CollectiveMismatchError)
    assert "ranks [0, 1]: allreduce float32[4] op=SUM; rank 2: allreduce float32[5] op=SUM" \
        in str(error), error
    for field, a, b in [("dtype", "float32", "float64"), ("op", "SUM", "MAX"), ("root", 0, 1),
                        ("prescale", 1.0, 0.5), ("postscale", 1.0, 2.0),
                        ("shared", False, True)]:
        assert not agreed({0: sig(**{field: a}), 1: sig(**{field: b})}), field
    assert agreed({0: sig(), 1: sig()})


def test_allgather_and_alltoall_may_differ_in_the_first_dimension_only():
    for kind in ("allgather", "alltoall"):
        assert agreed({0: sig(kind, shape=(3, 4)), 1: sig(kind, shape=(5, 4))})
        assert not agreed({0: sig(kind, shape=(3, 4)), 1: sig(kind, shape=(3, 5))})
        assert not agreed({0: sig(kind, shape=(3, 4)), 1: sig(kind, shape=(3, 4, 1))})
    assert not agreed({0: sig("allreduce", shape=(3, 4)), 1: sig("allreduce", shape=(5, 4))})


def test_describe_names_what_was_issued():
    assert describe(sig(shape=(17, 17))) == "allreduce float32[17, 17] op=SUM"
    assert describe(sig("broadcast", "int64", (2,), op=None, root=1)) == \
        "broadcast int64[2] root=1"
    assert describe(sig(prescale=0.5, shared=True)) == \
        "allreduce float32[4] op=SUM prescale=0.5 postscale=1.0 (in a shared buffer)"


def test_a_stall_is_reported_once_naming_the_missing_ranks_then_expires():
    clock = Clock()
    ranks = world(3, ranks=[4, 7, 9], clock=clock)  # a process set: messages use global ranks
    cycle(ranks, [[("orphan", sig())], [("orphan", sig())], []])
    assert ranks[0].stalled(warning=60, timeout=300) == ([], ())
    clock.now += 61
    assert ranks[0].stalled(60, 300) == ([Stall("orphan", 61.0, [4, 7], [9])], ())
    assert ranks[0].stalled(60, 300) == ([], ())  # reported once
    assert ranks[1].stalled(60, 300) == ([], ())  # only rank 0 times names
    clock.now += 240
    stalls, expired = ranks[0].stalled(60, 300)
    assert stalls == [] and expired == ("orphan",)
    # rank 0 announces the expired names; every rank drops them in the same cycle
    for a in ranks:
        assert a.expire(expired) == [("orphan", ([4, 7], [9]))]
        assert "orphan" not in a
    assert ranks[0].stalled(60, 300) == ([], ())
    assert ranks[2].expire(["never.announced"]) == []
    # the name is free: announced again, it is a new operation that runs
    s = sig()
    assert names(cycle(ranks, [[("orphan", s)], [("orphan", s)], [("orphan", s)]])) == \
        ["orphan"]


def test_a_ready_name_stops_its_stall_clock():
    clock = Clock()
    ranks = world(2, clock=clock)
    cycle(ranks, [[("slow", sig())], []])
    clock.now += 10
    cycle(ranks, [[], [("slow", sig())]])
    clock.now += 1000
    assert ranks[0].stalled(1, 5) == ([], ())


def test_joined_ranks_are_not_waited_for_and_join_returns_the_last_to_join():
    clock = Clock()
    ranks = world(3, clock=clock)
    j, s = sig(JOIN, "none", (), op=None), sig()
    cycle(ranks, [[("g", s)], [], []])
    ready = cycle(ranks, [[], [(JOIN, j)], []])
    assert ready == [] and ranks[0].joined == [1]
    assert names(cycle(ranks, [[], [], [("g", s)]])) == ["g"]  # rank 1 has joined
    cycle(ranks, [[("h", s)], [], []])
    assert ranks[0].who("h") == ([0], [2])  # the joined rank is not missing
    clock.now += 10_000
    assert ranks[0].stalled(1, 5)[1] == ("h",)  # a JOIN itself is never timed, h is
    assert [a.expire(("h",)) for a in ranks] == [[("h", ([0], [2]))]] * 3
    ready = cycle(ranks, [[(JOIN, j)], [], [(JOIN, j)]])
    assert names(ready) == [JOIN] and ready[0][1] == {0: j, 1: j, 2: j}
    assert [a.end_join() for a in ranks] == [2, 2, 2]  # rank 2's announcement was read last
    assert ranks[0].joined == []
    assert names(cycle(ranks, [[("k", s)], [("k", s)], []])) == []  # every rank counts again


def test_a_join_makes_waiting_names_ready():
    ranks = world(2)
    s = sig()
    cycle(ranks, [[("a", s)], []])
    ready = cycle(ranks, [[], [(JOIN, sig(JOIN, "none", (), op=None))]])
    assert names(ready) == ["a"] and ready[0][1] == {0: s}


def test_names_that_ran_are_announced_by_their_bits_and_voted_ready():
    ranks = world(2)
    step = [(f"grad{i}", sig(shape=(i + 1,))) for i in range(5)]
    assert [a.bit(*step[0]) for a in ranks] == [None, None]  # nothing cached: in full
    ready = cycle(ranks, [step, list(reversed(step))])
    for a in ranks:  # the Controller records what ran, in agreed order, on every rank
        for name, by_rank in ready:
            a.ran(name, by_rank[a.rank])
    assert [[a.bit(*p) for p in step] for a in ranks] == [[0, 1, 2, 3, 4]] * 2
    assert all(a.cache.span == 5 for a in ranks)
    voted = ranks[1].voted([0, 2])
    assert voted == [("grad0", {0: step[0][1], 1: step[0][1]}),
                     ("grad2", {0: step[2][1], 1: step[2][1]})]
    # a changed signature, or an unnamed operation, goes in full
    assert ranks[0].bit("grad0", sig(shape=(9,))) is None
    unnamed = ("allreduce.noname.3", sig())
    ranks[0].ran(*unnamed)
    assert ranks[0].bit(*unnamed) is None and ranks[0].cache.span == 5


def test_a_cached_name_goes_in_full_once_the_table_holds_it_or_a_rank_joined():
    ranks = world(2)
    s = sig()
    for a in ranks:
        a.ran("a", s)
    assert ranks[0].bit("a", s) == 0
    # rank 1 described 'a' in full (say with another shape): rank 0 must meet it in the table
    cycle(ranks, [[], [("a", sig(shape=(9,)))]])
    assert ranks[0].bit("a", s) is None
    ready = cycle(ranks, [[("a", s)], []])
    assert names(ready) == ["a"] and not agreed(ready[0][1])
    assert ranks[0].bit("a", s) == 0  # out of the table: a bit again
    cycle(ranks, [[], [(JOIN, sig(JOIN, "none", (), op=None))]])
    assert ranks[0].bit("a", s) is None  # the table knows whom to wait for, the bits do not


def test_a_name_that_waited_as_a_bit_stalls_from_when_it_was_issued():
    clock = Clock()
    ranks = world(3, clock=clock)
    # rank 1 voted for 'a' for 30 s before it went in full; rank 0 never issued it
    ranks[0].absorb([[], [("a", sig())], []], [{}, {"a": 30.0}, {}])
    clock.now += 31.0
    stalls, expired = ranks[0].stalled(60.0, 300.0)
    assert [st.name for st in stalls] == ["a"] and stalls[0].waited == 61.0
    assert stalls[0].issued == [1] and stalls[0].missing == [0, 2] and expired == ()
    ranks[0].absorb([[], [], [("a", sig())]], [{}, {}, {"a": 290.0}])  # an earlier start wins
    assert ranks[0].stalled(60.0, 300.0) == ([], ())
    clock.now += 11.0
    assert ranks[0].stalled(60.0, 300.0)[1] == ("a",)


def test_signatures_cross_the_wire_as_the_plain_tuples_they_were():
    # A named tuple would pickle as a reference to its class: longer bytes.
    q = Request("allreduce.g", "allreduce", "float32", (3,), op="SUM", scale=(0.5, 1.0))
    plain = ("allreduce", "float32", (3,), "SUM", None, 0.5, 1.0, False)
    data = to_wire([(q.name, q.sig)], ("x",), {"y": 2.5})
    assert data == pickle.dumps(([("allreduce.g", plain)], ("x",), {"y": 2.5}), protocol=5)
    assert b"Signature" not in data and b"agreement" not in data
    full, expire, waited = from_wire(data)
    assert (expire, waited) == (("x",), {"y": 2.5})
    assert full == [("allreduce.g", q.sig)] and type(full[0][1]) is Signature


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rank_reaches_the_same_order_from_rotated_issue_orders(n):
    ranks = world(n)
    items = [(f"t{i}", sig(shape=(i + 1,))) for i in range(6)]
    issued = [items[r:] + items[:r] for r in range(n)]
    ready = cycle(ranks, issued)
    assert sorted(names(ready)) == sorted(name for name, _ in items)
    assert all(agreed(by_rank) for _, by_rank in ready)
