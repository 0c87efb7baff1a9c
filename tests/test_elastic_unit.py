"""Elastic pieces without processes: the sampler's exactly-once split, state semantics,
generations in a store, discovery output and the launcher's options."""

import itertools
import os
import re
import types

import pytest
import torch

from gradsync.elastic import ObjectState
from gradsync.elastic.membership import Control, ElasticJobFailed, ExcludedError, generation_job
from gradsync.run import cli
from gradsync.run.elastic import ElasticSpec, Host, _ElasticJob, _slots, _Worker, \
    parse_discovered
from gradsync.run.launcher import LaunchSpec
from gradsync.run.processes import Output
from gradsync.torch.elastic import sampler as sampler_module
from gradsync.torch.elastic import ElasticSampler


def as_rank(monkeypatch, rank, size):
    monkeypatch.setattr(sampler_module, "gs", types.SimpleNamespace(
        rank=lambda: rank, size=lambda: size, is_initialized=lambda: True))


def one_pass(monkeypatch, sampler, size, batches=None):
    """Each rank's batches of one pass (stopping after ``batches`` steps), recorded."""
    per_rank = []
    for rank in range(size):
        as_rank(monkeypatch, rank, size)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        per_rank.append([indices[i:i + sampler.batch_size]
                         for i in range(0, len(indices), sampler.batch_size)])
    steps = len(per_rank[0])
    assert all(len(b) == steps for b in per_rank)  # every rank runs the same number of steps
    taken = steps if batches is None else min(batches, steps)
    consumed = [i for k in range(taken) for r in range(size) for i in per_rank[r][k]]
    if taken:
        sampler.record_batch(taken - 1, sampler.batch_size)
    return consumed


@pytest.mark.parametrize("n, batch, sizes", [
    (96, 4, [4, 3]), (100, 3, [3, 1, 4]), (10, 2, [2, 1]), (7, 4, [4, 2]), (0, 2, [3, 2]),
])
def test_sampler_sees_every_sample_once_across_resizes(monkeypatch, n, batch, sizes):
    sampler = ElasticSampler(list(range(n)), batch_size=batch, seed=3)
    seen = []
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        before = sampler.processed
        got = one_pass(monkeypatch, sampler, size, None if last else 2)
        if not last:
            assert sampler.processed == before + min(n - before, 2 * size * batch)
        seen += got
    # pads (at most size - 1, from the front of P) are the only repeats
    unique = set(seen)
    assert unique == set(range(n))
    assert len(seen) - len(unique) <= sizes[-1] - 1


def test_sampler_worked_example(monkeypatch):
    sampler = ElasticSampler(list(range(10)), shuffle=False, batch_size=2)
    as_rank(monkeypatch, 0, 2)
    assert list(sampler) == [0, 1, 4, 5, 8]
    as_rank(monkeypatch, 1, 2)
    assert list(sampler) == [2, 3, 6, 7, 9]
    sampler.record_batch(0)
    assert sampler.processed == 4
    as_rank(monkeypatch, 0, 1)
    assert list(sampler) == [4, 5, 6, 7, 8, 9]


def test_sampler_state_round_trips_and_epochs_reshuffle(monkeypatch):
    as_rank(monkeypatch, 0, 1)
    a = ElasticSampler(list(range(20)), seed=1, batch_size=5)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(20))
    a.record_batch(1)
    b = ElasticSampler(list(range(20)), seed=1, batch_size=5)
    b.load_state_dict(a.state_dict())
    assert list(b) == list(a) and len(list(b)) == 10


