"""The launcher's one job loop (``gradsync/run/loop.py``) with a policy written here.

Both job kinds (the static ``launcher._Job`` and ``elastic._ElasticJob``) run in this loop;
what it promises whatever the policy: a signal ends the job with 128 + its number, a policy
that fails to start or raises still has every rank it started stopped, the summary counts
the ranks the end stopped (unless the policy says not to), and a rank the policy stops while
the job goes on gets SIGTERM at once and SIGKILL only past the grace. Each rank here is a
``sleep`` (no interpreter) or a stand-in: this tests the loop, not a job; test_launcher.py and
test_elastic.py run jobs.
"""

from __future__ import annotations

import io
import signal
import types

import pytest

from gradsync.run.launcher import LaunchSpec, Rank, Slot
from gradsync.run.loop import JobLoop
from gradsync.run.processes import Output, StartError, start


class _Policy(JobLoop):
    """Starts ``ranks`` sleeps, then plays ``turns``: each a callable of the loop that returns
    the turn's answer (None: the job goes on)."""

    def __init__(self, ranks: int, turns, begin_fails: bool = False, count_stopped=True):
        self.err = io.BytesIO()
        super().__init__(LaunchSpec(command=["sleep", "30"], num_proc=ranks, stop_grace=2.0),
                         Output(True, io.BytesIO(), self.err))
        self.ranks_count, self.turns, self.begin_fails = ranks, list(turns), begin_fails
        self.count_stopped = count_stopped
        self.ranks: list[Rank] = []
        self.ended: list[tuple[int, str | None]] = []

    def begin(self) -> None:
        for r in range(self.ranks_count):
            self.ranks.append(Rank(Slot(r, "localhost", r, self.ranks_count, 0, 1),
                                   start(["sleep", "30"])))
        if self.begin_fails:
            raise StartError("cannot start rank 9 on host x: no such file", 127)

    def turn(self):
        return self.turns.pop(0)(self)

    def started(self):
        return self.ranks

    def ending(self, status, summary):
        self.ended.append((status, summary))

    def lines(self) -> list[str]:
        return self.err.getvalue().decode().splitlines()


def _gone(policy: _Policy) -> bool:
    return all(rank.proc.poll() is not None for rank in policy.ranks)


def test_a_signal_ends_the_job_with_its_status_and_every_rank_stopped():
    def interrupt(loop):
        loop.interrupts(signal.SIGTERM)  # as the handler does
        return None

    policy = _Policy(2, [lambda loop: None, interrupt])  # a turn goes on, then the signal
    assert policy.run() == 128 + signal.SIGTERM
    assert _gone(policy) and not policy.turns  # no turn after the signal
    assert policy.ended == [(128 + signal.SIGTERM, "interrupted by SIGTERM")]
    assert policy.lines() == ["gradsync run: interrupted by SIGTERM; stopped 2 ranks"]


def test_the_policys_end_is_the_jobs_and_the_ranks_still_running_are_counted():
    policy = _Policy(3, [lambda loop: (5, "rank 1 failed", "other ")])
    assert policy.run() == 5
    assert _gone(policy)
    assert policy.lines() == ["gradsync run: rank 1 failed; stopped 3 other ranks"]
    quiet = _Policy(1, [lambda loop: (5, "a worker failed", "other ")], count_stopped=False)
    assert quiet.run() == 5 and _gone(quiet)
    assert quiet.lines() == ["gradsync run: a worker failed"]
    done = _Policy(1, [lambda loop: (0, None, None)])
    assert done.run() == 0 and _gone(done) and done.lines() == []


def test_a_start_that_fails_stops_the_ranks_it_started():
    policy = _Policy(2, [], begin_fails=True)
    assert policy.run() == 127
    assert _gone(policy)
    assert policy.lines() == ["gradsync run: cannot start rank 9 on host x: no such file; "
                              "stopped 2 other ranks"]


def test_a_policy_that_raises_still_stops_every_rank():
    def broken(loop):
        raise RuntimeError("a defect in the policy")

    policy = _Policy(2, [broken])
    with pytest.raises(RuntimeError, match="a defect in the policy"):
        policy.run()
    assert _gone(policy) and policy.ended == [(1, None)]


class _Signalled:
    """A rank that records the signals it gets and runs until ``code`` is set."""

    def __init__(self):
        self.signals, self.code = [], None
        self.proc = types.SimpleNamespace(poll=lambda: self.code)

    def signal(self, signum):
        self.signals.append(signum)


def test_a_rank_stopped_while_the_job_goes_on_is_killed_only_past_the_grace():
    def loop(grace):
        return JobLoop(LaunchSpec(command=["true"], num_proc=1, stop_grace=grace),
                       Output(True, io.BytesIO(), io.BytesIO()))

    patient, hasty = loop(3600.0), loop(0.0)
    waiting, late, gone = _Signalled(), _Signalled(), _Signalled()
    patient.stop_one(waiting)
    hasty.stop_one(late)
    hasty.stop_one(gone)
    assert waiting.signals == late.signals == gone.signals == [signal.SIGTERM]  # at once
    gone.code = -signal.SIGTERM  # it heeded the SIGTERM
    for _ in range(2):  # two turns: a SIGKILL is sent once
        patient._reap()
        hasty._reap()
    assert waiting.signals == [signal.SIGTERM]  # within its grace
    assert late.signals == [signal.SIGTERM, signal.SIGKILL]
    assert gone.signals == [signal.SIGTERM]


def test_the_store_a_policy_hosts_is_found_while_the_job_runs_and_not_after():
    from gradsync.run import jobfile
    from gradsync.run.ranks import Starter

    class Hosting(JobLoop):
        def begin(self):
            self.starter = Starter(self.spec, self.output, "127.0.0.1")
            self.store = self.host_store(3)

        def turn(self):
            self.found = jobfile.find(self.starter.job_id)
            return 0, None, None

        def started(self):
            return []

    job = Hosting(LaunchSpec(command=["true"], num_proc=3),
                  Output(True, io.BytesIO(), io.BytesIO()))
    assert job.run() == 0
    assert job.found is not None  # gradsync top finds the store by the job id
    assert (job.found["store_port"], job.found["size"]) == (job.store.port, 3)
    assert jobfile.find(job.starter.job_id) is None  # withdrawn at the end
