"""Parameter-server training in real processes: every mode, failures, checkpoints.

The rank side is tests/ranks/ps_check.py (one scenario per run); pure logic (sharding, the
consistency clock, factor layout) is tested here without processes.

A parameter server serves one job and ends, so each scenario used to be a job of its own:
``gradsync run --servers``, its workers and servers, every one an interpreter importing torch,
for a second or two of training. Now the default tier's scenarios run one after the other in
the ranks of one job (tests/service_jobs.py), each a job of its own under its own job id: the
ranks are started as torchrun starts them (``harness.spawn``), so that a server rank runs the
script too and serves from ``init()`` (the road of the foreign launchers, docs/ps.md), then goes
on to the next scenario. Each scenario runs on as many of the job's six ranks as its own job
had (``GRADSYNC_SERVERS`` of them servers, set for it): 1 worker and 1 server (``parity`` SGD,
``factor``, then a client in a job without servers, whose error ends its ranks), 2 and 1
(``bf16``, ``mismatch``, then ``killserver``, whose kill ends its ranks), 4 and 2 (the modes
``ssp``, ``async``, ``backup``), 3 and 1 (a worker killed in sync mode) and 2 and 3 over TCP
(``save``, then ``restore``). The tests of a worker killed in async and backup mode read the
launcher's status (the job goes on without it, and ends with its status) and keep a
``gradsync run --servers`` job each. The slow tier's cases (four parity runs, the factored
gradients of 3 workers and 2 servers, sync at 2 and 1 and ssp at 3 and 1) share a job of
their own of five ranks the same way (``slow_job``).
"""

import threading
import time

import numpy as np
import pytest

from gradsync.ps import factors as fc
from gradsync.ps.consistency import Clock
from gradsync.ps.sharding import bounds, offsets

import harness
import service_jobs as S


# --- pure logic ------------------------------------------------------------------------------

@pytest.mark.parametrize("total, servers", [(0, 1), (5, 3), (1016, 2), (1000, 3), (64, 4),
                                            (10 ** 6 + 7, 4)])
def test_bounds_cover_the_vector_in_nearly_equal_aligned_slices(total, servers):
    b = bounds(total, servers)
    assert b[0] == 0 and b[-1] == total and b == sorted(b) and len(b) == servers + 1
    sizes = np.diff(b)
    assert sizes.max() - sizes.min() <= 16 * 2 or total < 16 * servers
    assert all(x % 16 == 0 for x in b[:-1])


def test_offsets_and_errors():
    assert offsets([10, 1000, 6]) == [0, 10, 1010, 1016]
    with pytest.raises(ValueError):
        bounds(10, 0)
    with pytest.raises(ValueError):
        offsets([-1])


@pytest.mark.parametrize("lo, hi", [(0, 4096), (0, 100), (100, 2000), (37, 38), (2000, 4096)])
def test_factored_gradient_equals_dense_on_any_slice(lo, hi):
    """A server holding [lo, hi) of the flat vector forms exactly its part of delta^T x."""
    rng = np.random.default_rng(0)
    numels = [10, 48 * 40, 48, 2118]  # the 48 x 40 weight at 10..1930, cut anywhere
    factored = [{"tensor": 1, "out": 48, "in": 40, "max_rows": 8}]
    layers = fc.layout(factored, numels, lo, hi)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    d = rng.standard_normal((5, 48)).astype(np.float32)
    region = np.zeros(fc.slot_floats(layers), np.float32)
    rows = fc.pack(layers, region, {1: x}, {1: d})
    grad = np.full(hi - lo, 7.0, np.float32)
    fc.expand(layers, region, rows, grad, lo)
    dense = np.full(4096, 7.0, np.float32)
    dense[10:10 + 48 * 40] = (d.T @ x).reshape(-1)
    np.testing.assert_allclose(grad, dense[lo:hi], rtol=1e-5, atol=1e-5)
    if layers:
        assert rows == [5]
        assert fc.pack(layers, region, {1: np.zeros((9, 40), np.float32)}, {1: d}) == [fc.DENSE]