def test_object_state_commit_restore_sync():
    sent = []

    def bcast(obj, root_rank=0, name=None):
        sent.append(obj)
        return {"epoch": 7, "batch": 0}

    state = ObjectState(bcast, lambda: 1, epoch=0, batch=0)
    state.epoch, state.batch = 2, 5
    state.commit()  # not in an elastic job: save only, no broadcast
    state.batch = 9
    state.restore()
    assert (state.epoch, state.batch) == (2, 5)
    state.sync()
    assert sent == [{"epoch": 2, "batch": 5}] and (state.epoch, state.batch) == (7, 0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.on_reset()
    assert calls == [1]


def test_torch_state_restores_model_and_optimizer():
    from gradsync.torch.elastic import TorchState

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = TorchState(model, optimizer, epoch=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state.epoch = 1
    assert not torch.equal(model.weight, before["weight"])
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert optimizer.state_dict()["state"] == {} and state.epoch == 0


def test_generations_in_the_store():
    from torch.distributed import HashStore

    control = Control(HashStore(), "job", 5.0)
    assert control.generation() == -1
    control.publish(0, [{"id": "a[0]", "host": "a"}, {"id": "b[1]", "host": "b"}])
    assert control.generation() == 0 and control.wait_newer(-1, 0.0) == 0
    assert [m["id"] for m in control.members(0)] == ["a[0]", "b[1]"]
    control.abort(0, "gone", 1)
    assert control.world_store(0).read_abort()["peer"] == 1
    assert generation_job("job", 3) == "job.e3"
    control.give_up("below --min-np")
    with pytest.raises(ElasticJobFailed, match="below --min-np"):
        control.wait_newer(0, float("inf"))


def test_discovery_output_and_slots():
    assert parse_discovered("a:2\n\nb\n127.0.0.1:3\n") == [Host("a", 2), Host("b", 1),
                                                            Host("127.0.0.1", 3)]
    for bad in ("a:0", "a:x", ":2"):
        with pytest.raises(ValueError, match="host:slots"):
            parse_discovered(bad)
    members = [_Worker(f"{h}[{i}]", h, None, i) for i, h in enumerate("aaba")]
    slots = _slots(members)
    assert [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots] == [(0, "a", 0, 3, 0, 2), (1, "a", 1, 3, 0, 1),
                                (2, "b", 0, 1, 1, 2), (3, "a", 2, 3, 0, 1)]


def test_elastic_options():
    parser = cli.build_parser()
    args = parser.parse_args(["run", "-np", "4", "--min-np", "2", "--host-discovery-script",
                              "./hosts.sh", "--reset-limit", "3", "python", "t.py"])
    spec = cli._elastic_spec(args.run_parser, args)
    assert (spec.min_np, spec.reset_limit, spec.discovery_script, spec.elastic_timeout,
            spec.blacklist_cooldown) == (2, 3, "./hosts.sh", 600.0, None)
    assert spec.max_np > 1000  # no limit with a discovery script
    args = parser.parse_args(["run", "-np", "3", "--min-np", "2", "python", "t.py"])
    assert cli._elastic_spec(args.run_parser, args).max_np == 3
    with pytest.raises(ValueError, match="min-np"):
        ElasticSpec(min_np=3, max_np=2)


@pytest.mark.parametrize("argv, message", [
    (["run", "-np", "2", "--min-np", "1", "--servers", "1", "true"], "--servers cannot"),
    (["run", "-np", "2", "--host-discovery-script", "x", "-H", "a:2", "true"], "not both"),
    (["run", "-np", "2", "--min-np", "3", "true"], "min-np"),
])
def test_elastic_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


_pids = itertools.count(1000)


class _FakeRank:
    """A running worker process that records the signals the launcher sends it."""

    def __init__(self, host: str = "localhost"):
        self.signals = []
        self.proc = types.SimpleNamespace(poll=lambda: None, pid=next(_pids))
        self.slot, self.remote = types.SimpleNamespace(host=host), False
        self.command = ["python3", "train.py"]  # what a worker runs (launcher.Rank.command)

    def signal(self, signum):
        self.signals.append(signum)


@pytest.mark.parametrize("hosts", [True, False])
def test_a_failed_host_loses_every_worker_and_an_unlisted_host_its_workers(hosts, capfd):
    import io
    import signal

    spec = LaunchSpec(command=["true"], num_proc=6,
                      hosts=[Host("a", 3), Host("b", 2), Host("c", 1)] if hosts else ())
    job = _ElasticJob(spec, ElasticSpec(min_np=1, max_np=6), Output(True, io.BytesIO(),
                                                                       io.BytesIO()))
    members = [_Worker(f"{h}[{i}]", h, _FakeRank(), i) for i, h in enumerate("aaabbc")]
    job.workers, job.generations.members = list(members), list(members)
    excluded = {}  # fencing: why each worker left, for it to read if it comes back
    job.generations.control = types.SimpleNamespace(exclude=excluded.__setitem__)
    job.generations.gen = 0
    job._fail(members[1], "worker a[1] exited with status 1", 1)
    assert job.pool.blacklist == {"a": float("inf")}
    assert excluded["a[1]"] == ("excluded from the job at generation 0: worker a[1] exited "
                                "with status 1")
    if hosts:
        # as in Horovod: every worker of the failed host leaves, SIGTERM first
        assert [w.id for w in job._alive(members)] == ["b[3]", "b[4]", "c[5]"]
        assert members[0].rank.signals == members[2].rank.signals == [signal.SIGTERM]
        assert excluded["a[0]"] == excluded["a[2]"] == (
            "excluded from the job at generation 0: stopped by gradsync run: host a is "
            "blacklisted")
    else:
        # a job given no hosts is this machine alone: the failed worker leaves alone
        assert [w.id for w in job._alive(members)] == ["a[0]", "a[2]", "b[3]", "b[4]", "c[5]"]
        assert members[0].rank.signals == []
        assert sorted(excluded) == ["a[1]"]
    # discovery now lists b with one slot and no c: b's last worker and c's leave
    job.pool.discovery = types.SimpleNamespace(hosts=[Host("a", 3), Host("b", 1)])
    assert [w.id for w in job._unlisted()] == ["b[4]", "c[5]"]


def test_a_new_generation_updates_horovodruns_identity_variables(monkeypatch):
    from types import SimpleNamespace

    from gradsync.elastic import worker

    world = SimpleNamespace(rank=1, size=3, local_rank=1, local_size=3, cross_rank=0,
                            cross_size=1)
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    worker._export_horovod_identity(world)  # not started by a launcher that sets them
    assert "HOROVOD_RANK" not in os.environ
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
        monkeypatch.setenv(f"HOROVOD_{name}", "7")
    worker._export_horovod_identity(world)
    assert {name: os.environ[f"HOROVOD_{name}"] for name in ("RANK", "SIZE", "LOCAL_RANK",
            "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")} == {
        "RANK": "1", "SIZE": "3", "LOCAL_RANK": "1", "LOCAL_SIZE": "3", "CROSS_RANK": "0",
        "CROSS_SIZE": "1"}


def test_the_recovery_plan_goes_on_from_the_most_advanced_survivor_at_a_resume_point():
    from gradsync.elastic.recovery import Plan, Report, decide

    def r(live, resumable=True, saved=10, survivor=True, always=False):
        return Report(survivor=survivor, live=live, resumable=resumable, saved=saved,
                      always=always)

    joiner = r(0, resumable=False, saved=0, survivor=False)
    # nobody survived anything: the job's start, rank 0's commit
    assert decide([joiner, joiner]) == Plan("start", 0, None, None)
    # all at a resume point: the most advanced, lowest rank among equals; joiners follow
    assert decide([r(14), r(14), joiner]) == Plan("go_on", 0, 14, 0)
    assert decide([r(14), r(15), r(15)]) == Plan("go_on", 1, 15, 0)
    # one survivor outside a gradient round: everyone back to rank 0's last save
    assert decide([r(14), r(15, resumable=False), joiner]) == Plan("rollback", 0, 10, 5)
    # asked for, or a state that counts nothing
    assert decide([r(14), r(14, always=True)]) == Plan("rollback", 0, 10, 4)
    assert decide([r(None, saved=None), r(None, saved=None)]) == \
        Plan("rollback", 0, None, None)


def _growing_job(monkeypatch):
    """A launcher whose generation 0 is a[0], b[1] on hosts a, b, c of one slot each (c
    free), over an in-memory store; started workers are _FakeRanks."""
    import io

    from torch.distributed import HashStore

    spec = LaunchSpec(command=["true"], num_proc=3,
                      hosts=[Host("a", 1), Host("b", 1), Host("c", 1)])
    job = _ElasticJob(spec, ElasticSpec(min_np=1, max_np=3), Output(True, io.BytesIO(),
                                                                       io.BytesIO()))
    job.pool.reachable = {"a", "b", "c"}
    job.generations.control = Control(HashStore(), "job", 5.0)
    monkeypatch.setattr(job, "_start_worker", lambda slot, wid, size: _FakeRank(slot.host))
    members = [_Worker(f"{h}[{i}]", h, _FakeRank(h), i) for i, h in enumerate("ab")]
    job.workers, job._counter = list(members), 2
    job._publish(members, 0, 2, now=False)
    formed(job.generations.control, 0)
    return job, members


def formed(control, gen):
    """Generation ``gen``'s World has formed: its address table is out."""
    control.world_store(gen).set("peers", "table")


def ids(control, gen):
    return [m["id"] for m in control.members(gen)]


def test_a_new_worker_is_listed_only_once_ready_and_the_old_generation_trains_on(
        monkeypatch):
    job, members = _growing_job(monkeypatch)
    control = job.generations.control
    assert job._form(first=False) is None
    # c[2] was started, but no generation lists it before it is ready
    assert [w.id for w in job.pending] == ["c[2]"] and control.generation() == 0
    job._watch_new()
    assert job._form(first=False) is None and control.generation() == 0
    control.announce_ready("c[2]")
    job._watch_new()
    assert job._form(first=False) is None
    assert control.generation() == 1 and ids(control, 1) == ["a[0]", "b[1]", "c[2]"]
    assert job.pending == []
    # only a joiner: generation 0 is not aborted, its workers reach 1 at their next commit()
    assert control.world_store(0).read_abort() is None


def test_a_loss_re_forms_at_once_without_the_joiner_still_starting(monkeypatch):
    job, members = _growing_job(monkeypatch)
    control = job.generations.control
    job._form(first=False)  # c[2] starts
    job._fail(members[1], "worker b[1] exited with status 1", 1)
    job._form(first=False, now=True)
    # the survivor re-forms at once, its old generation aborted; c[2] joins a later one
    assert control.generation() == 1 and ids(control, 1) == ["a[0]"]
    assert control.world_store(0).read_abort()["rank"] == -1
    formed(control, 1)  # a[0] trains on in it
    control.announce_ready("c[2]")
    job._watch_new()
    job._form(first=False)
    assert control.generation() == 2 and ids(control, 2) == ["a[0]", "c[2]"]
    assert control.world_store(1).read_abort() is None


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_at_info_each_generation_names_its_workers_processes_and_who_came_and_went(
        monkeypatch, level):
    monkeypatch.setenv("GRADSYNC_LOG_LEVEL", level)
    job, members = _growing_job(monkeypatch)
    job._tell(0)  # as _form does once generation 0's workers have started
    job._form(first=False)  # c[2] starts
    job._fail(members[1], "worker b[1] exited with status 1", 1)
    job._form(first=False, now=True)  # generation 1: a[0] alone
    job.generations.control.announce_ready("c[2]")
    job._watch_new()
    job._form(first=False)  # generation 2: a[0], c[2]
    a, b, c = (w.rank.proc.pid for w in job.workers)
    told = [line for line in job.output.stderr.getvalue().decode().splitlines()
            if re.match(r"gradsync run: generation \d: (rank|joined)", line)]
    assert told == ([] if level == "WARNING" else [
        f"gradsync run: generation 0: rank 0 (worker a[0]) on host a: pid {a}",
        f"gradsync run: generation 0: rank 1 (worker b[1]) on host b: pid {b}",
        f"gradsync run: generation 1: rank 0 (worker a[0]) on host a: pid {a}",
        "gradsync run: generation 1: joined none; left b[1]",
        f"gradsync run: generation 2: rank 0 (worker a[0]) on host a: pid {a}",
        f"gradsync run: generation 2: rank 1 (worker c[2]) on host c: pid {c}",
        "gradsync run: generation 2: joined c[2]; left none"])


@pytest.mark.parametrize("how", ["exits", "never ready"])
def test_a_new_worker_that_never_joins_is_failed_and_no_generation_lists_it(monkeypatch, how):
    import signal

    job, members = _growing_job(monkeypatch)
    control = job.generations.control
    job._form(first=False)
    [joiner] = job.pending
    if how == "exits":
        joiner.rank.proc = types.SimpleNamespace(poll=lambda: 1)
    else:
        job.ready_timeout = 0.0
    job._watch_new()
    assert joiner.failed and job.pending == [] and "c" in job.pool.blacklist
    assert joiner.rank.signals == ([] if how == "exits" else [signal.SIGKILL])
    assert "excluded from the job at generation 0" in control.exclusion("c[2]")
    assert job._form(first=False) is None and control.generation() == 0
    # a joiner waiting to be listed stops at its exclusion instead of waiting for ever
    with pytest.raises(ExcludedError, match="excluded from the job"):
        control.wait_newer(0, float("inf"), "c[2]")


@pytest.mark.parametrize("formed", [False, True])
def test_a_generation_that_a_finished_worker_never_joined_is_stopped_not_waited_for(
        monkeypatch, formed):
    import signal

    job, members = _growing_job(monkeypatch)
    control = job.generations.control
    job._form(first=False)
    control.announce_ready("c[2]")
    job._watch_new()
    job._form(first=False)  # generation 1: a[0], b[1], c[2]
    assert control.generation() == 1
    joiner = job.generations.members[2]
    if formed:  # the generation's address table is out: b[1] trained in it
        control.world_store(1).set("peers", "table")
    # b[1] finished the job in generation 0, before it saw generation 1
    members[1].rank.proc = types.SimpleNamespace(poll=lambda: 0, returncode=0)
    assert job._watch() is False and job.state.finishing
    job._end_unformed()
    if formed:  # the others finish with it: nobody is stopped
        assert not joiner.retired and joiner.rank.signals == []
        return
    # c[2] would wait for b[1] until the elastic timeout: stopped, not failed; a[0] passed
    # the same commits as b[1] and finishes in generation 0 too
    assert joiner.retired and joiner.rank.signals == [signal.SIGTERM]
    assert not joiner.failed and job.pool.blacklist == {}
    assert not members[0].retired and members[0].rank.signals == []
    members[0].rank.proc = types.SimpleNamespace(poll=lambda: 0, returncode=0)
    joiner.rank.proc = types.SimpleNamespace(poll=lambda: -15, returncode=-15)
    job._watch()
    assert job._loop_end() == (0, None)  # the stopped joiner is no failure


def test_a_member_that_exits_just_before_a_re_formation_is_failed_with_its_host(monkeypatch):
    """A SIGKILLed worker's peers post their abort record before the launcher sees it exit:
    ``_watch`` finds it running, then ``_form`` finds it gone. It must be failed there (its
    host blacklisted, the host's other worker stopped), not merely left out: found in the
    64-worker elastic test, whose generation 1 kept the victim's three host-mates."""
    import io

    from torch.distributed import HashStore

    spec = LaunchSpec(command=["true"], num_proc=3, hosts=[Host("a", 2), Host("b", 1)])
    job = _ElasticJob(spec, ElasticSpec(min_np=1, max_np=3), Output(True, io.BytesIO(),
                                                                       io.BytesIO()))
    job.pool.reachable = {"a", "b"}
    job.generations.control = Control(HashStore(), "job", 5.0)
    monkeypatch.setattr(job, "_start_worker", lambda slot, wid, size: _FakeRank())
    members = [_Worker(f"{h}[{i}]", h, _FakeRank(), i) for i, h in enumerate("aab")]
    job.workers, job._counter = list(members), 3
    job._publish(members, 0, 3, now=False)
    assert job._watch() is False  # every member still runs
    members[1].rank.proc.poll = lambda: -9  # a[1] dies now, after the watch looked
    job._form(first=False)
    assert members[1].failed and job.pool.blacklist == {"a": float("inf")}
    assert members[0].retired and members[0].rank.signals == [15]  # SIGTERM
    assert job.generations.control.generation() == 1 and ids(job.generations.control, 1) == ["b[2]"]


def test_no_worker_starts_once_a_member_has_ended(monkeypatch):
    """A member that exits 0 (the job is finishing) between the launcher's look at its
    workers and its count of free slots frees no slot, and the job starts nobody on it: a
    new worker would only be stopped again as the job ends (a slow CI caught one)."""
    job, members = _growing_job(monkeypatch)
    members[1].rank.proc.poll = lambda: 0  # b[1] has just ended; the launcher has not seen it
    assert job._free_slots() == ["c"]  # b[1] still holds b's slot
    assert job._form(first=False) is None
    assert job.state.finishing
    assert job.pending == [] and [w.id for w in job.workers] == ["a[0]", "b[1]"]
    assert job.generations.control.generation() == 0


def test_generations_abort_only_what_a_loss_replaces_and_watch_every_open_one():
    """The launcher's control plane (run/generations.py), its docstring's example: a loss
    aborts the open generations, a joiner aborts none, and a turn reads the records of every
    generation workers may still train in."""
    from torch.distributed import HashStore

    from gradsync.run.generations import Generations

    said = []
    gens = Generations(said.append)
    gens.control = Control(HashStore(), "job", 5.0)
    a, b, c, d = (types.SimpleNamespace(id=f"{h}[{i}]", host=h) for i, h in enumerate("abcd"))
    assert gens.publish([a, b, c], now=False) == 0 and gens.watched() == [0]
    assert gens.publish([a, c], now=True) == 1  # b was lost
    assert gens.read_abort(0)["rank"] == -1 and gens.open == [1]
    formed(gens.control, 1)  # a and c train in it
    assert gens.publish([a, c, d], now=False) == 2  # d joined: 1 trains on until its commit
    assert gens.read_abort(1) is None and gens.watched() == [1, 2]
    assert gens.of(1) == [a, c] and ids(gens.control, 2) == ["a[0]", "c[2]", "d[3]"]
    gens.exclude("b[1]", "it exited with status 1")
    assert gens.control.exclusion("b[1]") == ("excluded from the job at generation 2: it "
                                              "exited with status 1")
    assert said == []
    # Had d come before 1 formed, 1 would be aborted: no member may wait in it for others
    # that read the newer generation (a CI run's survivors of a kill split so, and waited).
    e = types.SimpleNamespace(id="e[4]", host="e")
    assert gens.publish([a, c, d, e], now=False) == 3  # 2 has not formed
    assert gens.read_abort(2) == {"kind": "PeerLostError", "rank": -1, "peer": None,
                                  "message": "generation 2 was replaced by generation 3 "
                                             "before it formed"}
    assert gens.read_abort(1) is None and gens.open == [1, 3] and gens.watched() == [1, 2, 3]


def test_a_failed_read_of_an_abort_record_is_said_once_and_the_client_replaced():
    from gradsync.run.generations import Generations
    from gradsync.run.ranks import start_store

    server = start_store("127.0.0.1")
    said = []
    gens = Generations(said.append)
    gens.host(server, "job", server.port)
    gens.publish([types.SimpleNamespace(id="a[0]", host="a")], now=False)
    gens.control.abort(0, "lost", 0)

    class Broken(Control):  # a client whose calls fail, as one out of step with the server
        def world_store(self, gen):
            raise RuntimeError("connection reset")

    for _ in range(2):
        gens.control = Broken(server, "job", 5.0)
        assert gens.read_abort(0) is None
    assert said == ["cannot read the abort record of generation 0 from the launcher's store "
                    "(connection reset); reconnecting to it"]  # once for the same error
    assert type(gens.control) is Control  # a new client, on loopback
    assert gens.read_abort(0)["message"] == "lost"


def test_a_sub_worlds_store_gives_up_when_its_generation_is_abandoned():
    # A survivor that formed generation g connects its process sets' sub-worlds right after
    # (torch/elastic/reform.py); if the launcher abandons g meanwhile (another generation
    # formed back to back), their waits must end as the generation's own do, not wait out
    # the connect timeout while the other survivors form the next generation.
    import threading
    import time

    from torch.distributed import HashStore

    from gradsync.cluster.rendezvous import Store
    from gradsync.elastic.worker import _GenerationStore
    from gradsync.errors import PeerLostError

    base = HashStore()
    generation = _GenerationStore.over(base, "job.g1", 30.0)
    sub = generation.child(base, "job.g1/hvd0", 30.0)
    assert isinstance(sub, _GenerationStore) and sub.job == "job.g1/hvd0"
    threading.Timer(0.2, lambda: Store.over(base, "job.g1", 5.0).post_abort(
        {"message": "re-formed as generation 2", "peer": None})).start()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="re-formed as generation 2"):
        sub.barrier("shm", 2, 30.0)  # the other member left for generation 2
    assert time.monotonic() - start < 5.0
    # A plain store's sub-world is a plain view, as before.
    assert type(Store.over(base, "job", 5.0).child(base, "job/x", 5.0)) is Store
