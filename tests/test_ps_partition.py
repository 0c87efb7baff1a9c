"""A replicated parameter server whose host is cut off: replaced behind the cut, its old copy
fenced when the host is back.

The job has two hosts: ``localhost`` (3 workers and server 0, shard 0's primary) and a network
namespace joined to this machine's by a veth pair (server 1, its backup), reached through the
ssh stand-in of ``test_elastic_partition.py``, which passes the launcher's kill on late, as
ssh over a cut link would (here 45 s after it: the old copy must end by itself first). Worker 0
cuts the namespace off (``ranks/ps_replicas.py partition``: this side's end of the veth down,
so the host keeps its address, routes and sockets and loses its carrier, as behind a dead
switch port): the primary finds its backup silent and leaves it out of view 1; the launcher
finds server 1 fenced and silent, kills it (the kill is held back) and starts its replacement
on that host, the only one with room, where it waits for the store. Once that replacement runs beside the old process, worker 0 joins the host
again: the replacement joins the shard (view 2), and the old process, awake again, must find
itself fenced and end by itself, reported by nobody (its index is the replacement's now).
At the end every rank, the replacement too, ends by itself: no server lingers.

Needs root (``ip netns``, veth); skipped with the reason otherwise. Slow tier.
"""

import re
import subprocess
import sys

import pytest

from harness import MARK, launch
from test_elastic_partition import STAND_IN, parthost  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_a_cut_off_server_is_replaced_behind_the_cut_and_its_old_copy_ends_fenced(
        tmp_path, parthost):
    ns, dev, address, gateway = parthost
    # This side's end of the veth: the device that holds the gateway's address.
    outer = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", f"{gateway}/32"],
                           capture_output=True, text=True, check=True).stdout.split()[1]
    stand_in = tmp_path / "ssh"
    # The stand-in's relay closes the lifeline once the host's link has been up for 15 s
    # after the kill; its own end stays up here (the cut is at the other end): 45 s instead,
    # for the old copy to end by itself first, which is what the test asserts.
    template = STAND_IN.replace("time.monotonic() - up_since > 15",
                                "time.monotonic() - up_since > 45")
    assert template != STAND_IN
    stand_in.write_text(template.replace("{python}", sys.executable).replace("{mark}", MARK))
    stand_in.chmod(0o755)
    r = launch(3, "ps_replicas.py", "async", "partition", "12", timeout=240,
               env={"GRADSYNC_HEARTBEAT_INTERVAL": "0.5", "GRADSYNC_HEARTBEAT_TIMEOUT": "2",
                    "PART_NS": ns, "PART_DEV": dev, "PART_ADDR": address, "PART_OUTER": outer},
               launcher_args=("--servers", "2", "--ps-replicas", "2", "-H",
                              f"localhost:4,{address}:1", "--ssh-command", str(stand_in)))
    assert "async: " in r.output and "all applied once, copies agree" in r.output, r
    assert re.search(r"view 1 holds servers \[0\] \(server 1: ", r.output), r
    assert re.search(rf"rank 4 \(server 1\) on host {re.escape(address)} was fenced out of "
                     r"shard 0 \(view 1: .*\) and has been silent for [\d.]+s: killed by the "
                     r"launcher", r.output), r
    # Started once, on the cut-off host (no other has room), while the old process ran.
    assert r.output.count("rank 4 started again") == 1, r
    assert "rank 4 started again (1 of 3): it joins its shard with a copy" in r.output, r
    assert "runs beside the cut-off server" in r.output, r
    assert re.search(r"shard 0: view 2 holds servers \[0, 1\] \(server 1 joined with a copy",
                     r.output), r
    # The old copy, awake again, ends by itself as excluded; the launcher, which no longer
    # watches that process, does not report its end.
    assert "parameter server 1 (rank 4) ends: it was excluded from shard 0" in r.output, r
    assert not re.search(r"rank 4 \(server 1\) on host \S+ exited with status", r.output), r
    assert re.search(r"shard 0: primary 0 view \[2, \[0, 1\]\]; copies \[\(0, (\d+), '(\w+)'\), "
                     r"\(1, \1, '\2'\)\]", r.output), r
    assert r.returncode == 137, r  # the kill, reported at the end as the server's failure
    # Every rank ended by itself: the replacement too, which no worker but worker 0 reached
    # (it ends on the workers' count of closed clients), and its ssh with it, as ssh does. The
    # stand-in's relay used to wait for the end of the lifeline, which the launcher holds
    # open until the rank ends: the job waited out the servers' linger (10 s) and reported
    # the stand-in as a server still running.
    assert "still running" not in r.output, r