def _clock(mode, workers=3, **kw):
    applied = []
    clock = Clock(mode, workers, lambda ws, avg: applied.append((sorted(ws), avg)),
                  timeout=5, **kw)
    return clock, applied


def _push_later(clock, worker, tag, out):
    def push():
        try:
            out.append((worker, clock.push(worker, tag)))
        except Exception as exc:  # checked by the test through what is (not) in ``out``
            errors.append(exc)

    errors = []
    t = threading.Thread(target=push)
    t.start()
    return t


def _waiting(clock, clocks, threads, seconds: float = 10.0) -> bool:
    """Whether the pushes in ``threads`` reach their wait: the clock counts them (``clocks``)
    and has let go of its lock (``counters`` takes it), while each thread is still running:
    so each push is inside the clock's wait, not merely slow to start or already done."""
    deadline = time.monotonic() + seconds
    while clock.counters()["clocks"] != clocks and time.monotonic() < deadline:
        time.sleep(0.005)
    return clock.counters()["clocks"] == clocks and all(t.is_alive() for t in threads)


def test_sync_round_waits_for_every_worker_and_averages():
    clock, applied = _clock("sync")
    out = []
    threads = [_push_later(clock, w, 0, out) for w in (2, 0)]
    assert _waiting(clock, [1, 0, 1], threads), (clock.counters(), out)
    assert applied == [] and not out
    threads.append(_push_later(clock, 1, 0, out))
    for t in threads:
        t.join(5)
    assert applied == [([0, 1, 2], True)]
    assert sorted(w for w, _ in out) == [0, 1, 2] and all(r["version"] == 1 for _, r in out)


def test_backup_closes_at_k_and_drops_the_late_gradient():
    clock, applied = _clock("backup", backup=2)
    out = []
    for t in [_push_later(clock, w, 0, out) for w in (0, 2)]:
        t.join(5)
    assert applied == [([0, 2], True)]
    assert clock.push(1, 0) == {"version": 1, "applied": False}
    assert clock.counters()["dropped"] == 1


def test_async_applies_at_once_and_measures_staleness():
    clock, applied = _clock("async")
    assert clock.push(0, 0)["version"] == 1
    assert clock.push(1, 0)["version"] == 2
    assert clock.push(2, 0)["version"] == 3
    assert clock.counters()["max_staleness"] == 2 and len(applied) == 3


def test_ssp_never_lets_a_worker_run_more_than_s_ahead():
    clock, applied = _clock("ssp", workers=2, staleness=1)
    assert clock.push(0, 0)["applied"]            # clock 1 vs 0: within the bound
    out = []
    t = _push_later(clock, 0, 1, out)             # clock 2 vs 0: must wait
    assert _waiting(clock, [2, 0], [t]), (clock.counters(), out)
    assert not out
    clock.push(1, 0)                              # the slow worker catches up one clock
    t.join(5)
    assert out and clock.counters()["max_clock_gap"] <= 1


def test_a_lost_worker_fails_sync_and_is_dropped_elsewhere():
    clock, _ = _clock("sync")
    out = []
    threads = [_push_later(clock, w, 0, out) for w in (0, 1)]
    assert _waiting(clock, [1, 1, 0], threads), (clock.counters(), out)
    clock.leave(2, died=True)  # wakes both waiting pushes
    for t in threads:
        t.join(5)
    assert not out  # both pushes raised
    with pytest.raises(Exception, match="worker 2 was lost"):
        clock.push(0, 0)
    backup, applied = _clock("backup", backup=3)
    backup.leave(2, died=True)
    out = []
    for t in [_push_later(backup, w, 0, out) for w in (0, 1)]:
        t.join(5)
    assert applied == [([0, 1], True)] and backup.counters()["lost"] == [2]


def test_clock_arguments_are_checked():
    with pytest.raises(ValueError, match="mode must be"):
        _clock("lockstep")
    with pytest.raises(ValueError, match="backup"):
        _clock("backup", backup=4)
    with pytest.raises(ValueError, match="staleness"):
        _clock("ssp")


