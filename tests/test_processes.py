"""The launchers' shared parts, without a job: host lists (``gradsync/run/hosts.py``, one set
of rules for every command that reads one) and process mechanics (``gradsync/run/processes.py``:
sessions, stopping, output, signals, ssh command lines)."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from gradsync.bench import plan
from gradsync.testbed import netns
from gradsync.run import cli, elastic
from gradsync.run import processes
from gradsync.run.hosts import Host, parse_hosts, rank_hosts, read_hostfile
from gradsync.run.processes import Interrupts, Output, Ssh, start, stop
from gradsync.testbed.procfs import gone


# ---------------------------------------------------------------------- host lists


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


# ---------------------------------------------------------------------- process mechanics
def test_a_child_leads_a_session_of_its_own():
    child = start([sys.executable, "-c", "import os; print(os.getsid(0), os.getpgrp())"])
    out, _ = child.proc.communicate(timeout=30)
    assert out.split() == [str(child.proc.pid).encode()] * 2
    assert child.proc.stdin is None  # its stdin is /dev/null: it never reads ours


def test_stop_reaches_what_a_child_started_and_kills_one_that_ignores_sigterm():
    # The child starts a grandchild in its group that ignores SIGTERM, prints its pid and exits
    # itself: the stop must still reach the grandchild, through the group, with SIGKILL.
    code = ("import signal, subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
            "time.sleep(60)'], stdout=subprocess.PIPE)\n"
            "p.stdout.readline(); print(p.pid, flush=True)\n")
    child = start([sys.executable, "-c", code])
    grandchild = int(child.proc.stdout.readline())
    child.proc.wait(30)
    assert not gone(grandchild)
    started = time.monotonic()
    assert stop([child], grace=0.3) == 0  # the child itself had ended
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)


def test_gone_sees_a_live_process_a_zombie_and_one_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not gone(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while not gone(child.pid) and time.monotonic() < deadline:  # a zombie, not yet reaped
            time.sleep(0.01)
        assert gone(child.pid)
    finally:
        child.kill()
        child.wait()
    assert gone(child.pid)


def test_gone_counts_a_process_that_ends_while_its_proc_entry_is_read(monkeypatch):
    # /proc/<pid>/stat opened, then the process reaped before read(): ESRCH (a 64-rank CI run).
    import builtins

    real_open = builtins.open

    class Vanishing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise ProcessLookupError(3, "No such process")

    def opener(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            return Vanishing()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", opener)
    assert gone(os.getpid())


def test_stop_gives_the_grace_and_hurry_skips_it():
    ignore = [sys.executable, "-c", "import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"]
    for hurry, least, most in [(False, 1.0, 8.0), (True, 0.0, 0.9)]:
        children = [start(ignore) for _ in range(2)]
        for child in children:
            child.proc.stdout.readline()  # its handler is in place
        started = time.monotonic()
        assert stop(children, grace=1.0, hurry=lambda: hurry) == 2
        took = time.monotonic() - started
        assert least <= took < most, (hurry, took)
        assert [c.poll() for c in children] == [-signal.SIGKILL] * 2


def test_signalling_a_remote_child_drops_its_lifeline_first():
    child = start(["cat"], stdin=subprocess.PIPE)
    child.lifeline = True
    child.signal(signal.SIGCONT)  # harmless: only the lifeline's end is seen
    assert child.proc.stdin.closed
    assert child.proc.wait(10) == 0  # cat saw the end of its stdin


def test_output_tags_whole_lines_and_ends_the_last_one():
    out, err = io.BytesIO(), io.BytesIO()
    output = Output(True, out, err)
    child = start([sys.executable, "-c",
                   "import sys; print('a'); print('b', file=sys.stderr); print('c', end='')"])
    output.follow(3, child.proc)
    child.proc.wait(30)
    output.drain(10)
    output.message("done")
    assert out.getvalue() == b"[3]<stdout>:a\n[3]<stdout>:c\n"
    assert err.getvalue() == b"[3]<stderr>:b\ngradsync run: done\n"
    plain = io.BytesIO()
    Output(False, plain, plain).write(plain, b"x\n")
    assert plain.getvalue() == b"x\n"


def test_pump_reads_text_and_bytes_to_the_end():
    lines = []
    child = start([sys.executable, "-c", "print('x'); print('y', end='')"], text=True,
                  merge_stderr=True)
    processes.pump(child.proc.stdout, lines.append, "test-pump").join(30)
    assert lines == ["x\n", "y"] and child.proc.stdout.closed
    child.proc.wait(30)


def test_interrupts_first_signal_stops_a_second_hurries():
    interrupts = Interrupts()
    with interrupts.catching():
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
    assert (interrupts.received, interrupts.hurry) == (signal.SIGHUP, True)
    assert signal.getsignal(signal.SIGHUP) is not None  # the previous handlers are back


def test_ssh_command_lines_and_exit_statuses():
    assert Ssh("ssh -q", 2222, 2.5).argv("h1", "true") == \
        ["ssh", "-q", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "-p", "2222", "h1", "true"]
    assert Ssh().argv("h1", "true")[-4:] == ["-o", "ConnectTimeout=30", "h1", "true"]
    assert Ssh().probe_limit == processes.DEFAULT_START_TIMEOUT + 5
    assert (processes.exit_status(3), processes.exit_status(-9)) == (3, 137)
    assert processes.describe(3) == "exited with status 3"
    assert processes.describe(-9) == "was killed by signal 9 (SIGKILL)"


def test_an_unrunnable_ssh_is_a_start_error():
    with pytest.raises(processes.StartError, match="cannot run '/no/such/ssh'") as info:
        Ssh("/no/such/ssh").probe("h1")
    assert info.value.status == 127


class QuickSsh(Ssh):
    @property
    def probe_limit(self) -> float:  # (Ssh's is its ConnectTimeout and 5 s more)
        return 1.0


def test_host_checks_collect_each_host_as_its_check_ends_and_kill_a_late_one(tmp_path):
    """``HostChecks``, the one ssh-check loop of the static start and the elastic pool: a
    check is collected when it ends (reachable: no error; refused: ssh's error and status),
    one past its deadline is killed and reported late (255), none is waited on."""
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\n"  # (its arguments end with "HOST true")
                    'case "$*" in *" bad true") echo "ssh: connect to host bad port 22: '
                    'Connection refused" >&2; exit 255;;\n'
                    '*" slow true") exec sleep 30;;\nesac\nexit 0\n')
    fake.chmod(0o755)
    checks = processes.HostChecks(QuickSsh(str(fake)))
    began = time.monotonic()
    for host in ("good", "bad", "slow"):
        checks.start(host)
    checks.start("good")  # already running: not started twice
    found: dict[str, tuple] = {}
    while checks and time.monotonic() - began < 10:
        for host, error, code in checks.collect():
            found[host] = (error, code, time.monotonic() - began)
        time.sleep(0.02)
    assert not checks and "slow" not in checks
    assert found["good"][:2] == (None, 0)
    error, code, when = found["bad"]
    assert code == 255 and "cannot run commands on bad" in error and "Connection refused" in error
    assert when < 1.0  # collected when it ended, not after the slow one
    error, code, when = found["slow"]
    assert (error, code) == ("ssh to slow did not finish within 30s", 255) and 1.0 <= when < 5


def test_host_checks_end_kills_the_checks_still_running(tmp_path):
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    checks = processes.HostChecks(Ssh(str(fake)))
    checks.start("h1")
    (proc, _), = checks._running.values()
    checks.end()
    assert not checks and proc.poll() is not None
