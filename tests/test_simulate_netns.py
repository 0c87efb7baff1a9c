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


def test_allreduces_of_16_ranks_over_4_hosts_within_15_percent_and_bound_by_the_links():
    """The 25 Mbit/s point of EMULATED_ALLREDUCE, one timed allreduce per algorithm (CI's
    share): within 15% of the model, and within 15% of the link-limited bound, so the links,
    not the 2 cores, set the time. Both points with three iterations each and the half-rate
    check take about 14 minutes: `gradsync simulate --validate --measure` (docs/simulate.md);
    on 2026-11-26 they gave -6.2/-3.4% (hierarchical/ring) at 25 Mbit/s and -3.4/-3.0% at
    12.5 Mbit/s, 93-97% of the bound."""
    require_netns()
    point = next(p for p in EMULATED_ALLREDUCE if (p.hosts, p.ranks, p.rate) == (4, 4, "25mbit"))
    rows = measure_allreduce(point, iters=1, timeout=600)
    for row in rows:
        print(row)
    assert {row["algorithm"] for row in rows} == {"hierarchical", "ring"}
    for row in rows:
        assert row["wrong"] == 0, row
        assert abs(row["error_pct"]) <= 15, row
        assert row["of_bound"] >= 0.85, row
