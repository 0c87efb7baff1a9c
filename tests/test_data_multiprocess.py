"""Data servers through the real launcher: exactly once, the seeded order, cache hits, resume.

The rank side is tests/ranks/data_check.py: every worker checks each value it receives
against the closed form (the sample's id plus its augmentation for the epoch) and writes the
sample ids it received, in order, to a file; these tests then check the files against the plan
(``gradsync.data.plan``), which is the reference for the order.

Most default-tier scenarios share a job with the others of their shape (tests/service_jobs.py:
each scenario a job of its own under its own job id, in the same ranks): 4 workers and 1 data
server (``count``, then ``broken``, whose failing data server ends the job), 3 and 4
(``stop``, then ``lose``, whose kills end it) and 2 and 3 (``count``, over TCP, ``shrink``,
``resume`` from the 3-and-4 job's ``stop``, and test_data_liveness.py's slow server); the last
two are tests/data_jobs.py's, shared with test_data_liveness.py. The 1-and-1 count and the
killed server of 3 and 3 keep a job each (no other scenario of their shape; at 2 workers the
killed server leaves nothing in /dev/shm for the launcher to clear, which that test checks).

The slow tier's scenarios that leave their job usable share jobs of their own shape too: 1 and
1, 2 and 2, 3 and 2, each running the global order plain and packed (and 2 and 2 the packed
count, 3 and 2 the count first); those that end their job (a killed server) or resume another
job's state keep a launch each.
"""

import json
import os

import pytest

from gradsync.data import plan as P

import data_jobs
import harness
import service_jobs as S

SAMPLES, BATCH, SEED = 103, 4, 7
TIMEOUT = data_jobs.TIMEOUT


def _run(workers, servers, scenario, directory, arg, timeout=120, env=None):
    r = harness.launch(workers, "data_check.py", scenario, str(directory), str(arg),
                       timeout=timeout, env=env,
                       launcher_args=("--data-servers", str(servers)))
    assert r.returncode == 0, str(r)
    return r


@pytest.fixture(scope="module")
def four_one(tmp_path_factory):
    """4 workers, 1 data server: ``count``, then ``broken`` (its data server's status 1 ends
    the job, as it ended the job of its own)."""
    return S.DataJob(tmp_path_factory.mktemp("data-4-1"), 4, 1,
                     [S.data_entry("count", "count", 2),
                      S.data_entry("broken", "broken", BROKEN)], timeout=TIMEOUT)


@pytest.fixture
def three_four(tmp_path_factory):
    """3 workers, 4 data servers: ``stop``, then ``lose`` (tests/data_jobs.py)."""
    return data_jobs.three_four(tmp_path_factory)


@pytest.fixture
def two_three(tmp_path_factory):
    """2 workers, 3 data servers: ``count``, ``tcp``, ``shrink``, ``resume`` of ``three_four``'s
    ``stop``, then test_data_liveness.py's ``slow`` (tests/data_jobs.py)."""
    return data_jobs.two_three(tmp_path_factory)


GLOBAL, PACK = {"GS_DATA_ORDER": "global"}, {"GS_DATA_COLLATE": "pack"}
"""The variables of the global order (``Loader(order="global")``) and of packed token
sequences (``collate.Pack``) in tests/ranks/data_check.py."""


def _global_orders() -> list[dict]:
    """One epoch in the global order, of plain samples (``global``) and of packed token
    sequences (``global-pack``): the two scenarios every shape of the global order's test runs."""
    return [S.data_entry("global", "count", 1, env=GLOBAL),
            S.data_entry("global-pack", "count", 1, env={**GLOBAL, **PACK})]


@pytest.fixture(scope="module")
def one_one(tmp_path_factory):
    """1 worker, 1 data server (slow tier): the global orders."""
    return S.DataJob(tmp_path_factory.mktemp("data-1-1"), 1, 1, _global_orders(),
                     timeout=TIMEOUT)


@pytest.fixture(scope="module")
def two_two(tmp_path_factory):
    """2 workers, 2 data servers (slow tier): the global orders, then two epochs of packed
    token sequences in the servers' order (``packed``)."""
    return S.DataJob(tmp_path_factory.mktemp("data-2-2"), 2, 2,
                     [*_global_orders(), S.data_entry("packed", "count", 2, env=PACK)],
                     timeout=TIMEOUT)