# --- through the launcher --------------------------------------------------------------------

def _ps(workers, servers, *args, timeout=90, env=None):
    return harness.launch(workers, "ps_check.py", *args, timeout=timeout, env=env,
                          launcher_args=("--servers", str(servers)))


TIMEOUT = 420
"""The shared job's deadline: its scenarios' own (90 s each alone, mostly the start-up paid once
now) and room for a loaded machine."""


class Shared:
    """A shared job of ``size`` ranks started as torchrun starts them (``S.spawn``), whose
    scenarios each run on some of them (``entry``'s ``ranks``): each rank's end, and each
    scenario's output."""

    def __init__(self, tmp, size, scenarios):
        self.ranks_of = {e["tag"]: e["ranks"] for e in scenarios}
        self.all = S.spawn(size, scenarios, tmp, timeout=TIMEOUT)

    def ranks(self, tag) -> list:
        """The job's ranks (``harness.Rank``) that ran scenario ``tag``, in its rank order."""
        return [self.all[r] for r in self.ranks_of[tag]]

    def output(self, tag) -> str:
        """What scenario ``tag`` printed on every rank (stdout and stderr), rank by rank."""
        return "".join(S.section(r.output, tag) for r in self.ranks(tag))

    def ran(self, tag) -> str:
        """Scenario ``tag``'s output, once it returned on every rank: what the status 0 of
        its own job said."""
        assert all(S.done(r.output, tag) == 1 for r in self.ranks(tag)), \
            f"scenario {tag} did not run to its end on every rank:\n" + "\n".join(self.all)
        return self.output(tag)


def _scenario(tag, ranks, servers, *args, env=None, **kw):
    """Scenario ``tag`` (``ps_check.py ARGS``) on the job's ``ranks``, the last ``servers`` of
    them parameter servers."""
    return S.entry(tag, "ps_check.py", *args, ranks=ranks,
                   env={"GRADSYNC_SERVERS": str(servers), **(env or {})}, **kw)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job of 6 ranks for every shared scenario, each on as many ranks as its own job had
    (workers + servers): 1 worker and 1 server (ranks 3, 4): ``parity`` (SGD), ``factor``;
    2 and 1 (ranks 0-2): ``bf16``, ``mismatch`` (its workers' exit 3 ends the scenario, not
    the ranks); 4 and 2 (all six): the modes ``ssp``, ``async`` and ``backup``, 12 steps each;
    3 and 1 (ranks 3, 4, 5 and 0): ``killsync``, worker 2 (rank 5, its last) killed in sync
    mode, the others' exit 3 ending the scenario; 2 and 3 over TCP (ranks 0-4): ``save``, then
    ``restore`` (both in ``checkpoint``); then, last for their ranks, ``noservers`` (ranks 3,
    4): ``parity`` with ``GRADSYNC_SERVERS=0``, where both ranks are workers and their clients
    fail, and ``killserver`` (ranks 0-2: the server is killed). Ranks 0-2 and 3-4 run their
    first scenarios at once."""
    tmp = tmp_path_factory.mktemp("ps")
    (tmp / "checkpoint").mkdir()
    one_one, two_one, two_three = [3, 4], [0, 1, 2], [0, 1, 2, 3, 4]
    tcp = {"GRADSYNC_TRANSPORT": "tcp"}
    found = Shared(tmp, 6, [
        _scenario("parity", one_one, 1, "parity", "sgd"),
        _scenario("factor", one_one, 1, "factor"),
        _scenario("bf16", two_one, 1, "bf16"),
        _scenario("mismatch", two_one, 1, "mismatch", go_on=True),
        *[_scenario(mode, list(range(6)), 2, "mode", mode, 12)
          for mode in ("ssp", "async", "backup")],
        _scenario("killsync", [3, 4, 5, 0], 1, "kill", "sync", go_on=True),
        *[_scenario(a, two_three, 3, a, tmp / "checkpoint", env=tcp)
          for a in ("save", "restore")],
        _scenario("noservers", one_one, 0, "parity", "sgd"),
        _scenario("killserver", two_one, 1, "killserver")])
    found.directory = tmp / "checkpoint"
    return found


def _tag(*case) -> str:
    """A slow case's scenario tag: ``parity-2-3-adam-tcp``, ``factor-3-2``, ``ssp-3-1``."""
    return "-".join(map(str, case))


