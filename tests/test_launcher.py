"""gradsync run: placement logic, then real launches of tiny ``python -c`` ranks.

Most launches run the command in this process (``here``: ``cli.main``, its output captured),
since every job's store needs torch: a launcher process of its own starts a store keeper that
imports it (1.3 s of CPU a job, gradsync/run/keeper.py), a launcher in this process, which
imported torch once, hosts the store itself. Those that signal the launcher or read its output
while it runs start ``python -m gradsync run`` (``launcher``). Every launch has a deadline; a
launcher process runs in its own session and is stopped (SIGTERM, then SIGKILL) if a test
fails while it runs, one in this process gets SIGTERM at its deadline, and the ranks never
sleep longer than ``NAP`` seconds, so nothing outlives a failed test for long.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness import ssh_stand_in

from gradsync.run import cli
from gradsync.run.cli import parse_hosts, read_hostfile, resolve_exports
from gradsync.testbed.procfs import gone
from gradsync.run.launcher import Host, LaunchSpec, Slot, informs, place
from gradsync.run.processes import remote_script, start

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30.0
NAP = 30  # how long a rank that should be stopped sleeps: far beyond any expected exit
STOP_WITHIN = 5.0  # seconds from a rank's failure to the launcher's exit (grace is 3 s)


# ---------------------------------------------------------------- placement (no processes)
def test_place_fills_hosts_in_order_with_horovod_cross_ranks():
    slots = place([Host("a", 2), Host("b", 2), Host("c", 4)], 5)
    assert slots == [
        Slot(0, "a", 0, 2, 0, 3), Slot(1, "a", 1, 2, 0, 2),
        Slot(2, "b", 0, 2, 1, 3), Slot(3, "b", 1, 2, 1, 2),
        Slot(4, "c", 0, 1, 2, 3),
    ]


def test_place_errors_name_the_hosts():
    with pytest.raises(ValueError, match=r"3 ranks need 3 slots but the hosts have 2 \(a:1, b:1\)"):
        place([Host("a", 1), Host("b", 1)], 3)
    with pytest.raises(ValueError, match="more than once: a"):
        place([Host("a", 1), Host("a", 1)], 2)


def test_parse_hosts_and_hostfile(tmp_path):
    assert parse_hosts("n1:2, n2,n3:4") == [Host("n1", 2), Host("n2", 1), Host("n3", 4)]
    for bad in ("n1:0", "n1:x", ":2"):
        with pytest.raises(ValueError):
            parse_hosts(bad)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nn1 slots=2\n\nn2:3  # comment\nn3\n")
    assert read_hostfile(str(hostfile)) == [Host("n1", 2), Host("n2", 3), Host("n3", 1)]
    hostfile.write_text("n1 cpus=2\n")
    with pytest.raises(ValueError, match=f"{hostfile}:1"):
        read_hostfile(str(hostfile))


def test_exports():
    assert resolve_exports(["A=1", "B", "C=x=y"], {"B": "from-here"}) == \
        {"A": "1", "B": "from-here", "C": "x=y"}
    with pytest.raises(ValueError, match="MISSING is not set"):
        resolve_exports(["MISSING"], {})
    with pytest.raises(ValueError, match="sets GRADSYNC_SECRET"):
        resolve_exports(["GRADSYNC_SECRET=00"], {})


@pytest.mark.parametrize("environ, flags, expected", [
    ({}, {}, False),
    ({"GRADSYNC_LOG_LEVEL": "info"}, {}, True),
    ({}, {"GRADSYNC_LOG_LEVEL": "DEBUG"}, True),  # --log-level or -x: the ranks' level
    ({"GRADSYNC_LOG_LEVEL": "INFO"}, {"GRADSYNC_LOG_LEVEL": "WARNING"}, False),
    ({"HOROVOD_LOG_LEVEL": "trace"}, {}, True),
    ({"HOROVOD_LOG_LEVEL": "info", "GRADSYNC_LOG_LEVEL": "ERROR"}, {}, False),
    ({"HOROVOD_LOG_LEVEL": "info", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "soon"}, {}, False),
])
def test_the_launcher_names_the_ranks_processes_when_they_log_at_info(monkeypatch, environ,
                                                                      flags, expected):
    for name in ("GRADSYNC_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert informs(LaunchSpec(command=["true"], num_proc=1, env=flags)) is expected


# ---------------------------------------------------------------- helpers for real launches
def _env(**extra) -> dict:
    """This process's environment without its ``GRADSYNC_*`` settings, gradsync importable,
    ``extra`` added (a name given as None is left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


# ``gradsync run`` whose parameter servers run the command in argv[1] (JSON) instead of the
# server entry point (``python -m gradsync.ps``): the tests of what the launcher does with a
# server that fails, ends or prints use a ``python -c`` server, as its workers are.
_SERVERS_RUN = """
import dataclasses, json, sys
from gradsync.run import cli
launch = cli.launch
server = json.loads(sys.argv[1])
cli.launch = lambda spec: launch(dataclasses.replace(spec, server_command=server))
sys.exit(cli.main(["run", *sys.argv[2:]]))
"""


@contextmanager
def launcher(*args: str, server: list[str] | None = None, **env):
    """Starts ``gradsync run ARGS`` and makes sure it is gone when the block ends; ``server``:
    the command its parameter servers run (default: the entry point)."""
    argv = ["-m", "gradsync", "run"] if server is None else \
        ["-c", _SERVERS_RUN, json.dumps(server)]
    proc = subprocess.Popen([sys.executable, *argv, *args], cwd=ROOT,
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its ranks on SIGTERM
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        try:
            proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass  # ValueError: a test already read the pipes to their end


def here(monkeypatch, *args: str, server: list[str] | None = None,
         **env) -> tuple[int, list[str], list[str], float]:
    """Runs ``gradsync run ARGS`` to its end in this process: the command's own parse, spec
    and job loop (``cli.main``), in the environment ``_env(**env)`` gives (set here, restored
    after the test), ``server`` as ``launcher``'s. Returns (status, stdout lines, stderr
    lines, wall-clock time of the launch's end). torch is imported here first, so that the
    launcher hosts the job's store in this process rather than start a store keeper that
    imports it again (module docstring). At ``DEADLINE`` a watchdog sends this process
    SIGTERM, which the launcher's handler turns into stopping its ranks: the test then fails
    on the status (143), never hangs; outside the launcher's handlers the signal raises
    ``TimeoutError`` in the test."""
    import torch  # noqa: F401  (the store's: see above)

    wanted = _env(**env)
    for name in set(os.environ) - set(wanted):
        monkeypatch.delenv(name)
    for name, value in wanted.items():
        monkeypatch.setenv(name, value)
    out, err = io.BytesIO(), io.BytesIO()
    launch = cli.launch

    def captured(spec):
        if server is not None:
            spec = dataclasses.replace(spec, server_command=server)
        return launch(spec, out, err)

    monkeypatch.setattr(cli, "launch", captured)

    def overdue(signum, frame):  # the watchdog's SIGTERM while no launcher handler is set
        raise TimeoutError(f"gradsync run did not end within {DEADLINE} s")

    # Before the launcher installs its handlers (and after it restores them) the watchdog's
    # SIGTERM raises in this test instead of ending the whole pytest process.
    previous = signal.signal(signal.SIGTERM, overdue)
    watchdog = threading.Timer(DEADLINE, os.kill, (os.getpid(), signal.SIGTERM))
    watchdog.start()
    try:
        status = cli.main(["run", *args])
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGTERM, previous)
    ended = time.time()
    return (status, out.getvalue().decode().splitlines(), err.getvalue().decode().splitlines(),
            ended)


def rank_code(body: str) -> list[str]:
    """A ``python -c`` rank with ``rank`` and ``size`` defined."""
    prelude = "import os, sys, time\nrank = int(os.environ['GRADSYNC_RANK'])\n" \
              "size = int(os.environ['GRADSYNC_SIZE'])\n"
    return [sys.executable, "-c", prelude + textwrap.dedent(body)]


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


@pytest.fixture
def fake_ssh(tmp_path):
    return ssh_stand_in(tmp_path)


# ---------------------------------------------------------------- real launches
@pytest.mark.multiprocess
@pytest.mark.parametrize("np_, prefix", [(1, False), (2, True), (3, True)])
def test_ranks_exit_zero_with_whole_prefixed_lines(np_, prefix, monkeypatch):
    # Each line is written in two pieces with a pause between: a forwarder that did not wait
    # for the newline would interleave the pieces of different ranks.
    code = rank_code("""
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            stream.write(f"{name} from {rank} of {size}, first half ")
            stream.flush()
        time.sleep(0.2)
        print("second half")
        print("second half", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """)
    status, out, err, _ = here(monkeypatch, "-np", str(np_),
                               *([] if prefix else ["--no-output-prefix"]), *code)
    assert status == 0, err
    tag = "[{0}]<{1}>:" if prefix else ""
    assert sorted(out) == sorted(
        [tag.format(r, "stdout") + f"out from {r} of {np_}, first half second half"
         for r in range(np_)] +
        [tag.format(r, "stdout") + "no newline at the end" for r in range(np_)])
    assert sorted(err) == sorted(tag.format(r, "stderr") + f"err from {r} of {np_}, first half "
                                 "second half" for r in range(np_))


@pytest.mark.multiprocess
def test_the_script_gets_its_arguments_even_prefixes_of_the_launchers_options(tmp_path,
                                                                              monkeypatch):
    # The command line, then every prefix of every launcher option (from its parser):
    # argparse's prefix matching read "--n" as an ambiguous launcher option and the job died.
    options = cli.option_values(cli.build_parser().get_default("run_parser"))
    prefixes = sorted({o[:end] for o in options for end in range(2, len(o) + 1)})
    script = tmp_path / "script.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    argv = ["--n", "3", "--out", "x", "--b", "1", *prefixes]
    status, out, err, _ = here(monkeypatch, "-np", "1", "--no-output-prefix", sys.executable,
                               str(script), *argv)
    assert status == 0, err
    assert json.loads(out[-1]) == argv


@pytest.mark.multiprocess
def test_identity_variables_and_store(monkeypatch):
    code = rank_code("""
        import json, socket
        from gradsync.cluster.launch_env import detect
        env = detect()
        # Something must be listening at the store address: the launcher's TCPStore.
        socket.create_connection((env.store_addr, env.store_port), timeout=5).close()
        names = [n for n in os.environ if n.startswith("GRADSYNC_")]
        print(json.dumps({**{n: os.environ[n] for n in names}, "source": env.source,
                          "secret_len": len(env.secret), "server": env.store_is_server}))
    """)
    status, out, err, _ = here(monkeypatch, "-np", "3", "-x", "EXTRA=1", *code)
    assert status == 0, err
    ranks = sorted((json.loads(line.split(":", 1)[1]) for line in out),
                   key=lambda v: int(v["GRADSYNC_RANK"]))
    assert [r["GRADSYNC_RANK"] for r in ranks] == ["0", "1", "2"]
    for rank, seen in enumerate(ranks):
        assert seen["GRADSYNC_SIZE"] == "3"
        assert (seen["GRADSYNC_LOCAL_RANK"], seen["GRADSYNC_LOCAL_SIZE"]) == (str(rank), "3")
        assert (seen["GRADSYNC_CROSS_RANK"], seen["GRADSYNC_CROSS_SIZE"]) == ("0", "1")
        assert seen["GRADSYNC_HOSTNAME"] == "localhost"
        assert seen["GRADSYNC_STORE_ADDR"] == "127.0.0.1"
        assert seen["GRADSYNC_LAUNCHER_PID"] == str(os.getpid())  # the launcher: here
        assert seen["GRADSYNC_SERVERS"] == "0"  # set even without servers: nothing leaks in
        assert (seen["source"], seen["secret_len"], seen["server"]) == ("gradsync", 32, False)
    for name in ("GRADSYNC_JOB_ID", "GRADSYNC_SECRET", "GRADSYNC_STORE_PORT"):
        assert len({seen[name] for seen in ranks}) == 1, name  # the same for the whole job


@pytest.mark.multiprocess
def test_failing_rank_stops_the_job_with_its_status(monkeypatch):
    code = rank_code(f"""
        if rank == 1:
            time.sleep(0.3)
            print(time.time())
            sys.exit(3)
        time.sleep({NAP})
    """)
    status, out, err, ended = here(monkeypatch, "-np", "3", "--no-output-prefix", *code)
    assert status == 3
    assert err[-1] == "gradsync run: rank 1 on host localhost exited with status 3; " \
                      "stopped 2 other ranks"
    assert ended - float(out[0]) < STOP_WITHIN


@pytest.mark.multiprocess
def test_rank_killed_by_a_signal_gives_128_plus_signal(monkeypatch):
    code = rank_code(f"""
        import signal
        if rank == 0:
            print(time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep({NAP})
    """)
    status, out, err, ended = here(monkeypatch, "-np", "2", "--no-output-prefix", *code)
    assert status == 137
    assert err[-1] == "gradsync run: rank 0 on host localhost was killed by signal 9 " \
                      "(SIGKILL); stopped 1 other rank"
    assert ended - float(out[0]) < STOP_WITHIN


@pytest.mark.multiprocess
def test_sigint_stops_every_rank_and_its_children():
    # Each rank starts a child of its own: stopping the job must reach it too.
    code = rank_code(f"""
        import subprocess
        child = subprocess.Popen(["sleep", "{NAP}"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep({NAP})
    """)
    with launcher("-np", "2", "--no-output-prefix", *code) as proc:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                         daemon=True).start()
        pids = [int(p) for _ in range(2) for p in lines.get(timeout=DEADLINE).split()]
        assert len(pids) == 4
        proc.send_signal(signal.SIGINT)
        proc.wait(DEADLINE)
        err = proc.stderr.read()
    assert proc.returncode == 130
    assert err.splitlines()[-1] == "gradsync run: interrupted by SIGINT; stopped 2 ranks"
    assert wait_gone(pids) == []


