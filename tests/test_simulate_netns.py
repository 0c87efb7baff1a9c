"""gradsync simulate against training steps measured here, on emulated clusters (slow tier).

Each cluster of gradsync.simulate.measure.EMULATED is built from network namespaces, the bench
MLP and CNN train on it, and the simulator predicts their step time from the shipped cluster
file and the compute time measured in the same run. About a minute per cluster; needs root.
"""

import pytest

from netns import require_netns
from gradsync.simulate.measure import EMULATED, measure

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("emulation", EMULATED, ids=[e.name for e in EMULATED])
def test_predicted_step_time_within_15_percent_of_measured(emulation):
    require_netns()
    rows = measure(emulation, timeout=300)
    for row in rows:
        print(row)
    assert {r["point"].split()[1] for r in rows} == {"mlp", "cnn"}
    for row in rows:
        assert abs(row["error_pct"]) <= 15, row
