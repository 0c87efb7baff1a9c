"""Stragglers named (gradsync/liveness/pace.py, gradsync/liveness/straggler_watch.py) and ``gradsync
top``.

The rule ("late in most of the last n steps") on injected numbers; the meter on an injected
clock; four ranks' publishers over one in-process store, judging a simulated job; then real
jobs through the launcher: a rank slowed by 30% named within 20 steps after 20 fault-free
steps that name nobody, and ``gradsync top --once`` on a running 4-rank job.
"""

import json
import logging
import re
import types

import pytest

import loopback
import small_jobs
from harness import launch

from gradsync.config import Config
from gradsync.liveness.pace import Meter
from gradsync.liveness.straggler_watch import Judge, Publisher, Report
from gradsync.run import top

MS = 1_000_000


def _steps(judge, late_steps, count, late_rank=3, late_ms=30):
    """Judges steps 1..count of 4 ranks, each step 132 ms: in ``late_steps`` rank
    ``late_rank`` arrives ``late_ms`` after the others (which then block that much longer)."""
    for n in range(1, count + 1):
        late = n in late_steps
        judge.judge(n, [(132 * MS, (2 if r == late_rank or not late else 2 + late_ms) * MS)
                        for r in range(4)])


def test_a_rank_late_in_most_of_the_last_steps_is_named():
    judge = Judge(4, 10, 0.1)
    _steps(judge, {2, 3, 5, 7, 8, 10}, 10)  # 6 of 10
    assert judge.named() == [3]


def test_late_in_half_of_the_last_steps_is_not_named():
    judge = Judge(4, 10, 0.1)
    _steps(judge, {1, 3, 5, 7, 9}, 10)  # 5 of 10
    assert judge.named() == []


def test_only_the_last_window_counts():
    judge = Judge(4, 10, 0.1)
    _steps(judge, set(range(1, 11)), 20)  # late in steps 1-10, on time in 11-20
    assert judge.named() == []
    judge = Judge(4, 10, 0.1)
    _steps(judge, set(range(1, 11)), 14)  # late in 6 of the last 10 (5-10)
    assert judge.named() == [3]


def test_a_named_rank_stays_named_until_late_in_at_most_a_quarter_of_the_last_steps():
    # A rank slowed just past the bar drops under it for a step or two on a busy machine:
    # named once, not let go and named again (a warning each time).
    judge = Judge(4, 10, 0.1)
    late = set(range(1, 7)) | {12, 15} | set(range(18, 21))
    named = {}
    for n in range(1, 21):
        judge.judge(n, [(132 * MS, (2 if r == 3 or n not in late else 32) * MS)
                        for r in range(4)])
        named[n] = judge.named()
    assert named[5] == [] and named[6] == [3]  # late in 6 of the 10 judged so far
    assert named[15] == [3]  # steps 6-15: late in 3 of them (6, 12, 15), most no longer
    assert named[16] == []  # steps 7-16: late in 2, a quarter: let go
    assert named[20] == []  # steps 11-20: late in 5 (12, 15, 18-20), not most
    judge.judge(21, [(132 * MS, (2 if r == 3 else 32) * MS) for r in range(4)])
    assert judge.named() == [3]  # steps 12-21: late in 6, most: named again


def test_late_means_later_than_most_ranks():
    judge = Judge(4, 10, 0.1)
    for n in range(1, 11):  # ranks 2 and 3 late by 30 ms: both named
        judge.judge(n, [(132 * MS, (32 if r < 2 else 2) * MS) for r in range(4)])
    assert judge.named() == [2, 3]
    judge = Judge(4, 10, 0.1)
    for n in range(1, 11):  # rank 0 faster than the three others: nobody is late
        judge.judge(n, [(132 * MS, (32 if r == 0 else 2) * MS) for r in range(4)])
    assert judge.named() == []
    judge = Judge(4, 10, 0.1)
    for n in range(1, 11):  # arrivals 10 ms apart: the typical rank blocks 22 ms
        judge.judge(n, [(132 * MS, (2 + 10 * (3 - r)) * MS) for r in range(4)])
    assert judge.named() == [3] and judge.pace(3).late_ms == 20 and judge.pace(2).late_ms == 10