SLOW_PARITY = [(2, 3, "adam", "tcp"), (2, 1, "adam", "auto"), (3, 2, "sgd", "auto"),
               (3, 1, "sgd", "tcp")]
"""The slow tier's parity cases: workers, servers, optimizer, transport."""


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory):
    """The slow tier's cases, each a job of its own under ``gradsync run --servers`` before
    (5 to 8 s each of an idle machine's slow tier, most of it the start-up), in one job of
    five ranks: each on the first workers + servers of them, the last ``servers`` of those
    servers, one after the other: the parity runs of ``SLOW_PARITY``, ``factor`` at 3 and 2,
    the modes ``sync`` at 2 and 1 and ``ssp`` at 3 and 1 (12 steps each)."""
    def first(workers, servers):
        return list(range(workers + servers))

    return Shared(tmp_path_factory.mktemp("ps-slow"), 5, [
        *[_scenario(_tag("parity", w, s, o, t), first(w, s), s, "parity", o,
                    env={"GRADSYNC_TRANSPORT": t}) for w, s, o, t in SLOW_PARITY],
        _scenario(_tag("factor", 3, 2), first(3, 2), 2, "factor"),
        *[_scenario(_tag(mode, w, s), first(w, s), s, "mode", mode, 12)
          for mode, w, s in (("sync", 2, 1), ("ssp", 3, 1))]])


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, servers, optimizer, transport", [
    (1, 1, "sgd", "auto"),
    # slow tier: (2, 3, adam, tcp) is also checked by the checkpoint test's save run, which
    # is a parity run of that case (tests/ranks/ps_check.py, ``checkpoint``); the same parity
    # with other counts (the default tier keeps sgd and adam, one and several servers, both
    # transports)
    pytest.param(2, 3, "adam", "tcp", marks=pytest.mark.slow),
    pytest.param(2, 1, "adam", "auto", marks=pytest.mark.slow),
    pytest.param(3, 2, "sgd", "auto", marks=pytest.mark.slow),
    pytest.param(3, 1, "sgd", "tcp", marks=pytest.mark.slow),
])
def test_sync_training_equals_the_local_optimizer(workers, servers, optimizer, transport,
                                                  request):
    if (workers, servers, optimizer, transport) == (1, 1, "sgd", "auto"):
        out = request.getfixturevalue("job").ran("parity")  # its job's status 0
    else:  # the slow tier's job
        out = request.getfixturevalue("slow_job").ran(
            _tag("parity", workers, servers, optimizer, transport))
    assert out.count("steps match") == workers, out
    # sync's guarantee (test_each_mode_keeps_its_guarantee's sync case, checked here too)
    assert "sync: counters hold" in out, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, servers", [(1, 1), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_factored_linear_gradients_train_identically_with_less_traffic(workers, servers,
                                                                        request):
    if (workers, servers) == (1, 1):
        out = request.getfixturevalue("job").ran("factor")  # its job's status 0
    else:  # the slow tier's job
        out = request.getfixturevalue("slow_job").ran(_tag("factor", workers, servers))
    assert out.count("steps match") == workers, out


@pytest.mark.multiprocess
def test_a_bf16_model_trains_on_float32_master_weights(job):
    out = job.ran("bf16")  # its job's status 0
    assert out.count("bf16 ok") == 2, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, workers, servers", [
    # sync: the parity runs check these counters too (test_sync_training_equals_the_local_
    # optimizer's 1 worker on 1 server; the checkpoint test's save run, 2 workers, the last
    # one slow, on 3 servers), so this run is in the slow tier. backup, async and ssp at 4
    # workers on 2 servers share a job (``job``'s six ranks): backup was 3 workers on 1 server
    # and async 3 on 2, each a job of its own.
    pytest.param("sync", 2, 1, marks=pytest.mark.slow), ("backup", 4, 2), ("async", 4, 2),
    pytest.param("ssp", 3, 1, marks=pytest.mark.slow), ("ssp", 4, 2),
])
def test_each_mode_keeps_its_guarantee(mode, workers, servers, request):
    if (workers, servers) == (4, 2):
        out = request.getfixturevalue("job").ran(mode)  # its job's status 0
    else:  # the slow tier's job
        out = request.getfixturevalue("slow_job").ran(_tag(mode, workers, servers))
    assert f"{mode}: counters hold" in out, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["async", "backup"])
