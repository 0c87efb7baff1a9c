"""Data servers on hosts of their own (``gradsync run --data-hosts``), without processes.

The command line: a static job's data servers go to the data hosts and its workers never do
(the hosts ``launcher.place`` fills in order are cut so that the last D ranks land there);
an elastic job carries the data hosts in its ``ElasticSpec``; the usage errors. The elastic
launcher: a data host offers no worker slot even when the discovery script lists it, and its
``DataServers`` start on the data hosts, report a failed one and start it again in its slot
(``--server-restarts``), not once the job is finishing. The end to end job, over an ssh
stand-in, is in tests/test_data_elastic.py.
"""

import io
import types

import pytest
from torch.distributed import HashStore

from gradsync.run import cli
from gradsync.run.data_servers import DataServers
from gradsync.run.elastic import ElasticSpec, _ElasticJob
from gradsync.run.hosts import Host
from gradsync.run.launcher import LaunchSpec, Slot, place
from gradsync.run.processes import Output


def _parsed(*argv: str):
    parser = cli.build_parser()
    args = parser.parse_args(["run", *argv, "python", "t.py"])
    return args.run_parser, args


def _static_slots(*argv: str) -> list[Slot]:
    parser, args = _parsed(*argv)
    spec = cli._spec(parser, args)
    return place(spec.hosts, spec.size)


def test_a_static_jobs_data_servers_run_on_the_data_hosts_and_its_workers_elsewhere():
    # a has room for 4, but only the 3 workers go there: without the cut, place() would put
    # data server 0 on a's fourth slot
    slots = _static_slots("-np", "3", "-H", "a:4", "--data-servers", "2",
                          "--data-hosts", "d:1,e:1")
    assert [(s.rank, s.host, s.local_rank) for s in slots] == [
        (0, "a", 0), (1, "a", 1), (2, "a", 2), (3, "d", 0), (4, "e", 0)]
    # parameter servers are the workers' company; no -H: the workers run here
    slots = _static_slots("-np", "2", "--servers", "1", "--data-servers", "2",
                          "--data-hosts", "d:2")
    assert [(s.rank, s.host) for s in slots] == [
        (0, "localhost"), (1, "localhost"), (2, "localhost"), (3, "d"), (4, "d")]
    # without --data-hosts, as before: the data servers take the slots after the workers
    slots = _static_slots("-np", "3", "-H", "a:4,d:1", "--data-servers", "2")
    assert [s.host for s in slots] == ["a", "a", "a", "a", "d"]


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--data-hosts", "d:1"], "give --data-servers D too"),
    (["-np", "2", "--data-servers", "3", "--data-hosts", "d:1,e:1"],
     "--data-servers 3 need 3 slots but --data-hosts d:1,e:1 has 2"),
    (["-np", "2", "-H", "a:2,d:1", "--data-servers", "1", "--data-hosts", "d:1"],
     "host(s) d in both --data-hosts and the workers' hosts"),
    (["-np", "2", "--data-servers", "1", "--data-hosts", "localhost:1"],
     "host(s) localhost in both"),
    (["-np", "3", "-H", "a:2", "--data-servers", "1", "--data-hosts", "d:1"],
     "3 workers and servers need 3 slots on the hosts of -H/--hostfile, which have 2"),
    (["-np", "2", "--data-servers", "1", "--data-hosts", "d:0"], "slots must be at least 1"),
    (["-np", "2", "--min-np", "1", "-H", "a:2,d:1", "--data-servers", "1",
      "--data-hosts", "d:1"], "in both --data-hosts"),
    (["-np", "2", "--min-np", "1", "--data-servers", "1", "--data-hosts", "localhost:1"],
     "in both --data-hosts"),
])
def test_data_host_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", *argv, "true"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_elastic_job_carries_its_data_hosts_and_discovery_may_list_them():
    parser, args = _parsed("-np", "2", "--min-np", "2", "--host-discovery-script", "./h.sh",
                           "--data-servers", "3", "--data-hosts", "d:2,e")
    spec = cli._elastic_spec(parser, args)
    assert spec.data_hosts == (Host("d", 2), Host("e", 1))
    assert cli._spec(parser, args).hosts == []  # the workers' hosts: discovery's
    with pytest.raises(ValueError, match="names a host twice"):
        ElasticSpec(min_np=1, max_np=2, data_hosts=(Host("d", 1), Host("d", 1)))