def test_late_by_less_than_the_threshold_or_the_floor_is_not_late():
    judge = Judge(4, 10, 0.1)
    _steps(judge, set(range(1, 11)), 10, late_ms=12)  # 9% of 132 ms
    assert judge.named() == []
    judge = Judge(4, 10, 0.1)
    for n in range(1, 11):  # 2 ms steps, late by 0.8 ms: 40%, but below the 1 ms floor
        judge.judge(n, [(2 * MS, MS if r < 3 else MS // 5) for r in range(4)])
    assert judge.named() == []


def test_where_a_straggler_and_its_peers_spend_their_steps():
    # The worked example of straggler_watch's docstring: rank 3 computes 130 ms and blocks
    # 2 ms (the allreduce), the others compute 100 ms and block 32 ms.
    judge = Judge(4, 10, 0.1)
    _steps(judge, set(range(1, 11)), 10)
    slow, peer = judge.pace(3, "host3"), judge.pace(0, "host0")
    assert (slow.late_steps, slow.steps, slow.late_ms, slow.step_ms) == (10, 10, 30, 132)
    assert (slow.compute_ms, slow.wait_ms, slow.comm_ms) == (130, 0, 2)
    assert (peer.late_steps, peer.compute_ms, peer.wait_ms, peer.comm_ms) == (0, 100, 30, 2)


class Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns


def test_overlapping_blocked_intervals_count_once():
    meter = Meter(Clock())
    meter.reset(0)
    for begin, end in ((0, 10), (5, 15), (12, 14), (20, 30)):
        meter.blocked(begin, end)
    assert meter.blocked_ns == 25


def test_operations_make_steps_until_the_first_marked_one():
    clock = Clock()
    meter = Meter(clock)
    meter.reset(3)
    for _ in range(7):
        clock.ns += 10
        meter.op_done()
    assert [s[0] for s in meter.steps] == [1, 2] and [s[2] for s in meter.steps] == [30, 30]
    clock.ns += 5
    meter.mark_step()  # the first marked step: numbered from 1, operations no longer count
    for _ in range(6):
        meter.op_done()
    assert [(s[0], s[4]) for s in meter.steps] == [(1, 1)]
    meter.reset(3, on=False)
    meter.op_done()
    meter.mark_step()
    assert list(meter.steps) == []


def test_a_report_reaches_the_listeners_at_the_next_marked_step():
    meter = Meter(Clock())
    meter.reset(0)
    got = []
    meter.listeners.append(got.append)
    meter.mark_step()
    assert got == []
    meter.news = Report(7)
    meter.mark_step()
    meter.mark_step()
    assert got == [Report(7)] and meter.news is None


class Timeline:
    def __init__(self):
        self.marks = []

    def instant(self, name, what, args=None):
        self.marks.append((name, what, args))


def test_steps_and_stragglers_are_marked_in_the_timeline():
    clock = Clock()
    meter = Meter(clock)
    meter.reset(0)
    meter.timeline = Timeline()
    meter.blocked(0, 3 * MS)
    clock.ns = 10 * MS
    meter.mark_step()
    meter.news = Report(1, (types.SimpleNamespace(rank=2),))
    meter.mark_step()
    assert meter.timeline.marks == [
        ("steps", "STEP", {"step": 1, "compute_ms": 7.0, "data_ms": 0.0, "blocked_ms": 3.0}),
        ("steps", "STEP", {"step": 2, "compute_ms": 0.0, "data_ms": 0.0, "blocked_ms": 0.0}),
        ("stragglers", "STRAGGLERS", {"named": [2], "step": 1})]


def test_an_elastic_states_straggler_callbacks_get_each_new_report():
    from gradsync.elastic import ObjectState
    from gradsync.liveness.pace import meter

    state = ObjectState(lambda obj, root_rank=0, name=None: obj, lambda: 0)
    got = []
    state.register_straggler_callbacks([got.append])
    meter.reset(0)
    try:
        meter.news = Report(5)
        meter.mark_step()
        meter.mark_step()
        assert got == [Report(5)]
    finally:
        meter.reset(0, on=False)
        meter.listeners.clear()


def _publishers(size=4):
    from torch.distributed import HashStore

    from gradsync.cluster.rendezvous import Store

    base = HashStore()
    config = Config(straggler_interval=0.1)
    meters, publishers = [], []
    clock = Clock()
    for r in range(size):
        world = types.SimpleNamespace(
            config=config, rank=r, size=size, env=types.SimpleNamespace(job_id="job"),
            peers=[types.SimpleNamespace(host=f"host{i}") for i in range(size)],
            store=Store.over(base, "job", 5.0))
        meter = Meter(clock)
        meter.reset(0)
        meters.append(meter)
        publishers.append(Publisher(world, pace=meter, thread=False))
    return base, clock, meters, publishers


def _run(clock, meters, publishers, compute_ms, steps, comm_ms=2, rounds=None):
    """``steps`` steps of every rank: rank r computes ``compute_ms[r]``, then all meet in a
    collective of ``comm_ms``; after each step the publishers that ``rounds(step)`` gives
    post (and rank 0 judges); by default all of them every 5 steps, rank 0 last."""
    for n in range(steps):
        start = clock.ns
        arrivals = [start + c * MS for c in compute_ms]
        clock.ns = max(arrivals) + comm_ms * MS
        for meter, arrived in zip(meters, arrivals):
            meter.op_done()
            meter.blocked(arrived, clock.ns)
            meter.mark_step()
        step = meters[0].step
        for p in (rounds(step) if rounds else
                  publishers[1:] + publishers[:1] if n % 5 == 4 else []):
            p.round()


def test_four_ranks_name_the_slow_one_through_the_store_and_top_shows_it(caplog):
    base, clock, meters, publishers = _publishers()
    got = []  # what rank 1's listeners get, at its marked steps
    meters[1].listeners.append(got.append)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        _run(clock, meters, publishers, [100, 100, 100, 100], 20)
        assert publishers[0].report.step == 20 and publishers[0].report.named == ()
        assert not [r for r in caplog.records if "straggler" in r.getMessage()]
        _run(clock, meters, publishers, [100, 100, 130, 100], 20)
    report = publishers[0].report
    assert report.step == 40 and [p.rank for p in report.named] == [2], report
    (warning,) = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert "rank 2 on host host2 is a straggler" in warning, warning
    assert "compute 130.0 ms, data 0.0 ms, waiting 0.0 ms, communication 2.0 ms" in warning, \
        warning
    assert int(re.search(r"up to step (\d+)", warning)[1]) <= 30, warning
    for p in publishers[1:]:  # the others have read the verdict at their rounds
        assert [s.rank for s in p.report.named] == [2]
    assert [[s.rank for s in report.named] for report in got] == [[2]]
    # gradsync top reads the same keys: a row per rank, the straggler marked.
    current, posts, verdict = top.read(base)
    assert current == {"job": "job", "size": 4}
    lines = top.table(current, posts, verdict).splitlines()
    assert len(lines) == 6 and "stragglers: rank 2" in lines[0], lines
    assert [line.split()[:2] for line in lines[2:]] == [[str(r), f"host{r}"] for r in range(4)]
    assert [line.endswith("STRAGGLER") for line in lines[2:]] == [False, False, True, False]


@pytest.mark.parametrize("per_round", [13, 130])
def test_rank_0_judges_the_steps_its_peers_posted_before_its_own_round(caplog, per_round):
    """A real job (78 ms steps: 13 an interval) in which rank 0's round came a few steps
    before its peers': its post of its newest 10 steps and theirs, an interval older, never
    held a step in common, and rank 0 named nobody for 14 s (170 steps) while gradsync top,
    which keeps its reads, showed the straggler late in 10 of 10. Rank 0 keeps what its
    peers posted; and a post carries the steps since the last one (every 8th of a job of
    130 steps an interval), so that none is left out of every post."""
    base, clock, meters, publishers = _publishers()
    lag = 3 * per_round // 13  # the peers post 0.23 intervals after rank 0

    def rounds(step):
        return (publishers[:1] if step % per_round == 0 else
                publishers[1:] if step % per_round == lag else [])

    with caplog.at_level(logging.WARNING, logger="gradsync"):
        _run(clock, meters, publishers, [100] * 4, 2 * per_round, rounds=rounds)
        judged = publishers[0].report.step
        assert judged and publishers[0].report.named == (), publishers[0].report
        assert not [r for r in caplog.records if "straggler" in r.getMessage()]
        _run(clock, meters, publishers, [100, 100, 100, 130], 3 * per_round, rounds=rounds)
    report = publishers[0].report
    assert [p.rank for p in report.named] == [3], report
    (warning,) = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    # Slowed from step 2 * per_round + 1: named from what the peers posted at their second
    # round after that, judged at rank 0's next (every step of an interval; with 130 steps,
    # every 8th: 10 of them span 80 steps).
    stride = 1 if per_round == 13 else 8
    named_at = int(re.search(r"up to step (\d+)", warning)[1])
    assert named_at == (3 * per_round + lag) // stride * stride, warning
    assert "in 10 of the last 10 steps" in warning, warning
    assert all(m.stride == stride for m in meters)


def _posting_meter(clock, meter=None):
    """Rank 1 of 2's meter on ``clock`` (``meter``, else a new one) and a publisher of it (no
    thread, no store): a post is ``publisher.summary()``."""
    world = types.SimpleNamespace(
        config=Config(straggler_interval=1.0), rank=1, size=2,
        env=types.SimpleNamespace(job_id="job"),
        peers=[types.SimpleNamespace(host="h")] * 2, store=None)
    if meter is None:
        meter = Meter(clock)
        meter.reset(0)
    return meter, Publisher(world, pace=meter, thread=False)


def test_a_post_carries_the_steps_since_the_last_one():
    """Ten steps a post while a rank made 13 an interval left 3 of every 13 out of all of
    its posts; a job of 130 an interval posts every 8th, and keeps only those."""
    clock = Clock()
    meter, publisher = _posting_meter(clock)

    def steps(count):
        for _ in range(count):
            clock.ns += 10 * MS
            meter.mark_step()
        return [n for n, *_ in publisher.summary()["steps"]]

    assert steps(4) == [1, 2, 3, 4]
    assert steps(13) == list(range(5, 18))
    assert steps(3) == list(range(11, 21))  # the newest 10 at least (gradsync top's first read)
    steps(130)  # more than HISTORY (64) since the last post (the test below says what it posts)
    assert meter.stride == 8
    assert steps(130) == list(range(152, 281, 8))


def test_a_meter_full_of_steps_not_posted_keeps_every_other_one_rather_than_drop_the_oldest():
    """A meter holds its newest 64 steps (HISTORY). Before the first post had set its stride,
    a job of 130 steps in its first interval held steps 67-130 alone and posted 72-128
    (every 8th): its steps 8-64 were in no post, judged on no rank; the same when its steps
    became 8 times faster. Without a publisher it keeps the newest 64, every one."""
    clock = Clock()
    meter, publisher = _posting_meter(clock)

    def steps(count, ms):
        for _ in range(count):
            clock.ns += ms * MS
            meter.mark_step()
        return [n for n, *_ in publisher.summary()["steps"]]

    assert steps(130, 8) == list(range(8, 129, 8))
    assert steps(130, 8) == list(range(136, 257, 8))
    assert steps(1040, 1) == list(range(320, 1281, 64))  # 8 times as many an interval
    # The same when the job begins to mark its steps, numbered from 1 again: the steps
    # counted by operations up to 100 were posted, the marked ones up to 100 were not.
    meter.reset(1)
    _, publisher = _posting_meter(clock, meter)
    for _ in range(10):
        for _ in range(10):
            meter.op_done()
        publisher.summary()
    assert meter.step == 100 and meter.stride == 1
    assert steps(130, 8) == list(range(8, 129, 8))
    alone = Meter(clock)
    alone.reset(0)
    for _ in range(200):
        alone.mark_step()
    assert [s[0] for s in alone.steps] == list(range(137, 201)) and alone.stride == 1


def test_the_start_up_in_a_jobs_first_step_is_not_judged(caplog):
    """Step 1's clock starts at the job's start (the meter's reset): it holds the start-up.
    Here rank 3 reaches its first collective 2 s after its peers (a slower import, a later
    connection), and they block 2 s in it; then it is slowed by 30%. Judged, step 1 made
    rank 3 late by 2 s there, and the first warning said "by 358.3 ms on average" with its
    peers "waiting 358.3 ms"; the judge begins at step 2 (``FIRST_JUDGED``)."""
    base, clock, meters, publishers = _publishers()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        _run(clock, meters, publishers, [500, 500, 500, 2500], 1,
             rounds=lambda step: publishers[1:] + publishers[:1])
        # Step 1 is posted and passed over: rank 0, not moving, asks the store for nothing.
        store = publishers[0]._store
        publishers[0]._store = None  # (any request would raise)
        publishers[0].round()
        publishers[0]._store = store
        assert publishers[0].report.step == 0
        _run(clock, meters, publishers, [100, 100, 100, 130], 19)  # rounds at steps 6, 11, 16
    report = publishers[0].report
    assert report.step == 16 and [p.rank for p in report.named] == [3], report
    (warning,) = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert "by 30.0 ms on average" in warning and "in 10 of the last 10 steps up to step 11" \
        in warning, warning
    assert "Its steps: compute 130.0 ms, data 0.0 ms, waiting 0.0 ms, communication 2.0 ms; " \
        "its peers': compute 100.0 ms, data 0.0 ms, waiting 30.0 ms" in warning, warning
    assert [(p.steps, p.step_ms) for p in report.ranks] == [(10, 132)] * 4, report.ranks


def _result(output: str) -> dict:
    found = re.search(r"RESULT (\{.*\})", output)
    assert found, output
    return json.loads(found[1])


def _check_phases(got: dict, slow: int, size: int) -> None:
    assert got["step"] == 40 and got["named"] == [slow] and got["ranks"] == size, got
    steps = [int(re.search(r"up to step (\d+)", w)[1]) for w in got["warnings"]]
    named = [int(re.search(r"rank (\d+) on host", w)[1]) for w in got["warnings"]]
    # Nobody in the 20 fault-free steps; the slowed rank within 20 steps of being slowed, once.
    assert named == [slow] and 20 < steps[0] <= 40, got["warnings"]


@pytest.mark.multiprocess
def test_a_rank_slowed_by_30_percent_is_named_within_20_steps_and_none_before():
    # tests/ranks/pace.py, last of the scripts of the 3-rank job of small_jobs.py: rank 2 slowed
    result = small_jobs.result(3)
    assert small_jobs.ran(result, "pace.py", 3), result
    _check_phases(_result(small_jobs.output(result, "pace.py")), 2, 3)


@pytest.mark.multiprocess
def test_a_rank_slow_for_its_data_is_named_with_its_time_under_data():
    # pace.py data: rank 2's extra 30% (18 ms a step) is a wait for its batches
    result = small_jobs.result(3)
    assert small_jobs.ran(result, "pace.py:data", 3), result
    got = _result(small_jobs.output(result, "pace.py:data"))
    _check_phases(got, 2, 3)
    (slow,) = got["paces"]
    assert slow["data_ms"] >= max(10.0, 0.5 * slow["late_ms"]), slow
    # The warning (its numbers at the step it was given) says so too.
    warned = re.search(r"Its steps: compute [\d.]+ ms, data ([\d.]+) ms", got["warnings"][0])
    assert warned and float(warned[1]) >= 10.0, got["warnings"]


@pytest.mark.multiprocess
def test_a_slowed_rank_of_a_ddp_job_is_named_within_20_steps_and_none_before():
    # pace.py ddp: DDP over the backend "gradsync" alone, no mark_step; its wait for the
    # buckets happens in torch's C++ reducer (torch/backend/backward.py)
    result = small_jobs.result(3)
    assert small_jobs.ran(result, "pace.py:ddp", 3), result
    _check_phases(_result(small_jobs.output(result, "pace.py:ddp")), 2, 3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_slowed_rank_is_named_through_the_horovod_api():
    r = launch(4, "pace.py", "hvd", "2", timeout=90)
    assert r.returncode == 0, r
    _check_phases(_result(r.output), 2, 4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_top_once_shows_a_row_per_rank_of_a_running_job():
    r = launch(4, "pace.py", "top", "3", timeout=120)
    assert r.returncode == 0 and "RESULT top exit 0" in r.output, r
    table = [line.split("TOP|", 1)[1] for line in r.output.splitlines() if "TOP|" in line]
    assert "4 ranks" in table[0] and "rank 3" in table[0].split("stragglers:")[1], table
    rows = {int(line.split()[0]): line for line in table[2:]}
    assert sorted(rows) == [0, 1, 2, 3], table
    # (Only rank 3 is slowed, but top's own start, a second of CPU on a busy machine, may
    # make another rank late for a while too: only rank 3's mark is certain.)
    assert rows[3].endswith("STRAGGLER"), table


def test_a_large_jobs_ranks_post_less_often_so_the_stores_load_stays_flat():
    """Every rank posts once an interval to the one store: up to 256 ranks at the configured
    interval, beyond that the interval grows with the job (27,360 ranks: every 107 s)."""
    from gradsync.liveness.straggler_watch import STORE_POSTS_PER_S

    def interval(size):
        world = types.SimpleNamespace(
            config=Config(straggler_interval=1.0), rank=0, size=size,
            env=types.SimpleNamespace(job_id="job"),
            peers=[types.SimpleNamespace(host="h")] * size, store=None)
        return Publisher(world, thread=False).interval

    assert STORE_POSTS_PER_S == 256
    assert interval(4) == interval(256) == 1.0
    assert interval(1024) == 4.0
    assert interval(27_360) == pytest.approx(27_360 / 256)


def test_the_horovod_apis_operations_count_in_the_bytes_per_second():
    """The Horovod API records dtypes by name ('float32'), which have no itemsize: its
    operations, the gradients of every DistributedOptimizer job, counted 0 bytes, and
    ``gradsync top``'s MB/s stayed 0.00. And an operation in flight at a post (the fused
    gradients, often) must count at the next post, once it completed."""
    import time

    from gradsync.flight_recorder import recorder
    from gradsync.liveness.straggler_watch import payload_bytes

    track = recorder.track("topshot", "Horovod API (global)", [0], "horovod", 5.0)
    named = [track.issue("all_reduce", "g", (10,), dtype, numbered=False)
             for dtype in ("float32", "bfloat16", "float64", "int8")]
    assert [payload_bytes(rec) for rec in named] == [40, 20, 80, 10]
    world = types.SimpleNamespace(
        config=Config(straggler_interval=1.0), rank=0, size=1,
        env=types.SimpleNamespace(job_id="job"), peers=[types.SimpleNamespace(host="h")],
        store=None)
    publisher = Publisher(world, pace=Meter(), thread=False)
    publisher.summary()  # what earlier tests left completed in the ring counts here
    gradients = track.issue("all_reduce", "gradients", (250_000,), "float32", numbered=False)
    track.issue("all_reduce", "go", (1,), "float32", numbered=False).done()  # issued after
    publisher.summary()  # the gradients in flight: not counted yet
    gradients.done()
    publisher._last_t = time.monotonic() - 1.0  # a post a second later
    assert publisher.summary()["bytes_s"] == pytest.approx(1_000_000, rel=0.2)


def _post(rank, steps, ops=100, last="#9 all_reduce 'g' [1] Float (numpy API), completed 0.1s ago"):
    return {"rank": rank, "host": f"host{rank}", "generation": -1, "step": steps[-1][0],
            "ops": ops, "bytes_s": 2_000_000, "steps": steps, "last": last}


def test_top_keeps_the_steps_of_earlier_reads_and_ages_a_waiting_ranks_last_operation():
    """Ranks post at their own moments: one read may hold no step that every rank's post
    still holds (the live view of a 10-steps-a-second job showed 0.0 ms in every column
    at times). The view keeps the steps of earlier reads, shows '-' where nothing was
    judged, and a rank that has not posted since (waiting) gets older, not 0.1 s forever."""
    current = {"job": "job", "size": 4}

    def steps(first, slow):  # 10 steps of 100 ms; the others wait 30 ms for rank 3
        return [[n, 100 * MS, (2 if slow else 32) * MS] for n in range(first, first + 10)]

    early = [_post(r, steps(1, r == 3)) for r in range(2)]
    late = [_post(r, steps(11, r == 3)) for r in range(2, 4)]
    view = top.View(current)
    view.update(early + late, now=100.0)
    rows = top.table(current, early + late, {}, view=view, now=100.0).splitlines()[2:]
    # Nothing judged yet: '-' in the split and late columns, not zeros.
    assert all(row.split()[5:10] + row.split()[13:14] == ["-"] * 6 for row in rows), rows
    newer = [_post(r, steps(11, r == 3), ops=120) for r in range(2)]
    view.update(newer + late, now=101.0)
    rows = top.table(current, newer + late, {"named": [{"rank": 3}]}, view=view,
                     now=106.0).splitlines()[2:]
    assert [row.split()[5:10] for row in rows] == (
        [["100.0", "68.0", "0.0", "30.0", "2.0"]] * 3
        + [["100.0", "98.0", "0.0", "0.0", "2.0"]]), rows
    assert [row.split()[13] for row in rows] == ["0/10"] * 3 + ["10/10"], rows
    # Ranks 0 and 1 posted at 101 s, 2 and 3 last at 100 s: at 106 s their ops are older.
    assert [re.search(r"completed (\S+)s ago", row)[1] for row in rows] == (
        ["5.1", "5.1", "6.1", "6.1"]), rows
    assert rows[3].endswith("STRAGGLER") and not rows[0].endswith("STRAGGLER")


def test_top_cuts_its_rows_to_the_terminal_but_never_the_straggler_mark():
    """A row wider than the terminal wrapped, pushing the rows below it down and its own
    STRAGGLER mark onto the next line."""
    current = {"job": "job", "size": 2}
    posts = [_post(r, [[1, 100 * MS, 2 * MS]], last="not numbered yet: all_reduce "
                   "'allreduce.gradients[0] 4.bias .. 0.weight (6 tensors, torch.float32)' "
                   "[399370] Float (Horovod API (global)), scheduled 0.0s ago")
             for r in range(2)]
    # (140 columns: the columns before the last operation take 125 since the data and
    # per-tier columns; at 120 the mark still ends the row, over the cut columns.)
    lines = top.table(current, posts, {"named": [{"rank": 1}]}, width=140).splitlines()
    assert max(len(line) for line in lines) <= 140, lines
    assert lines[3].endswith("... STRAGGLER") and lines[2].endswith("..."), lines
    assert len(top.table(current, posts, {}).splitlines()[2]) > 140  # --once: uncut
    narrow = top.table(current, posts, {"named": [{"rank": 1}]}, width=120).splitlines()
    assert max(len(line) for line in narrow) <= 120 and narrow[3].endswith(" STRAGGLER")
    frame = top._frame("a\nb")  # redrawn in place: no clear of the whole screen (flicker)
    assert frame == "\x1b[Ha\x1b[K\nb\x1b[K\x1b[J"


def test_top_says_a_job_has_ended_when_its_store_is_gone(capsys, monkeypatch):
    """Torch's store client retries a port where nothing listens for its whole timeout,
    printing C++ stack traces meanwhile; top says at once that the job has ended."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        top.main(["--store", f"127.0.0.1:{port}", "--once"])
    assert "has the job ended?" in str(ended.value) and time.monotonic() - start < 3

    def gone(base):  # the store's server went away after the view began
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(top, "read", gone)
    assert top._show(top.build_parser().parse_args(["--once"]), None) == 1
    assert "the job has ended" in capsys.readouterr().err
    assert top._show(top.build_parser().parse_args([]), None) == 0


def test_the_live_view_ends_with_its_job_in_one_line():
    """The job's store goes with its launcher: the live view says so and exits 0, without
    the C++ stack that torch's store client logs for the failed request (20 lines over the
    last table, in the view of a real job that ended)."""
    import gc
    import os
    import select
    import sys
    import time

    from gradsync.cluster.rendezvous import Store
    from gradsync.liveness.straggler_watch import CURRENT_KEY, TOP_NAMESPACE
    from gradsync.run.processes import start

    server = loopback.store(5)  # no DNS wait for each client (tests/loopback.py)
    Store.over(server, TOP_NAMESPACE, 5.0).set(CURRENT_KEY, json.dumps({"job": "j", "size": 1}))
    job = Store.over(server, "j", 5.0)
    job.set("pace/0", json.dumps(_post(0, [[1, 100 * MS, 2 * MS]])))
    job.add("pace/ready", 1)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    view = start([sys.executable, "-m", "gradsync", "top", "--store",
                  f"127.0.0.1:{server.port}", "--interval", "0.1"], env, text=True)
    try:
        deadline, shown = time.monotonic() + 30, ""
        while "host0" not in shown and time.monotonic() < deadline:  # a table is up
            if select.select([view.proc.stdout], [], [], 0.5)[0]:
                shown += view.proc.stdout.readline()
        assert "host0" in shown, shown
        del job, server  # the job ends: its store's server with it
        gc.collect()
        out, err = view.proc.communicate(timeout=30)
    finally:
        view.proc.kill()
    assert view.proc.returncode == 0, err
    assert "the job has ended" in err and "frame #" not in err, err


def test_top_judges_afresh_when_a_job_begins_to_mark_its_steps():
    """Until a job marks a step, its steps are counted by operations; its first marked step
    is numbered 1 again: the view kept judging only steps past the counted ones, so it
    froze on them."""
    current = {"job": "job", "size": 2}

    def posts(first, explicit, slow_blocked):
        return [dict(_post(r, [[n, 100 * MS, (slow_blocked if r else 2) * MS]
                               for n in range(first, first + 10)]), explicit=explicit)
                for r in range(2)]

    view = top.View(current)
    view.update(posts(41, False, 2), now=1.0)  # counted steps 41-50
    assert view.judge.step == 50
    view.update(posts(1, True, 32), now=2.0)  # marked steps 1-10: rank 1 waits 30 ms for rank 0
    assert view.judge.step == 10
    assert top.table(current, posts(1, True, 32), {}, view=view).splitlines()[3].split()[8] \
        == "30.0"
