"""The flight recorder (gradsync/flight_recorder.py) and the stall report
(gradsync/liveness/stall.py).

The ring's logic and its dumps run in this process; two jobs of ranks forked from one process
(tests/forked_jobs.py; the Horovod API's and the torch backend's, in the slow tier, through
the launcher and as torchrun starts ranks): a rank asleep in user code while its peers wait
(every waiting rank's stall report names it and shows its sleeping frame), and a mismatched
collective whose dumps torch's own analyzer reads.
"""

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

import forked_jobs
from harness import launch, spawn

from gradsync.config import Config
from gradsync.flight_recorder import (COMPLETED, FAILED, FILE_PREFIX, SCHEDULED, STARTED,
                                      Recorder)


def _recorder(entries=5):
    recorder = Recorder(entries)
    track = recorder.track("numpy:job", "numpy API", [0, 1, 2], "numpy", 300.0)
    return recorder, track


# ----------------------------------------------------------------------------- the ring
def test_the_ring_keeps_the_newest_records_in_order():
    recorder, track = _recorder(entries=5)
    for i in range(12):
        track.issue("all_reduce", f"t{i}", (4,), "float32")
    held = recorder.records()
    assert [r.name for r in held] == [f"t{i}" for i in range(7, 12)]
    assert [r.seq for r in held] == list(range(8, 13))  # numbered from 1, in issue order
    assert [e["record_id"] for e in recorder.entries()] == list(range(7, 12))


def test_a_record_goes_through_its_states_and_torch_reads_them():
    recorder, track = _recorder()
    done, failed, waiting = (track.issue("all_reduce", n, (2, 3), "float32")
                             for n in ("done", "failed", "waiting"))
    assert waiting.state == SCHEDULED
    done.start()
    assert done.state == STARTED and done.started_ns >= done.created_ns
    done.done()
    failed.start()
    failed.fail(RuntimeError("peer lost"))
    assert (done.state, failed.state) == (COMPLETED, FAILED)
    assert failed.error == "peer lost"  # words: the exception would keep its frames alive
    by_name = {e["gradsync_name"]: e for e in recorder.entries()}
    e = by_name["done"]
    assert e["state"] == "completed" and e["profiling_name"] == "gloo:all_reduce"
    assert e["input_sizes"] == [[2, 3]] and e["input_dtypes"] == ["Float"]
    assert e["time_discovered_completed_ns"] >= e["time_discovered_started_ns"]
    assert e["process_group"] == ("numpy:job", "numpy API") and e["collective_seq_id"] == 1
    # torch's format has no failed state: a failed collective began and never completed
    assert by_name["failed"]["state"] == "started"
    assert by_name["failed"]["gradsync_state"] == "failed"
    assert by_name["failed"]["gradsync_error"] == "peer lost"
    assert by_name["waiting"]["state"] == "scheduled"
    assert by_name["waiting"]["time_discovered_started_ns"] is None


def test_records_keep_the_monotonic_clock_and_a_dump_writes_the_wall_clocks_times():
    # The records' clock is the monotonic one (the engine's pace accounting reads it off
    # them); torch's format, which ranks on several hosts compare, has the wall clock's.
    recorder, track = _recorder()
    wall_before, before = time.time_ns(), time.monotonic_ns()
    rec = track.issue("all_reduce", "w", (1,), "float32")
    rec.start()
    rec.done()
    wall_after, after = time.time_ns(), time.monotonic_ns()
    assert before <= rec.created_ns <= rec.started_ns <= rec.ended_ns <= after
    (entry,) = recorder.entries()
    slack = 50_000_000  # the clocks' difference, read again at the dump, may move a little
    for key in ("time_created_ns", "time_discovered_started_ns",
                "time_discovered_completed_ns"):
        assert wall_before - slack <= entry[key] <= wall_after + slack, key
    assert entry["duration_ms"] == (rec.ended_ns - rec.started_ns) / 1e6


