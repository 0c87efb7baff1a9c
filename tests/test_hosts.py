"""Host lists (``gradsync/run/hosts.py``): one set of rules for every command that reads one."""

import pytest

from gradsync.bench import netns, plan
from gradsync.run import cli, elastic
from gradsync.run.hosts import Host, parse_hosts, rank_hosts, read_hostfile


def test_good_lists():
    assert parse_hosts("h0:2,h1:2") == [Host("h0", 2), Host("h1", 2)]
    assert parse_hosts("h0") == [Host("h0", 1)]  # no slot count: one slot
    assert parse_hosts("a:1,b,c:3") == [Host("a", 1), Host("b", 1), Host("c", 3)]
    assert parse_hosts("fe80::1:4") == [Host("fe80::1", 4)]  # slots after the last colon
    assert parse_hosts("+2", source="x") == [Host("+2", 1)]  # a name, not a count


def test_whitespace_and_empty_entries_are_ignored():
    assert parse_hosts("  h0 : 2 ,h1:1 , ") == [Host("h0", 2), Host("h1", 1)]
    assert parse_hosts("a:2,,b") == [Host("a", 2), Host("b", 1)]
    assert parse_hosts("a:2\n\n  b \n", separator="\n") == [Host("a", 2), Host("b", 1)]


@pytest.mark.parametrize("text, message", [
    ("h0:x", r"-H entry 'h0:x': slots 'x' is not an integer"),
    ("h0:1.5", r"-H entry 'h0:1.5': slots '1.5' is not an integer"),
    ("h0:", r"-H entry 'h0:': no slot count after ':'"),
    ("h0:0", r"-H entry 'h0:0': slots must be at least 1, got 0"),
    ("h0:-2", r"-H entry 'h0:-2': slots must be at least 1, got -2"),
    (":2", r"-H entry ':2': no host name"),
    ("a b:2", r"-H entry 'a b:2': host name 'a b' holds white space"),
    ("a:1,b:1,a:2", r"-H entry 'a:2': host 'a' was named before; give each host once"),
    ("", r"-H names no host"),
    (" , ,", r"-H names no host"),
])
def test_bad_lists_name_the_bad_entry(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_hosts(text)
    if "entry" in message and "named before" not in message:
        assert "expected 'host:slots' or 'host'" in str(info.value)


def test_an_empty_list_where_no_host_is_an_answer():
    assert parse_hosts("\n\n", separator="\n", allow_empty=True) == []


def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nn1 slots=2\n\nn2:3  # comment\nn3\n")
    assert read_hostfile(str(path)) == [Host("n1", 2), Host("n2", 3), Host("n3", 1)]
    for text, message in [("n1 cpus=2\n", ":1 'n1 cpus=2': expected 'host slots=N'"),
                          ("n1\nn2 slots=0\n", ":2 'n2 slots=0': slots must be at least 1"),
                          ("n1\nn1:2\n", ":2 'n1:2': host 'n1' was named before"),
                          ("# nothing\n", "names no host")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_hostfile(str(path))


def test_rank_order():
    hosts = [Host("h0", 2), Host("h1", 1), Host("h2", 2)]
    assert rank_hosts(hosts) == ["h0", "h0", "h1", "h2", "h2"]
    assert rank_hosts(hosts, alternate=True) == ["h0", "h1", "h2", "h0", "h2"]


def test_every_command_reads_host_lists_with_these_rules():
    # gradsync run -H
    assert cli.parse_hosts("n1:2, n2") == [Host("n1", 2), Host("n2", 1)]
    # an elastic job's discovery script: one entry a line; printing nothing is no host now
    assert elastic.parse_discovered("a:2\n\nb\n") == [Host("a", 2), Host("b", 1)]
    assert elastic.parse_discovered("") == []
    with pytest.raises(ValueError, match="host discovery script entry 'a:0'.*'host:slots'"):
        elastic.parse_discovered("a:0")
    # gradsync plan --hosts
    assert plan.placement("a:2,b:1", True) == ["a", "b", "a"]
    assert plan.placement("a:2,b:1", False) == ["a", "a", "b"]
    with pytest.raises(ValueError, match="--hosts entry 'a:x'"):
        plan.placement("a:x", False)
    # the emulated cluster's --hosts
    assert netns.parse_hosts("h0:2, h1:1,h2") == [("h0", 2), ("h1", 1), ("h2", 1)]
    for bad in ("h0:1,h0:1", "h0:0", ""):
        with pytest.raises(ValueError, match="--hosts"):
            netns.parse_hosts(bad)


def test_plan_reports_a_bad_list_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        plan.main(["--hosts", "h0:2,h0:1"])
    assert info.value.code == 2
    assert "--hosts entry 'h0:1': host 'h0' was named before" in capsys.readouterr().err


def test_gradsync_run_reports_a_bad_list_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", "2", "-H", "a:1,a:1", "true"])
    assert info.value.code == 2
    assert "-H entry 'a:1': host 'a' was named before" in capsys.readouterr().err
