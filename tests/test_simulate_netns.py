"""gradsync simulate against what was measured here, on emulated clusters (slow tier).

Training steps: each cluster of gradsync.simulate.measure.EMULATED is built from network
namespaces, the bench MLP and CNN train on it, and the simulator predicts their step time from
the shipped cluster file and the compute time measured in the same run. About a minute per
cluster.

Allreduces at scale: 16 ranks over 4 emulated hosts (gradsync.simulate.measure_allreduce), at
25 Mbit/s, each algorithm's time against the cost model and the link-limited bound. Needs root.
"""

import pytest

from netns import require_netns
from gradsync.simulate.measure import EMULATED, measure
from gradsync.simulate.measure_allreduce import EMULATED_ALLREDUCE, measure_allreduce

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("emulation", EMULATED, ids=[e.name for e in EMULATED])
def test_predicted_step_time_within_15_percent_of_measured(emulation):
    require_netns()
    rows = measure(emulation, timeout=300)
    for row in rows:
        print(row)
    assert {r["point"].split()[1] for r in rows} == {"mlp", "cnn"}
    if emulation.algorithm != "auto":  # the algorithm the ranks ran is the one predicted
        assert all(r["algorithms"] == {emulation.algorithm: 1} for r in rows), rows
    for row in rows:
        assert abs(row["error_pct"]) <= 15, row


def _without_segment_trials(monkeypatch) -> None:
    """The ranks that ``measure_allreduce`` starts run with ``GRADSYNC_TUNE_SEGMENTS=0``.

    Over TCP the ring's first allreduces of 4 MiB or more are trials of two segment sizes, 4
    of each (collectives/ring.py), and ``gradsync bench allreduce`` warms up until they are
    done: 8 more ring allreduces of 16 MiB at 10-12 s each on these links, three quarters of
    the test's 244 s in CI (2026-11-29). What the test checks does not need them: the time
    is the links' (of_bound), and the model has no segment size; the trials have their own
    tests (tests/test_ring_segments.py, test_bench_allreduce.py). ``measure_allreduce``
    drops the caller's ``GRADSYNC_*`` variables, so the setting goes in through the one call
    that starts the ranks, ``testbed.netns.run``'s ``env`` (added to every rank's)."""
    from gradsync.testbed import netns as testbed

    run = testbed.run

    def without_trials(*args, env=None, **kwargs):
        return run(*args, env={**(env or {}), "GRADSYNC_TUNE_SEGMENTS": "0"}, **kwargs)

    monkeypatch.setattr(testbed, "run", without_trials)


def test_allreduces_of_16_ranks_over_4_hosts_within_15_percent_and_bound_by_the_links(monkeypatch):
    """The 25 Mbit/s point of EMULATED_ALLREDUCE, one timed allreduce per algorithm (CI's
    share), without the ring's segment trials (``_without_segment_trials``): within 15% of
    the model, and within 15% of the link-limited bound, so the links, not the 2 cores, set
    the time. Both points with three iterations each and the half-rate check take about 14
    minutes: `gradsync simulate --validate --measure` (docs/simulate.md); on 2026-11-26 they
    gave -6.2/-3.4% (hierarchical/ring) at 25 Mbit/s and -3.4/-3.0% at 12.5 Mbit/s, 93-97% of
    the bound.

    One timed allreduce each, beside the slow tier's other jobs on the 2 cores: their load
    only adds time (hierarchical 10.2 s against 8.46 s predicted in two full runs of the tier
    here, sessions 32 and 33, within 15% alone). So a run outside the bounds is measured once
    more, and each algorithm judged by its faster run; wrong results fail in either."""
    require_netns()
    _without_segment_trials(monkeypatch)
    point = next(p for p in EMULATED_ALLREDUCE if (p.hosts, p.ranks, p.rate) == (4, 4, "25mbit"))

    def measured() -> list[dict]:
        rows = measure_allreduce(point, iters=1, timeout=600)
        for row in rows:
            print(row)
            assert row["wrong"] == 0, row
        assert {row["algorithm"] for row in rows} == {"hierarchical", "ring"}
        return rows

    def within(row: dict) -> bool:
        return abs(row["error_pct"]) <= 15 and row["of_bound"] >= 0.85

    rows = measured()
    if not all(map(within, rows)):
        again = {row["algorithm"]: row for row in measured()}
        rows = [min(row, again[row["algorithm"]], key=lambda r: r["allreduce_ms_measured"])
                for row in rows]
    for row in rows:
        assert abs(row["error_pct"]) <= 15, row
        assert row["of_bound"] >= 0.85, row