def test_a_killed_worker_is_dropped_and_training_goes_on(mode):
    r = _ps(3, 1, "kill", mode)
    assert r.returncode == 137, r  # the launcher reports the dead worker's status at the end
    assert "worker 0 trained its 10 steps" in r.output, r
    assert "'lost': [2]" in r.output, r
    assert "lost worker 2" in r.output and f"training goes on without it ({mode} mode)" in \
        r.output, r
    assert "PeerLostError" not in r.output, r


@pytest.mark.multiprocess
def test_a_killed_worker_in_sync_mode_fails_the_others_naming_it(job):
    # 3 workers and 1 server of the shared job (``killsync``: job ranks 3, 4, 5 and 0); worker
    # 2 (job rank 5) SIGKILLs itself, its last scenario. The other two fail: each ends the
    # scenario with its sys.exit(3) (``go_on``), where their job of their own failed.
    workers = job.ranks("killsync")[:2]
    for w, rank in enumerate(workers):
        out = S.section(rank.output, "killsync")
        assert f"worker {w}: PeerLostError peer=2: worker 2 was lost" in out, rank
        assert "killsync| suite: exit 3" in out, rank
    assert job.ranks("killsync")[2].returncode == -9, job.ranks("killsync")[2]


@pytest.mark.multiprocess
def test_a_killed_server_gives_every_worker_a_clear_error(job):
    # The last scenario of its ranks (0-2) in the shared job: their ends are its.
    ranks = job.ranks("killserver")
    assert ranks[2].returncode == -9 or ranks[2].returncode == 137, ranks[2]
    for w in (0, 1):
        out = S.section(ranks[w].output, "killserver")
        assert ranks[w].returncode == 3, ranks[w].output[-3000:]
        assert "PeerLostError peer=2" in out, ranks[w].output[-3000:]
        assert "parameter server 0 (rank 2)" in out, ranks[w].output[-3000:]


@pytest.mark.multiprocess
def test_checkpoint_restores_the_same_parameters_and_continues_identically(job):
    # The save run is also test_sync_training_equals_the_local_optimizer's 2-worker Adam case
    # on 3 servers over TCP: every step against torch.optim.Adam, then sync's counters. Save
    # and restore are two scenarios of the shared job, each a job of its own.
    out = job.ran("save")  # its job's status 0
    assert out.count("5 steps match adam") == 2, out
    assert "sync: counters hold" in out, out
    # (Listed after the restore, which reads the directory and writes nothing to it.)
    assert sorted(p.name for p in job.directory.iterdir()) == \
        ["p3.npy", "p5.npy", "server-0.npz", "server-1.npz", "server-2.npz"]
    out = job.ran("restore")  # its job's status 0
    assert "restore: ok" in out, out


@pytest.mark.multiprocess
def test_workers_with_different_models_get_an_error_naming_the_difference(job):
    out = job.output("mismatch")  # every rank's, whatever its status (none was checked)
    assert "CollectiveMismatchError" in out and "numels" in out, out
    assert "PeerLostError" in out, out  # the other worker learns that it left


@pytest.mark.multiprocess
def test_a_parameter_client_without_servers_is_a_config_error(job):
    # The last scenario of its ranks (3, 4) in the shared job: two ranks in a job without
    # servers (GRADSYNC_SERVERS=0), where it was one rank under gradsync run without --servers.
    for rank in job.ranks("noservers"):
        out = S.section(rank.output, "noservers")
        assert rank.returncode == 1 and "has no parameter servers" in out, rank