def test_operations_numbered_when_they_run_take_the_next_numbers_while_they_wait():
    # The Horovod API numbers a request when it runs (agreed order); a dump numbers those
    # still waiting after the last one run, in issue order.
    recorder, track = _recorder(entries=10)
    late = track.issue("all_reduce", "late", (1,), "float32", numbered=False)
    ran = track.issue("all_reduce", "ran", (1,), "float32", numbered=False)
    track.number(ran)
    other = track.issue("all_gather", "other", (1,), "float32", numbered=False)
    seqs = {e["gradsync_name"]: e["collective_seq_id"] for e in recorder.entries()}
    assert seqs == {"ran": 1, "late": 2, "other": 3}
    assert late.seq is None and other.seq is None  # a dump leaves the records as they were


def test_the_ring_allocates_nothing_once_full():
    # Nothing per operation: once the ring is full each new operation overwrites the oldest
    # one's record, so the memory held stays flat however many operations run.
    recorder, track = _recorder(entries=100)
    shape = (4,)

    def operations(n):
        for _ in range(n):
            rec = track.issue("all_reduce", "grad", shape, "float32")
            rec.start()
            rec.done()

    operations(200)
    tracemalloc.start()
    try:
        operations(100)
        before = tracemalloc.get_traced_memory()[0]
        operations(5000)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # 5,000 records kept would hold hundreds of KB; a few KB come and go with int objects
    assert after - before < 50_000, (before, after)


_OBSERVERS = tuple(os.path.join(*path) for path in (
    ("gradsync", "flight_recorder.py"), ("liveness", "pace.py"), ("liveness", "straggler_watch.py")))


def _calls(run, files=_OBSERVERS) -> int:
    """Python functions entered while ``run()`` runs on this thread, in ``files`` (counted,
    not timed: the same on a busy machine)."""
    found = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(files):
            found[0] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found[0]


def test_an_operation_costs_the_recorder_and_the_meter_a_few_writes_into_records_made_once():
    # Issue 41: observing a job costs nothing per operation beyond a few writes to memory the
    # rank owns. Once the ring is full, each operation takes the record of the one a ring
    # earlier (no object made), and the engine's road (the NumPy API's: issued already
    # started when it runs at once, done, the caller's time blocked) enters three functions
    # of the recorder and the meter, where it entered six before issue 41 (a call to store
    # the record, one to count it in the meter) and four before issue 39 (a call to start it).
    import types

    from gradsync.liveness.pace import meter
    from gradsync.pipeline.engine import Engine

    recorder, track = _recorder(entries=100)
    engine = Engine(types.SimpleNamespace(failure=None), track)
    shape = (4,)

    def operations(n):
        for _ in range(n):
            engine.run(int, "grad", "all_reduce", shape, "float32")

    was = meter.on
    meter.reset(0, on=True)  # the meter counts (as in a job), marks no steps
    try:
        operations(100)
        ring = [track.issue("barrier") for _ in range(100)]
        for rec in ring:
            rec.done()
        again = [track.issue("barrier") for _ in range(100)]
        assert all(a is b for a, b in zip(ring, again))  # the same records, overwritten
        for rec in again:
            rec.done()
        ops = meter.ops
        calls = _calls(lambda: operations(1000))
        assert meter.ops == ops + 1000  # each one counted in the meter's steps
    finally:
        meter.reset(0, on=was)
    assert calls <= 3 * 1000, calls / 1000
    assert [r.name for r in recorder.records()] == ["grad"] * 100


def test_a_record_in_flight_a_whole_ring_later_stays_its_holders():
    recorder, track = _recorder(entries=2)
    slow = track.issue("all_reduce", "slow", (1,), "float32")
    slow.start()
    track.issue("all_reduce", "quick", (1,), "float32").done()
    newer = track.issue("all_reduce", "newer", (1,), "float32")  # slow's slot: still running
    slow.done()
    assert (slow.name, slow.state) == ("slow", COMPLETED)
    assert (newer.name, newer.state) == ("newer", SCHEDULED)
    assert [r.name for r in recorder.records()] == ["quick", "newer"]