def _job(data_hosts=(), data_servers=2, restarts=3):
    spec = LaunchSpec(command=["true"], num_proc=2, data_servers=data_servers,
                      server_restarts=restarts)
    return _ElasticJob(spec, ElasticSpec(min_np=1, max_np=8, data_hosts=tuple(data_hosts),
                                         discovery_script="./h.sh"),
                       Output(True, io.BytesIO(), io.BytesIO()))


def test_a_data_host_offers_no_worker_slot_even_when_discovery_lists_it():
    job = _job([Host("d", 2)])
    job.pool.discovery = types.SimpleNamespace(hosts=[Host("d", 2), Host("a", 1), Host("b", 2)])
    job.pool.reachable = {"a", "b", "d"}
    assert job._free_slots() == ["a", "b", "b"]
    plain = _job()  # a job without data hosts: every listed slot
    plain.pool.discovery, plain.pool.reachable = job.pool.discovery, job.pool.reachable
    assert plain._free_slots() == ["d", "d", "a", "b", "b"]


class _Proc:
    def __init__(self, pid):
        self.pid, self.code = pid, None

    def poll(self):
        return self.code


class _Starter:
    """Records the slots it is asked to start; each start a process that runs until told."""

    job_id = "job"

    def __init__(self):
        self.started: list[tuple[Slot, int]] = []

    def start(self, slot, port, size):
        self.started.append((slot, size))
        return types.SimpleNamespace(slot=slot, proc=_Proc(1000 + len(self.started)),
                                     remote=True, command=["python", "t.py"])


def _servers(count=3, restarts=1, num_proc=2):
    spec = LaunchSpec(command=["python", "t.py"], num_proc=num_proc, data_servers=count,
                      server_restarts=restarts)
    out = io.BytesIO()
    starter = _Starter()
    servers = DataServers(spec, starter, Output(False, io.BytesIO(), out), HashStore(), 1)
    return servers, starter, out


def test_data_servers_start_on_the_data_hosts_in_order_as_ranks_after_the_workers():
    servers, starter, _ = _servers(count=3)
    servers.start([Host("d0", 1), Host("d1", 2)])
    assert starter.started == [(Slot(2, "d0", 0, 1, 0, 2), 5), (Slot(3, "d1", 0, 2, 1, 2), 5),
                               (Slot(4, "d1", 1, 2, 0, 1), 5)]
    assert servers.store.check("data/elastic")  # they admit any worker id


def test_a_failed_data_server_is_started_again_in_its_slot_while_its_restarts_last():
    servers, starter, out = _servers(count=2, restarts=1)
    servers.start([Host("d", 2)])
    first = servers.ranks[1]
    first.proc.code = -9  # SIGKILLed
    servers.watch()
    # reported once, started again on its host with its rank; the other one untouched
    assert [s for s, _ in starter.started] == [Slot(2, "d", 0, 2, 0, 1), Slot(3, "d", 1, 2, 0, 1),
                                               Slot(3, "d", 1, 2, 0, 1)]
    assert servers.ranks[1] is not first and servers.failed == [(1, 137)]
    servers.watch()
    assert len(starter.started) == 3  # the old process is not reported twice
    text = out.getvalue().decode()
    assert "rank 3 (data server 1) on host d was killed by signal 9 (SIGKILL)" in text
    assert "data server 1 started again on host d (1 of 1)" in text
    # its replacement fails too: reported, and not started again (--server-restarts 1)
    servers.ranks[1].proc.code = 1
    servers.watch()
    assert len(starter.started) == 3 and servers.failed == [(1, 137), (1, 1)]
    assert "data server 1 is not started again: it was started again 1 times" in \
        out.getvalue().decode()
    # the job's status is the first failure's; one of the two data servers failed
    servers.ranks[0].proc.code = 0  # (the other one ended when told)
    status, summary = servers.end(0, None)
    assert status == 137 and summary.startswith("data server 1 failed earlier (1 of 2 failed)")


def test_a_data_server_that_fails_while_the_job_is_finishing_is_not_started_again():
    servers, starter, out = _servers(count=1, restarts=3)
    servers.start([Host("d", 1)])
    servers.ranks[0].proc.code = -9
    servers.watch(restart=False)
    assert len(starter.started) == 1 and servers.failed == [(0, 137)]
    assert "started again" not in out.getvalue().decode()