@pytest.fixture(scope="module")
def three_two(tmp_path_factory):
    """3 workers, 2 data servers (slow tier): ``count`` first (its servers' counters are the
    job's first: every sample decoded once, then served from the cache), then the global
    orders."""
    return S.DataJob(tmp_path_factory.mktemp("data-3-2"), 3, 2,
                     [S.data_entry("count", "count", 2), *_global_orders()], timeout=TIMEOUT)


SHARED = {(4, 1): "four_one", (2, 3): "two_three", (3, 2): "three_two"}
"""The count scenarios that run in a shared job, by (workers, servers)."""

BROKEN = 50
"""The sample that the ``broken`` scenario's dataset cannot read."""


def _received(directory, tag, workers):
    return [json.loads((directory / f"{tag}-{w}.json").read_text()) for w in range(workers)]


def _planned(epoch, servers, workers, worker, done=None):
    batches = P.worker_batches(P.plan(SAMPLES, BATCH, SEED, epoch, servers, workers, done),
                               worker)
    return [i for b in batches for i in b.ids.tolist()]


def _each_sample_once_as_planned(got, servers, workers):
    """Both epochs: every sample reached exactly one worker, each worker its planned batches."""
    for epoch in (0, 1):
        ids = [i for w in got for i in w[str(epoch)]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
        for w in range(workers):
            assert got[w][str(epoch)] == _planned(epoch, servers, workers, w)


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 3), pytest.param(3, 2, marks=[
    pytest.mark.slow]), (4, 1)])
def test_every_sample_reaches_exactly_one_worker_in_the_seeded_order(tmp_path, workers,
                                                                     servers, request):
    if (workers, servers) in SHARED:
        tmp_path = request.getfixturevalue(SHARED[workers, servers]).ran("count")
    else:
        _run(workers, servers, "count", tmp_path, 2)
    got = _received(tmp_path, "count", workers)
    _each_sample_once_as_planned(got, servers, workers)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [s["server"] for s in stats] == list(range(servers))
    # Epoch 0 decoded each sample once, on its own server; epoch 1 was served from the cache.
    assert sum(s["misses"] for s in stats) == SAMPLES
    assert sum(s["hits"] for s in stats) == SAMPLES
    assert [s["samples"] for s in stats] == [len(range(d, SAMPLES, servers))
                                             for d in range(servers)]
    # On one host every batch came by polling the stream's slot table: no take call at all.
    assert [s["takes"] for s in stats] == [0] * servers


@pytest.mark.multiprocess
def test_batches_read_over_tcp_arrive_exactly_once_as_over_shared_memory(two_three):
    # GRADSYNC_TRANSPORT=tcp: the workers read the slots through the servers' region
    # connections (the road between hosts) instead of mapping them. 2 workers, 3 data
    # servers (the shared job's).
    tmp_path = two_three.ran("tcp")
    got = _received(tmp_path, "count", 2)
    _each_sample_once_as_planned(got, 3, 2)
    # The road between hosts cannot map the slot table: every batch came on a take's reply
    # (no READ of the slot after it), several on one reply where they were ready (the
    # window, ``data_window``).
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [s["sent"] for s in stats] == [s["batches"] for s in stats]
    assert all(0 < s["takes"] <= s["sent"] for s in stats)
    assert sum(s["batches"] for s in stats) > 0


@pytest.mark.multiprocess
def test_a_sample_that_fails_to_prepare_is_raised_on_every_worker(four_one):
    # 4 workers, 1 data server (the shared job's last scenario). Sample 50 is in batch 7,
    # worker 3's second. The server's producer stops at it and flags every stream's slot
    # table; a worker that finds its next item missing fetches the message with a take. The
    # others raise it too, unless the server had prepared all of their batches before (it
    # may run ahead of a worker that started later).
    plan = P.plan(SAMPLES, BATCH, SEED, 0, 1, 4)
    assert [b.index for b in plan if BROKEN in b.ids] == [7]
    owner = [w for w in range(4) if 7 in [b.index for b in P.worker_batches(plan, w)]]
    assert owner == [3]
    r = four_one.result
    assert r.returncode == 1, str(r)  # the data server's status
    assert S.done(r.output, "broken") == 4, str(r)  # every worker wrote what it raised
    tmp_path = four_one.dirs["broken"]
    expected = ("GradsyncError: data server 0 could not prepare batch 7 of epoch 0: OSError: "
                "sample 50 is unreadable")
    assert (tmp_path / "broken-3.txt").read_text() == expected
    for w in range(3):
        assert (tmp_path / f"broken-{w}.txt").read_text() in (expected, "no error")