def test_a_reader_copies_whole_records_and_skips_one_being_overwritten():
    recorder, track = _recorder(entries=3)
    first, second = (track.issue("all_reduce", n, (1,), "float32") for n in ("a", "b"))
    held = recorder.records()
    assert [r.name for r in held] == ["a", "b"] and held[0] is not first  # copies
    first.done()
    assert held[0].state == SCHEDULED  # a snapshot: later changes are not in it
    second.record_id = -1  # how issue() leaves a record while it overwrites its fields
    assert [r.name for r in recorder.records()] == ["a"]
    assert recorder.newest().name == "a"


def test_a_pace_post_reads_only_what_completed_since_the_last_one(monkeypatch):
    # The publisher's thread posts once a second while the training thread waits for the
    # GIL: with a full ring of 2,000 it copied and sorted every record (a call per record
    # in the sort's key alone) and worked out each new one's bytes; now one pass over the
    # ring picks out what completed since the last post.
    import types

    from gradsync.liveness import straggler_watch
    from gradsync.liveness.pace import Meter

    recorder, track = _recorder(entries=2000)
    monkeypatch.setattr(straggler_watch, "recorder", recorder)
    # The publisher's clock, moved by hand: on a loaded machine real seconds pass between the
    # two posts, which the rate would divide by.
    clock = [1000.0]
    monkeypatch.setattr(straggler_watch, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    world = types.SimpleNamespace(
        config=Config(straggler_interval=1.0), rank=0, size=1,
        env=types.SimpleNamespace(job_id="job"), peers=[types.SimpleNamespace(host="h")],
        store=None)
    publisher = straggler_watch.Publisher(world, pace=Meter(), thread=False)
    for _ in range(2000):
        track.issue("all_reduce", "g", (256,), "float32").done()
    publisher.summary()
    for _ in range(10):
        track.issue("all_reduce", "g", (256,), "float32").done()
    track.issue("all_gather", "last", (1,), "int8")
    clock[0] += 1.0  # a post a second later
    posted = {}
    calls = _calls(lambda: posted.update(publisher.summary()))
    assert posted["bytes_s"] == pytest.approx(10 * 1024, rel=0.2)  # 10 of 256 floats, in 1 s
    assert posted["last"].startswith("#2011 all_gather 'last' [1] Char"), posted["last"]
    assert calls < 100, calls


def test_a_recorder_of_size_zero_keeps_nothing():
    recorder, track = _recorder(entries=0)
    track.issue("barrier").done()
    assert recorder.records() == [] and recorder.entries() == []


# ----------------------------------------------------------------------------- dumps
def test_a_dump_on_request_is_what_torchs_loader_reads(tmp_path):
    from torch.distributed.flight_recorder.components.loader import read_dump

    recorder, track = _recorder()
    recorder.rank = 2
    track.issue("broadcast", "w", (3,), "float64").done()
    track.issue("barrier").done()
    path = recorder.dump(tmp_path / "dumps")
    assert os.path.basename(path) == f"{FILE_PREFIX}2"
    assert sorted(os.listdir(tmp_path / "dumps")) == [f"{FILE_PREFIX}2"]  # nothing aside
    read = read_dump(FILE_PREFIX, path)
    assert read["rank"] == 2 and read["version"] == "2.10"
    assert read["pg_config"] == {"numpy:job": {"name": "numpy:job", "desc": "numpy API",
                                               "ranks": "[0, 1, 2]"}}
    assert [e["profiling_name"] for e in read["entries"]] == ["gloo:broadcast", "gloo:barrier"]
    assert read["entries"][1]["input_sizes"] == []
    with open(path, "rb") as f:
        assert pickle.load(f)["pg_status"]["0"]["last_completed_collective"] == 2


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are installed from the main thread")
def test_sigusr1_dumps_and_calls_the_handler_installed_before(tmp_path):
    earlier = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: earlier.append(signum))
    try:
        recorder, track = _recorder()
        recorder.configure(Config(flight_recorder=5, flight_recorder_dir=str(tmp_path)), 1,
                           "job")
        track.issue("all_reduce", "x", (1,), "int64").done()
        os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler at its next bytecode
        path = tmp_path / f"{FILE_PREFIX}1"
        assert path.exists()
        assert earlier == [signal.SIGUSR1]
        with open(path, "rb") as f:
            assert [e["gradsync_name"] for e in pickle.load(f)["entries"]] == ["x"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_configure_resizes_and_picks_the_directory():
    recorder, track = _recorder(entries=5)
    for i in range(5):
        track.issue("all_reduce", f"t{i}")
    recorder.configure(Config(flight_recorder=3, flight_recorder_dir="off"), 0, "j/1")
    assert [r.name for r in recorder.records()] == ["t2", "t3", "t4"]
    assert recorder.directory == ""  # off: dumps on request only
    recorder.configure(Config(flight_recorder=3), 0, "j/1")
    assert recorder.directory.endswith(os.path.join("gradsync-flight", "j_1"))


# ----------------------------------------------------------------------------- stall reports
def test_an_answer_shows_a_sleeping_threads_frame_and_not_the_answering_one():
    from gradsync.liveness import stall

    asleep, wake = threading.Event(), threading.Event()

    def napping_in_user_code():
        asleep.set()
        wake.wait(30)

    napper = threading.Thread(target=napping_in_user_code, name="user-napper")
    napper.start()
    try:
        assert asleep.wait(30)
        said = stall.answer("no such job", 7)
    finally:
        wake.set()
        napper.join()
    assert said["seq"] is None and said["issued"] is None  # no World of that job here
    assert "thread user-napper:" in said["stacks"], said["stacks"]
    assert re.search(r"in napping_in_user_code\n\s+wake\.wait\(30\)", said["stacks"])
    assert "in answer\n" not in said["stacks"]  # the answering thread leaves itself out


def test_a_report_of_many_ranks_shows_eight_of_each_and_lists_the_rest():
    import types

    from gradsync.liveness import stall

    world = types.SimpleNamespace(root=("job", list(range(20))), rank=0,
                                  config=types.SimpleNamespace(timeout=300.0))
    answers = {r: {"host": "h", "pid": r, "seq": 4 if r % 2 else 5, "in": "allreduce",
                   "last": None, "running": [], "failed": [], "stacks": "thread MainThread:\n"}
               for r in range(1, 20)}
    answers[3] = {"error": "TimeoutError: timed out", "host": "h", "pid": 3}
    text = stall.words(world, 5, "allreduce 'x'", 31.0, answers)
    odd = [r for r in range(1, 20, 2)]
    assert f"not arrived: ranks {odd}" in text, text  # behind, or did not answer (rank 3)
    assert "rank 3 on host h (pid 3): did not answer (TimeoutError: timed out)" in text
    assert text.count("NOT ARRIVED") == 7 and text.count("its stacks:") == 7, text
    assert "and 2 more not arrived: ranks [17, 19]" in text, text
    assert "and 1 more arrived: ranks [18]" in text, text


# ----------------------------------------------------------------------------- jobs
# The NumPy API's job in the default tier; the Horovod API's (its own road: names, not
# collective numbers) in the slow one, as is the torch backend's mismatch below.
@pytest.mark.multiprocess
@pytest.mark.parametrize("api", ["numpy", pytest.param("horovod", marks=pytest.mark.slow)])
def test_a_rank_asleep_in_user_code_is_named_with_its_stack_by_every_waiting_rank(api, tmp_path):
    threshold = 1.5
    env = {"GRADSYNC_STALL_REPORT": str(threshold)}
    if api == "numpy":
        r = forked_jobs.job(3, "flight.py", "stall", str(tmp_path), timeout=90, env=env,
                            lean=True)
    else:
        r = launch(3, "flight.py", "hvd-stall", str(tmp_path), timeout=90, env=env)
    assert r.returncode == 0, r
    surveyors = set()
    for rank in (0, 2):
        seconds = float(re.search(rf"SECONDS rank={rank} ([\d.]+)", r.output).group(1))
        assert threshold <= seconds <= threshold + 5, r
        report = "\n".join(re.findall(rf"REPORT rank={rank} (.*)", r.output))
        assert "not arrived: ranks [1]" in report, report
        # one waiting rank surveys, the other logs its survey (saying so)
        surveyor = int(re.search(r"stall report: rank (\d) has waited", report).group(1))
        surveyors.add(surveyor)
        if surveyor != rank:
            assert f"(rank {rank} waits in it too; the survey above is another rank's)" in report
        other = 2 if surveyor == 0 else 0  # the waiting rank the survey asked
        if api == "numpy":
            assert re.search(r"rank 1 on host \S+ \(pid \d+\): NOT ARRIVED, at collective #1 ",
                             report), report
            assert "last completed: #1 all_reduce 'warm-up'" in report, report
            # the rank that waits too is shown as arrived, without its stacks
            assert re.search(rf"rank {other} on host \S+ \(pid \d+\): at collective #2 ",
                             report), report
        else:
            assert "in Horovod API operation 'allreduce.step' (global)" in report, report
            assert re.search(r"rank 1 on host \S+ \(pid \d+\): NOT ARRIVED, has not issued it",
                             report), report
            assert "last completed: #1 all_reduce 'allreduce.warm-up'" in report, report
            assert re.search(rf"rank {other} on host \S+ \(pid \d+\): has issued it", report)
        # its stack, taken by rank 1 itself: the user's function asleep
        assert re.search(r"in sleepy_user_function\n\s+time\.sleep\(0\.05\)", report), report
        assert report.count("its stacks:") == 1, report
    assert len(surveyors) == 1, surveyors  # one survey for the stall, not one per waiting rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("api", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_torchs_analyzer_names_a_mismatched_collective_and_its_rank(api, tmp_path):
    dumps = tmp_path / "dumps"
    env = {"GRADSYNC_FLIGHT_RECORDER_DIR": str(dumps)}
    if api == "numpy":
        r = forked_jobs.job(3, "flight.py", "mismatch", timeout=90, env=env, lean=True)
        assert r.returncode == 0, r
        assert sorted(re.findall(r"RESULT rank=(\d) CollectiveMismatchError", r.output)) == \
            ["0", "1", "2"], r
        sequence = 4  # after the warm-up
    else:
        ranks = spawn(3, "flight.py", "torch-mismatch", timeout=90, env=env)
        for rank in ranks:
            assert rank.returncode == 0 and f"RESULT rank={rank.rank} " in rank.output, rank
            assert "no error" not in rank.output, rank
        sequence = 3
    assert sorted(os.listdir(dumps)) == [f"{FILE_PREFIX}{rank}" for rank in range(3)]
    analyzed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
        capture_output=True, text=True, timeout=120)
    said = analyzed.stdout + analyzed.stderr
    assert analyzed.returncode == 0, said
    # the first two allreduces match; the third is the mismatch, rank 1 its culprit, with both
    # sizes
    assert f"Collective sequence number: {sequence} has errors" in said, said
    assert "collective: gloo:all_reduce" in said, said
    assert "collective state: started" in said, said  # it began (and failed): the lane's marks
    assert re.search(r"Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input "
                     r"sizes: '\[\[8\]\]' does not match found input sizes: '\[\[12\]\]'",
                     said), said
    assert "Culprit rank 0" not in said and "Culprit rank 2" not in said, said