# ---------------------------------------------------------------- parameter-server jobs
def test_servers_need_slots_of_their_own(capsys):
    for argv, message in (
            (["-np", "2", "--servers", "1", "-H", "a:1,b:1"],
             "3 ranks need 3 slots but the hosts have 2 (a:1, b:1)"),
            (["-np", "2", "--servers", "-1"], "servers must be >= 0, got -1")):
        with pytest.raises(SystemExit) as info:
            cli.main(["run", *argv, "true"])
        assert info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.multiprocess
def test_servers_are_the_last_ranks_of_the_job(monkeypatch):
    code = rank_code("""
        from gradsync.cluster.launch_env import detect
        env = detect()
        print(rank, size, os.environ["GRADSYNC_SERVERS"], env.workers, env.server_rank)
    """)
    status, out, err, _ = here(monkeypatch, "-np", "2", "--servers", "1", "--no-output-prefix",
                               *code, server=code)
    assert status == 0, err
    assert sorted(out) == ["0 3 1 2 None", "1 3 1 2 None", "2 3 1 2 0"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("failure, status, how", [
    ("sys.exit(3)", 3, "exited with status 3"),
    ("os.kill(os.getpid(), 9)", 137, "was killed by signal 9 (SIGKILL)"),
], ids=["exit", "signal"])
def test_failing_worker_lets_the_others_finish(tmp_path, failure, status, how):
    # The others finish only once this test has read the launcher's report of rank 1 (a
    # flag file): a report held back to the job's end would hold them until their NAP.
    told = tmp_path / "reported"
    code = rank_code(f"""
        if rank == 1:
            {failure}
        end = time.monotonic() + {NAP}
        while not os.path.exists({str(told)!r}) and time.monotonic() < end:
            time.sleep(0.01)
        print("finished", rank, time.time())
    """)
    with launcher("-np", "2", "--servers", "1", "--no-output-prefix", *code,
                  server=code) as proc:
        first = proc.stderr.readline()
        reported = time.time()
        told.touch()
        out, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == status
    assert first == f"gradsync run: worker rank 1 on host localhost {how}; the other ranks go " \
                    "on (parameter-server job)\n"
    finished = [line.split() for line in out.splitlines()]
    assert sorted(rank for _, rank, _ in finished) == ["0", "2"]
    assert all(reported < float(at) for _, _, at in finished)  # reported at once, not at the end
    assert err.splitlines() == [f"gradsync run: worker rank 1 on host localhost failed earlier "
                                f"({how}); the job ran to its end"]


@pytest.mark.multiprocess
def test_failing_server_stops_the_job_with_its_status(monkeypatch):
    code = rank_code(f"""
        if rank == 2:
            time.sleep(0.3)
            print(time.time())
            sys.exit(4)
        time.sleep({NAP})
    """)
    status, out, err, ended = here(monkeypatch, "-np", "2", "--servers", "1",
                                   "--no-output-prefix", *code, server=code)
    assert status == 4
    assert err[-1] == "gradsync run: rank 2 (server 0) on host localhost exited with status 4; " \
                      "stopped 2 other ranks"
    assert ended - float(out[0]) < STOP_WITHIN


@pytest.mark.multiprocess
def test_fake_ssh_places_remote_ranks_and_hides_the_secret(fake_ssh, monkeypatch):
    ssh, log = fake_ssh
    code = rank_code("""
        import json
        names = [n for n in os.environ if n.startswith("GRADSYNC_") or n in ("FOO", "LOCAL_ONLY")]
        print(json.dumps({n: os.environ[n] for n in names}))
    """)
    status, out, err, _ = here(monkeypatch, "-np", "4", "-H", "localhost:1,hostA:2,hostB:2",
                               "--ssh-command", str(ssh), "--ssh-port", "2222", "-x", "FOO=bar",
                               *code, FAKE_SSH_LOG=str(log), LOCAL_ONLY="1")
    assert status == 0, err
    ranks = {int(v["GRADSYNC_RANK"]): v for v in
             (json.loads(line.split(":", 1)[1]) for line in out)}
    placement = {r: (v["GRADSYNC_HOSTNAME"], v["GRADSYNC_LOCAL_RANK"], v["GRADSYNC_LOCAL_SIZE"],
                     v["GRADSYNC_CROSS_RANK"], v["GRADSYNC_CROSS_SIZE"])
                 for r, v in ranks.items()}
    assert placement == {0: ("localhost", "0", "1", "0", "3"), 1: ("hostA", "0", "2", "1", "3"),
                         2: ("hostA", "1", "2", "0", "1"), 3: ("hostB", "0", "1", "2", "3")}
    assert all(v["FOO"] == "bar" for v in ranks.values())
    # Remote ranks get their identity and -x, not the launcher's whole environment.
    assert [r for r, v in ranks.items() if "LOCAL_ONLY" in v] == [0]
    secret = ranks[0]["GRADSYNC_SECRET"]
    assert len(secret) == 64 and all(v["GRADSYNC_SECRET"] == secret for v in ranks.values())
    # Every rank must reach the store at the same address (local ones included).
    assert len({v["GRADSYNC_STORE_ADDR"] for v in ranks.values()}) == 1
    calls = log.read_text()
    assert secret not in calls  # it went over stdin, not onto a command line
    # Per host a reachability check, then one call per rank (hostB's second slot is unused).
    hosts = re.findall(r"^-o BatchMode=yes -o ConnectTimeout=\d+ -p 2222 (\S+) ", calls, re.M)
    assert sorted(hosts) == ["hostA", "hostA", "hostA", "hostB", "hostB"]
    assert calls.count("BatchMode") == len(hosts)


@pytest.mark.multiprocess
def test_remote_failure_stops_local_and_remote_ranks(fake_ssh, monkeypatch):
    ssh, log = fake_ssh
    code = rank_code(f"""
        print(os.getpid(), time.time(), flush=True)
        if rank == 2:
            time.sleep(0.3)
            sys.exit(4)
        time.sleep({NAP})
    """)
    status, out, err, ended = here(monkeypatch, "-np", "3", "-H", "localhost:1,hostB:2",
                                   "--ssh-command", str(ssh), "--no-output-prefix", *code,
                                   FAKE_SSH_LOG=str(log))
    assert status == 4
    assert err[-1] == "gradsync run: rank 2 on host hostB exited with status 4; " \
                      "stopped 2 other ranks"
    assert ended - max(float(line.split()[1]) for line in out) < STOP_WITHIN + 0.3
    assert wait_gone([int(line.split()[0]) for line in out]) == []


@pytest.mark.multiprocess
def test_unreachable_host_is_reported_before_any_rank_starts(fake_ssh, monkeypatch):
    ssh, log = fake_ssh
    status, out, err, _ = here(monkeypatch, "-np", "2", "-H", "localhost:1,unreachable:1",
                               "--ssh-command", str(ssh), sys.executable, "-c", "print('started')",
                               FAKE_SSH_LOG=str(log))
    assert status == 255 and out == []
    assert "cannot run commands on unreachable" in err[-1] and "Connection refused" in err[-1]


def test_lost_connection_kills_the_remote_rank():
    """The remote script's lifeline: when ssh's stdin closes (the launcher died or the
    connection dropped), the remote rank is terminated, by SIGKILL if it ignores SIGTERM."""
    rank = [sys.executable, "-c", "import os, signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"print(os.getpid(), flush=True); time.sleep({NAP})"]
    remote = start(["sh", "-c", remote_script(str(ROOT), {}, rank, 0.5)],
                   stdin=subprocess.PIPE)
    proc = remote.proc
    try:
        proc.stdin.write(b"00ff\n")
        proc.stdin.flush()
        pid = int(proc.stdout.readline())
        proc.stdin.close()  # what a lost connection looks like from the remote side
        assert wait_gone([pid], timeout=5.0) == []
    finally:
        remote.signal(signal.SIGKILL)
        proc.wait(5)


def test_servers_left_running_after_every_worker_ended_are_stopped(monkeypatch):
    """Workers that never reach their servers (here: they just exit) must not leave the job
    waiting on servers forever: the launcher stops them SERVER_LINGER seconds later."""
    from gradsync.run import launcher as launcher_module

    monkeypatch.setattr(launcher_module, "SERVER_LINGER", 0.5)
    code = ("import os, time\n"
            "if int(os.environ['GRADSYNC_RANK']) >= 2: time.sleep(60)\n")
    out, err = io.BytesIO(), io.BytesIO()
    spec = launcher_module.LaunchSpec(command=[sys.executable, "-c", code], num_proc=2,
                                      servers=1, stop_grace=0.5)
    started = time.monotonic()
    status = launcher_module.launch(spec, out, err)
    took = time.monotonic() - started
    assert status == 0, err.getvalue()
    assert took < 15, took
    assert b"still running 0.5s after the last worker ended" in err.getvalue()
    assert b"stopped 1 rank" in err.getvalue()


# What the launcher adds to a rank's environment unless the user set it: glibc's malloc
# thresholds that keep freed memory (unless any malloc setting is given) and one OpenMP thread
# for ranks sharing a host (unless OMP_NUM_THREADS is given). The two rules are independent,
# so each job checks a case of each: three jobs for what were six (docs/testing.md, "Where
# each check lives").
@pytest.mark.parametrize("np_, preset, malloc, threads", [
    (2, {}, ("33554432", "1073741824"), "1"),
    (2, {"MALLOC_TRIM_THRESHOLD_": "131072", "OMP_NUM_THREADS": "3"}, ("unset", "131072"), "3"),
    (1, {"GLIBC_TUNABLES": "glibc.malloc.check=0"}, ("unset", "unset"), "unset")])
def test_ranks_keep_freed_memory_and_get_one_openmp_thread_a_host_unless_told(
        np_, preset, malloc, threads, monkeypatch):
    cmd = rank_code("print('malloc', os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset'), "
                    "os.environ.get('MALLOC_TRIM_THRESHOLD_', 'unset'), "
                    "'threads', os.environ.get('OMP_NUM_THREADS', 'unset'))")
    unset = {k: None for k in os.environ
             if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "OMP_NUM_THREADS")}
    status, out, err, _ = here(monkeypatch, "-np", str(np_), *cmd, **{**unset, **preset})
    assert status == 0, err
    line = "malloc {} {} threads {}".format(*malloc, threads)
    assert [x.split(":", 1)[1] for x in out] == [line] * np_, out


@pytest.mark.parametrize("argv, most", [([], 3), (["--server-restarts", "5"], 5),
                                        (["--server-restarts", "0"], 0)])
def test_a_failed_replicated_server_is_started_again_server_restarts_times(argv, most):
    """``--server-restarts N`` reaches the launcher, which starts a failed replicated server
    rank again N times and then leaves it down, saying so once (a fake starter: no process)."""
    from gradsync.run import launcher as launcher_module
    from gradsync.run.processes import Output

    args = cli.build_parser().parse_args(["run", "-np", "1", "--servers", "2", "--ps-replicas",
                                          "2", *argv, "true"])
    spec = cli._spec(args.run_parser, args)
    assert spec.server_restarts == most
    err = io.BytesIO()
    job = launcher_module._Job(spec, place([Host("localhost", 3)], 3),
                               Output(True, io.BytesIO(), err))

    class Started:  # what Starter.start returns, as far as _restart_server looks
        def __init__(self, slot):
            self.slot = slot

    starts = []
    job.starter.start = lambda slot, *rest: starts.append(slot.rank) or Started(slot)
    job.ranks = [Started(slot) for slot in job.slots]
    for failure in range(most + 3):  # rank 1 fails again after every start
        job._restart_server(job.ranks[1], set())
    assert starts == [1] * most
    text = err.getvalue().decode()
    assert [int(n) for n in re.findall(r"rank 1 started again \((\d+) of \d+\)", text)] == \
        list(range(1, most + 1))
    assert text.count("rank 1 is not started again") == (1 if most else 0)


def test_server_restarts_below_zero_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", "1", "--servers", "2", "--ps-replicas", "2",
                  "--server-restarts", "-1", "true"])
    assert info.value.code == 2
    assert "--server-restarts must be >= 0" in capsys.readouterr().err