@pytest.mark.multiprocess
def test_a_resumed_job_continues_the_epoch_without_repeats_on_other_counts(three_four,
                                                                           two_three):
    # Stopped with 3 workers and 4 data servers (three_four's first scenario), resumed with
    # 2 and 3 (two_three's last), in the same directory.
    tmp_path = three_four.ran("stop")
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["epoch"] == 0 and state["done"]
    stopped = _received(tmp_path, "stop", 3)
    first = [i for w in stopped for i in w["0"]]
    assert len(first) == 3 * 3 * BATCH and len(set(first)) == len(first)
    # Another job, with 2 workers and 3 data servers, finishes epoch 0 and runs epoch 1.
    assert two_three.ran("resume") == tmp_path
    resumed = _received(tmp_path, "resume", 2)
    rest = [i for w in resumed for i in w["0"]]
    assert sorted(first + rest) == list(range(SAMPLES))
    done = P.unpack_mask(state["done"], SAMPLES)
    for w in range(2):
        assert resumed[w]["0"] == _planned(0, 3, 2, w, done)
        assert resumed[w]["1"] == _planned(1, 3, 2, w)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [
    "shm",
    # a launch of 3 workers and 3 data servers each: 20-30 s on 2 loaded cores
    pytest.param("tcp", marks=pytest.mark.slow),
    pytest.param("producers", marks=pytest.mark.slow)])
