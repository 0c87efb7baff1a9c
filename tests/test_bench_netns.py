"""torch.distributed's gloo beside gradsync on emulated hosts (slow tier; needs root).

gloo finds the interface to bind by the machine's host name, which no emulated host resolves;
without ``GLOO_SOCKET_IFNAME=eth0`` (``gradsync.testbed.netns.rank_env`` sets it) it binds to
loopback and its ranks on other hosts never meet. The bench runs both, on the same buffer,
over the same shaped links.
"""

import json
import os
import sys

import pytest

from netns import cluster, run
from gradsync.testbed.netns import Host, Slot, rank_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_each_rank_binds_gloo_to_its_hosts_interface():
    host = Host("h0", 1, ns="x-h0", ip="10.213.0.1")
    env = rank_env(None, Slot(0, host, 0, 1), [Slot(0, host, 0, 1)], 29500, "job")
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_gloo_runs_beside_gradsync_over_the_shaped_links(tmp_path):
    out = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "gradsync.bench.allreduce", "--sizes", "4M:4M", "--algorithm",
            "hierarchical", "--compare", "gloo", "--warmup", "1", "--iters", "3", "--json",
            str(out)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    with cluster([("h0", 2), ("h1", 2)], host_rate="200mbit") as c:
        results = run(c, argv, timeout=240, environ=environ, stop_on_failure=True)
    assert all(r.returncode == 0 for r in results), "\n".join(map(str, results))
    row = json.loads(out.read_text())[0]
    assert row["gradsync"]["wrong"] == 0 and row["gloo"]["wrong"] == 0, row
    # Both went over the 200 Mbit/s link (23.9 MB/s of TCP payload): gloo's ring sends
    # 2 (n-1)/n of the 4 MiB through each host's link, hierarchical 2 (H-1)/H.
    payload = 200e6 / 8 * 1448 / 1514
    assert row["gloo"]["time_us"] / 1e6 > 0.9 * 1.5 * (4 << 20) / payload, row
    assert row["gradsync"]["time_us"] / 1e6 > 0.9 * 1.0 * (4 << 20) / payload, row
