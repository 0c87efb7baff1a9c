"""Roles started by the launcher: a parameter server runs the server entry point, not the user's
script (``python -m gradsync.ps``, docs/launch.md "What each rank runs").

The launcher's choice of command per rank is pure logic, tested without processes; one real
job shows that only the workers ran the script and that the launcher names the server's entry
point. What the launcher does with a server that fails, ends or prints is tested in
test_launcher.py with a ``python -c`` server (``LaunchSpec.server_command``); the foreign
launchers' road (every rank runs the script, ``init()`` serves on a server rank) in test_ps.py
(``harness.spawn``).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from gradsync.errors import ConfigError

import harness


# ---------------------------------------------------------------- which command (no processes)
@pytest.mark.parametrize("command, python", [
    (["python3", "train.py"], "python3"),
    (["/opt/venv/bin/python3.12", "-u", "train.py"], "/opt/venv/bin/python3.12"),
    (["python", "-m", "trainer"], "python"),
    (["./train.sh"], sys.executable),  # no interpreter to take: the launcher's own
    (["pythonista", "x"], sys.executable),
])
def test_a_server_runs_the_entry_point_with_the_jobs_python(command, python):
    from gradsync.run.launcher import server_entry

    assert server_entry(command) == [python, "-m", "gradsync.ps"]


def test_only_the_parameter_servers_run_the_entry_point():
    from gradsync.run.launcher import LaunchSpec

    spec = LaunchSpec(command=["python3", "train.py"], num_proc=2, servers=2, data_servers=1)
    assert [list(spec.command_of(r)) for r in range(spec.size)] == [
        ["python3", "train.py"], ["python3", "train.py"],              # workers
        ["python3", "-m", "gradsync.ps"], ["python3", "-m", "gradsync.ps"],  # servers
        ["python3", "train.py"]]  # a data server serves the script's Loader: it runs it
    chosen = LaunchSpec(command=["python3", "train.py"], num_proc=1, servers=1,
                        server_command=["my-server"])
    assert list(chosen.command_of(1)) == ["my-server"]


def test_the_entry_point_on_a_rank_that_is_no_server_says_so(monkeypatch):
    from gradsync.ps.__main__ import main

    for name in [n for n in os.environ if n.startswith("GRADSYNC_")]:
        monkeypatch.delenv(name)
    for name, value in {"GRADSYNC_RANK": "0", "GRADSYNC_SIZE": "3", "GRADSYNC_SERVERS": "1",
                        "GRADSYNC_STORE_ADDR": "127.0.0.1",
                        "GRADSYNC_STORE_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"rank 0 of 3 is no server \(GRADSYNC_SERVERS=1: "
                                          r"the last 1 ranks serve\)"):
        main()


# ---------------------------------------------------------------- a real job
@pytest.mark.multiprocess
def test_under_gradsync_run_only_the_workers_run_the_script(tmp_path):
    # Each process that runs tests/ranks/roles_record.py leaves a file named by its pid.
    r = harness.launch(2, "roles_record.py", str(tmp_path), timeout=90,
                       env={"GRADSYNC_LOG_LEVEL": "INFO"}, launcher_args=("--servers", "1"))
    assert r.returncode == 0, r
    ran = {int(p.name): p.read_text() for p in tmp_path.iterdir()}
    assert sorted(ran.values()) == ["0", "1"], r
    # The launcher's rank table: the workers are the processes that ran the script, the server
    # is the entry point, and it says so (its own INFO line names the same pid).
    table = {int(m[0]): (m[1], int(m[2]), m[3]) for m in re.findall(
        r"^gradsync run: rank (\d) \(([a-z 0-9]+)\) on host localhost: pid (\d+)(.*)$",
        r.output, re.M)}
    assert sorted(table) == [0, 1, 2], r
    assert {ran[table[rank][1]] for rank in (0, 1)} == {"0", "1"}, r
    role, pid, runs = table[2]
    assert role == "parameter server 0" and pid not in ran, r
    assert runs == f", {os.path.basename(sys.executable)} -m gradsync.ps", r
    assert f"rank 2 of 3 on host localhost (pid {pid}, local rank 2): parameter server 0" \
        in r.output, r