def test_a_killed_data_servers_share_is_served_by_the_others_exactly_once(tmp_path, how):
    # Same host (shm); over TCP (every stream has its next take in flight when server 0 is
    # killed); or with 2 producer processes per data server (the killed server's helpers
    # end with it; the others serve the same bytes as one producer would: every value is
    # checked against the closed form on the workers).
    env = {"tcp": {"GRADSYNC_TRANSPORT": "tcp"},
           "producers": {"GRADSYNC_DATA_WORKERS": "2"}}.get(how)
    r = harness.launch(3, "data_check.py", "killserver", str(tmp_path), "2", timeout=120,
                       launcher_args=("--data-servers", "3"), env=env)
    # The job runs to its end; its status is the killed server's (128 + SIGKILL).
    assert r.returncode == 137, str(r)
    # The killed server could not unlink its slot tables; the launcher removes what the job
    # left on this host once every rank has ended (run/processes.py, clear_shared_memory).
    # (this job's names only: another job may run beside it, tests/parallel.py)
    job = (tmp_path / "job").read_text()
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"gradsync-{job}"))
    assert left == [], left
    assert "rank 3 (data server 0)" in r.output and "the job ran to its end" in r.output, str(r)
    got = _received(tmp_path, "killserver", 3)
    for epoch in (0, 1):
        ids = [i for w in got for i in w[str(epoch)]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [s["server"] for s in stats] == [1, 2]  # the live ones
    if how == "tcp":
        assert all(s["sent"] >= s["takes"] > 0 for s in stats)
    elif how == "producers":
        assert all(s["producers"] == 2 for s in stats)


@pytest.mark.multiprocess
@pytest.mark.parametrize("point", ["dial", "regions", pytest.param("hello", marks=[
    pytest.mark.slow])])
def test_a_data_server_lost_at_any_moment_is_served_by_the_others_exactly_once(tmp_path,
                                                                               point, request):
    # 3 workers, 4 data servers; worker 0 SIGKILLs three of them, each while the other
    # workers are held at a moment (tests/ranks/data_check.py, ``lose``): server 0 while
    # workers 1 and 2 are inside Loader(...), before POINT of their connection to it (a dial
    # it refuses, a hello on a connection it reset, the read of its region table: the CI
    # failure); server 1 while every worker is inside state_dict(); server 2 between the
    # epochs. Server 3 serves the rest, and every sample still reaches exactly one worker.
    # dial and regions: one job (three_four's last scenario), worker 1 held before its dial
    # and worker 2 before its read of the region table; hello (slow): a job of its own.
    if point == "hello":
        r = harness.launch(3, "data_check.py", f"lose-{point}", str(tmp_path), "2",
                           timeout=120, launcher_args=("--data-servers", "4"))
    else:
        shared = request.getfixturevalue("three_four")
        r, tmp_path = shared.result, shared.dirs["lose"]
        # Every worker wrote what it received (and data server 3, the one left, ended too).
        assert S.done(r.output, "lose") >= 3, str(r)
    assert r.returncode == 137, str(r)
    for d in range(3):
        assert f"rank {3 + d} (data server {d})" in r.output, str(r)
    assert "the job ran to its end" in r.output, str(r)
    got = _received(tmp_path, "lose", 3)
    for epoch in (0, 1):
        ids = [i for w in got for i in w[str(epoch)]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
    # The state taken while server 1 was killed holds exactly what the workers had received
    # (each worker's batch in hand counts as delivered).
    state = json.loads((tmp_path / "state.json").read_text())
    before = [json.loads((tmp_path / f"before-{w}.json").read_text()) for w in range(3)]
    assert state["epoch"] == 0
    assert sorted(P.unpack_mask(state["done"], SAMPLES).nonzero()[0].tolist()) == \
        sorted(i for b in before for i in b)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [s["server"] for s in stats] == [3]  # the live one


@pytest.mark.multiprocess
def test_a_lost_workers_uncommitted_share_goes_to_the_new_generation_exactly_once(two_three):
    # 2 workers and 3 data servers (the shared job's): both commit after 3 batches and take 2
    # more; worker 1 is then lost, and worker 0 resets to the commit as a generation of one
    # worker.
    tmp_path = two_three.ran("shrink")
    record = json.loads((tmp_path / "shrink.json").read_text())
    state = record["state"]
    assert state["epoch"] == 0
    done = P.unpack_mask(state["done"], SAMPLES)
    assert done.sum() == 2 * 3 * BATCH  # the commit covers the batches before it, only
    after = record["after"]
    # The rest of epoch 0, the lost worker's share and both workers' uncommitted batches
    # included, planned for one worker; then epoch 1 whole.
    assert after["0"] == _planned(0, 3, 1, 0, done)
    assert sorted(after["0"] + P.order(SAMPLES, SEED, 0)[done[P.order(SAMPLES, SEED, 0)]]
                  .tolist()) == list(range(SAMPLES))
    assert after["1"] == _planned(1, 3, 1, 0)


def _steps(received, epoch, workers):
    """The samples in training order: step by step (each worker's next batch, by worker)."""
    mine = [received[w][str(epoch)] for w in range(workers)]
    batches = [[ids[a:a + BATCH] for a in range(0, len(ids), BATCH)] for ids in mine]
    return [i for k in range(len(batches[0])) for w in range(workers) if k < len(batches[w])
            for i in batches[w][k]]


@pytest.mark.multiprocess
@pytest.mark.slow  # three shared jobs: over a minute on a loaded 2-core machine
@pytest.mark.parametrize("collate", [None, "pack"])
def test_the_global_order_is_the_same_sequence_at_one_two_and_three_workers(collate, request):
    # Loader(order="global"): 1 worker and 1 data server, 2 and 2, 3 and 2 (a scenario of
    # each shape's shared job); the samples, step by step, are the epoch's permutation each
    # time (the default cut differs). With "pack", a language model's data: token sequences
    # packed into rows (collate.Pack).
    tag = "global-pack" if collate else "global"
    seen = {}
    for workers, job in ((1, "one_one"), (2, "two_two"), (3, "three_two")):
        directory = request.getfixturevalue(job).ran(tag)
        seen[workers] = _steps(_received(directory, "count", workers), 0, workers)
    assert seen[1] == seen[2] == seen[3] == P.order(SAMPLES, SEED, 0).tolist()


@pytest.mark.multiprocess
@pytest.mark.slow  # two launches: about a minute on a loaded 2-core machine
def test_a_job_resumed_at_other_counts_goes_on_with_the_global_sequence(tmp_path):
    env = {"GS_DATA_ORDER": "global"}
    _run(3, 1, "stop", tmp_path, 3, env=env)  # 3 steps of 3 workers: 9 batches delivered
    first = _steps(_received(tmp_path, "stop", 3), 0, 3)
    _run(2, 3, "resume", tmp_path, 2, env=env)
    resumed = _received(tmp_path, "resume", 2)
    assert first + _steps(resumed, 0, 2) == P.order(SAMPLES, SEED, 0).tolist()
    assert _steps(resumed, 1, 2) == P.order(SAMPLES, SEED, 1).tolist()


@pytest.mark.multiprocess
@pytest.mark.slow  # two epochs of the 2-and-2 job; the collate's server side is in the
# default tier (tests/test_data_collate.py)
def test_packed_token_sequences_reach_exactly_one_worker_per_sample(two_two):
    # 2 workers, 2 data servers, collate.Pack(8, separator=-1) over sequences of 0 to 7
    # tokens: each worker checks every sample's tokens in the rows (tests/ranks/data_check.py,
    # ``receive_packed``); here every sample is counted once per epoch, in the plan's order.
    got = _received(two_two.ran("packed"), "count", 2)
    _each_sample_once_as_planned(got, 2, 2)
