"""The ring's per-size plan (``transport/trials.py``: ``Plan``, ``plan_of``) as pure logic: no
processes, no sockets, a stand-in communicator that says whether it lends and hands out trials.
"""

from gradsync.transport.trials import SEGMENT_MARGIN, Lending, Plan, Tuning, plan_of


class _Comm:
    """What ``plan_of`` and ``Plan.measure`` ask of a communicator."""

    def __init__(self, lends=True, lend_trials=2, segment_trials=1):
        self.tuning = Tuning(segment_trials, lend_trials)
        self.plans = self.tuning.plans_of((0, 1))
        self.lends = lends
        self.asked = 0
        self.rank, self.size = 0, 2

    @property
    def lending(self):
        return self.tuning.lending

    def segments(self, chunk_bytes, nbytes, ranks=None):
        self.asked += 1
        return self.tuning.segments((0, 1), chunk_bytes, nbytes, lambda: True)


def test_a_plan_without_trials_is_settled_at_once():
    plan = Plan(4096, None, None)
    assert plan.settled and plan.segment == 4096 and plan.lend is False
    assert Plan(4096, None, Lending(0)).lend is True  # lending unmeasured: lends from the start


def test_plan_of_builds_once_per_key():
    comm = _Comm()
    first = plan_of(comm, "k", 1 << 20, 64 << 20, True, True)
    assert plan_of(comm, "k", 1 << 20, 64 << 20, True, True) is first and comm.asked == 1
    assert plan_of(comm, "other", 1 << 20, 1 << 10, False, False).settled
    assert comm.tuning.plans_of((0, 1)) is comm.plans  # views of the same ranks share them


def test_sizes_then_lending_are_measured_then_the_plan_settles():
    comm = _Comm()
    plan = plan_of(comm, "k", 1 << 20, 64 << 20, True, True)
    runs = []

    def run(segment, lend):
        runs.append((segment, lend))

    def agree(costs):
        # the ranks' sum: sixteenths cheaper than the others by less than the margin, so the
        # whole segments are kept (the least CPU)
        costs[:] = [1.0 - SEGMENT_MARGIN / 2, 1.0, 1.0]

    while not plan.settled:
        plan.measure(comm, 64 << 20, run, agree)
    sixteenth, quarter, whole = (1 << 20) // 16, (1 << 20) // 4, 1 << 20
    # segment sizes first (one turn of 4 each, never lent), then lending, copying first
    assert runs == [(sixteenth, False)] * 4 + [(quarter, False)] * 4 + [(whole, False)] * 4 + \
        [(whole, False), (whole, True)] * 2
    assert plan.segment == whole and plan.lend is comm.lending.chosen


def test_a_ring_that_stops_lending_stops_measuring_it():
    comm = _Comm(segment_trials=0)
    plan = plan_of(comm, "k", 1 << 20, 64 << 20, True, True)
    assert not plan.settled and plan.measuring()
    comm.lends = False  # a failed vmsplice: the pair copies from now on
    plan.measure(comm, 64 << 20, lambda segment, lend: None, lambda costs: None)
    assert plan.settled and plan.lend is False and plan.lending is None


def test_lending_chosen_by_one_size_settles_the_others():
    comm = _Comm(segment_trials=0, lend_trials=1)
    small = plan_of(comm, "a", 1 << 20, 40 << 20, False, True)
    large = plan_of(comm, "b", 1 << 20, 80 << 20, False, True)
    lent = []
    while not small.settled:
        small.measure(comm, 40 << 20, lambda segment, lend: lent.append(lend), lambda c: None)
    assert lent == [False, True] and comm.lending.chosen is not None
    # the other size learns the choice on its next allreduce, which measures nothing more
    assert not large.settled and not large.measuring()
    large.measure(comm, 80 << 20, lambda segment, lend: lent.append(lend), lambda c: None)
    assert large.settled and large.lend is comm.lending.chosen is lent[-1]
    assert comm.lending.seconds_per_byte[True] == comm.lending.seconds_per_byte[True][:1]
