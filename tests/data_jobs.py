"""The shared jobs of data servers that tests/test_data_multiprocess.py and test_data_liveness.py
both read.

A job of data servers costs a launcher, an interpreter that imports torch per rank and a
rendezvous (most of a scenario's time), so the scenarios of one shape share one job
(tests/service_jobs.py). Two files had a job of 2 workers and 3 data servers: the counts, the
shrink and the resume of test_data_multiprocess.py, and the slow server beside a stopped one
over TCP of test_data_liveness.py. Now one job runs them all, started by
the first test of either file that asks (``two_three``), once per pytest process; its time,
and that of the 3-and-4 job whose stopped state it resumes (``three_four``), is charged to
this file's line in the budgets (tests/budgets.txt), not to the test that asked first.
"""

from __future__ import annotations

from budgets import charged_to
from gradsync.data import plan as P

import service_jobs as S

TIMEOUT = 420
"""A shared job's deadline: its scenarios' own (120 s each alone, mostly the start-up paid once
now) and room for a loaded machine."""

SLOW = {"samples": 400, "seconds": 2.5}
"""The slow server's scenario (``slow``): its dataset of 400 samples, 25 batches per worker and
server and epoch (so data server 0 stops mid-epoch), and how long data server 1 takes to read
one sample of its first batch."""

_jobs: dict[str, S.DataJob] = {}


def slow_sample(servers: int) -> int:
    """The sample that data server 1 is slow to read: one of batch 1, its first (worker 1's
    first from it; worker 0's next one from it waits behind it), in epoch 0's plan of 2
    workers and ``servers`` data servers (of 400 samples, batch 4, seed 7)."""
    batches = P.plan(SLOW["samples"], 4, 7, 0, servers, 2)
    assert batches[1].server == 1
    return int(batches[1].ids[0])


def slow_env(servers: int, road: str) -> dict:
    """The variables of a slow-server scenario on ``road`` (``tcp`` or ``poll``)."""
    env = {"GS_DATA_SAMPLES": str(SLOW["samples"]),
           "GS_DATA_SLOW": f"{slow_sample(servers)}:{SLOW['seconds']:g}"}
    if road == "tcp":
        env["GRADSYNC_TRANSPORT"] = "tcp"
    return env


def three_four(tmp_path_factory) -> S.DataJob:
    """3 workers, 4 data servers: ``stop`` (resumed in ``two_three``), then ``lose``: worker 1
    held before its dial to data server 0, worker 2 before its read of server 0's region
    table (each moment of the old ``[dial]`` and ``[regions]`` jobs met by a held worker); its
    kills end the job."""
    if "three_four" not in _jobs:
        tmp = tmp_path_factory.mktemp("data-3-4")
        lose = S.data_entry("lose", "lose-dial", 2, rank_args={1: ["lose-dial", "DIR", 2],
                                                               2: ["lose-regions", "DIR", 2]})
        with charged_to("data_jobs.py"):
            _jobs["three_four"] = S.DataJob(tmp, 3, 4, [S.data_entry("stop", "stop", 3), lose],
                                            timeout=TIMEOUT,
                                            dirs={"stop": tmp_path_factory.mktemp("resume")})
    return _jobs["three_four"]


def two_three(tmp_path_factory) -> S.DataJob:
    """2 workers, 3 data servers: ``count``, ``count`` over TCP (``tcp``), ``shrink``,
    ``resume`` of ``three_four``'s ``stop`` (in its directory), then ``slow`` (data server 0
    stopped and server 1 slow, over TCP: test_data_liveness.py)."""
    if "two_three" not in _jobs:
        stopped = three_four(tmp_path_factory).dirs["stop"]
        with charged_to("data_jobs.py"):
            _jobs["two_three"] = S.DataJob(tmp_path_factory.mktemp("data-2-3"), 2, 3, [
                S.data_entry("count", "count", 2),
                S.data_entry("tcp", "count", 2, env={"GRADSYNC_TRANSPORT": "tcp"}),
                S.data_entry("shrink", "shrink", 3),
                S.data_entry("resume", "resume", 2),
                S.data_entry("slow", "stopserver", 2, env=slow_env(3, "tcp"))],
                timeout=TIMEOUT, dirs={"resume": stopped})
    return _jobs["two_three"]
