"""A horovodrun script under gradsync run, unchanged: identity variables, HOROVOD_* settings,
horovodrun's flags. Pure logic first, then one real launch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync import config as config_module
from gradsync.config import HOROVOD_IDENTITY, load_config
from gradsync.errors import ConfigError
from gradsync.run import cli
from gradsync.run.launcher import LaunchSpec, Slot, Starter, forwarded_settings

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- identity
def test_each_rank_gets_horovodruns_identity_with_the_same_values():
    starter = Starter(LaunchSpec(command=["true"], num_proc=3), None, "127.0.0.1")
    slot = Slot(rank=2, host="b", local_rank=0, local_size=1, cross_rank=1, cross_size=2)
    identity = starter.identity(slot, 1234, 3)
    assert {n: identity[n] for n in HOROVOD_IDENTITY} == {
        "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "b"}
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                 "HOSTNAME"):
        assert identity["HOROVOD_" + name] == identity["GRADSYNC_" + name]


def test_remote_ranks_get_horovod_settings_but_not_the_launchers_identity():
    environ = {"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_RANK": "7", "GRADSYNC_TIMEOUT": "9",
               "GRADSYNC_RANK": "7", "HOME": "/root"}
    assert forwarded_settings(environ) == {"HOROVOD_FUSION_THRESHOLD": "1024",
                                           "GRADSYNC_TIMEOUT": "9"}


def test_x_cannot_change_a_horovod_identity_variable(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", "1", "-x", "HOROVOD_RANK=3", "true"])
    assert info.value.code == 2
    assert "sets HOROVOD_RANK" in capsys.readouterr().err


# ---------------------------------------------------------------- settings
@pytest.fixture
def fresh_report(monkeypatch):
    monkeypatch.setattr(config_module, "_warned_ignored", False)


@pytest.mark.parametrize("variable, text, field, value", [
    ("HOROVOD_FUSION_THRESHOLD", str(32 << 20), "fusion_threshold", 32 << 20),  # bytes both
    ("HOROVOD_FUSION_THRESHOLD", "0", "fusion_threshold", 0),
    ("HOROVOD_TIMELINE", "/tmp/t.json", "timeline", "/tmp/t.json"),
    ("HOROVOD_TIMELINE", "DYNAMIC", "timeline", ""),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "timeline_mark_cycles", True),
    ("HOROVOD_LOG_LEVEL", "trace", "log_level", "DEBUG"),
    ("HOROVOD_LOG_LEVEL", "fatal", "log_level", "CRITICAL"),
    ("HOROVOD_LOG_LEVEL", "info", "log_level", "INFO"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "20", "stall_warning", 20.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90", "timeout", 90.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0", "timeout", 300.0),  # Horovod's "never"
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "45", "connect_timeout", 45.0),
    ("HOROVOD_GLOO_IFACE", "eth1", "addr", "eth1"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", "algorithm", "hierarchical"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "0", "algorithm", "auto"),
])
def test_horovod_settings_map_to_gradsync_fields_in_gradsync_units(variable, text, field, value):
    assert getattr(load_config(environ={variable: text}), field) == value


def test_gradsync_variable_and_keyword_win_over_horovods():
    environ = {"HOROVOD_FUSION_THRESHOLD": "1024", "GRADSYNC_FUSION_THRESHOLD": "2K",
               "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}
    cfg = load_config({"stall_warning": 7.0}, environ)
    assert (cfg.fusion_threshold, cfg.stall_warning) == (2048, 7.0)


def test_a_bad_horovod_value_names_the_horovod_variable():
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD"):
        load_config(environ={"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ConfigError, match="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        load_config(environ={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "never"})


def test_ignored_settings_are_reported_once_in_one_line_by_rank_0(fresh_report, caplog):
    environ = {"HOROVOD_CYCLE_TIME": "5", "HOROVOD_CACHE_CAPACITY": "0",
               "HOROVOD_WITH_PYTORCH": "1",  # a build setting of Horovod's: not reported
               "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}  # what gradsync always does: not reported
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        load_config(environ={**environ, "GRADSYNC_RANK": "1"})
        assert caplog.records == []  # not rank 0
        load_config(environ=environ)
        load_config(environ=environ)
    assert [r.getMessage() for r in caplog.records] == [
        "gradsync ignores HOROVOD_CACHE_CAPACITY, HOROVOD_CYCLE_TIME (Horovod settings with no "
        "gradsync equivalent; docs/configuration.md lists those it maps)"]


def test_log_level_is_normalised_and_checked():
    assert load_config(environ={"GRADSYNC_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    with pytest.raises(ConfigError, match="log_level"):
        load_config(environ={"GRADSYNC_LOG_LEVEL": "chatty"})


# ---------------------------------------------------------------- a real launch
@pytest.mark.multiprocess
def test_a_horovodrun_script_reads_its_identity_under_gradsync_run():
    code = ("import json, os; print(json.dumps({n: os.environ.get(n) for n in "
            f"{list(HOROVOD_IDENTITY)!r}}}))")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSYNC_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "gradsync", "run", "-np", "2",
                           sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = sorted((json.loads(line.split(":", 1)[1]) for line in proc.stdout.splitlines()),
                  key=lambda v: v["HOROVOD_RANK"])
    assert seen == [{"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                     "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
                     "HOROVOD_CROSS_SIZE": "1", "HOROVOD_HOSTNAME": "localhost"}
                    for r in range(2)]


def test_an_interface_name_stands_for_its_address():
    from gradsync.connect.world import interface_address
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(ConfigError, match="'nosuch0' does not exist"):
        interface_address("nosuch0")


# ---------------------------------------------------------------- horovodrun's flags
def spec_of(*argv: str):
    args = cli.build_parser().parse_args(["run", *argv])
    return cli._spec(args.run_parser, args), args


def test_settings_flags_become_the_ranks_gradsync_variables(tmp_path):
    spec, _ = spec_of("-np", "2", "--network-interface", "lo", "--log-level", "trace",
                      "--timeline-filename", "t.json", "--fusion-threshold-mb", "32",
                      "-x", "GRADSYNC_ADDR=eth2", "python", "x.py")
    assert dict(spec.env) == {"GRADSYNC_ADDR": "eth2",  # -x wins
                              "GRADSYNC_LOG_LEVEL": "DEBUG",
                              "GRADSYNC_TIMELINE": os.path.abspath("t.json"),
                              "GRADSYNC_FUSION_THRESHOLD": str(32 << 20)}  # MiB to bytes


def test_ssh_flags_reach_the_ssh_command_line():
    spec, _ = spec_of("-np", "1", "-p", "2222", "-i", "/keys/id", "true")
    ssh = Starter(spec, None, "127.0.0.1").ssh
    argv = ssh.argv("a", "true")
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/keys/id"
    assert "BatchMode=yes" in argv  # never a password prompt


@pytest.mark.parametrize("argv, message", [
    (["--network-interface", "eth0,eth1"], "listen on one interface"),
    (["--log-level", "loud"], "invalid choice"),
    (["--fusion-threshold-mb", "-1"], "must be >= 0"),
    (["--blacklist-cooldown-range", "5", "50"], "elastic jobs only"),
    (["--min-np", "1", "--blacklist-cooldown-range", "9", "3"], "0 < MIN <= MAX"),
    (["--blacklist-cooldown", "3", "--blacklist-cooldown-range", "1", "3"], "not allowed with"),
])
def test_flag_errors_are_usage_errors_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", "2", *argv, "true"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cooldown_range_backs_off_within_its_bounds():
    from gradsync.run.elastic import ElasticSpec
    spec = ElasticSpec(min_np=1, max_np=2, blacklist_cooldown_range=(10.0, 100.0))
    for failures, (low, high) in {1: (20, 30), 2: (40, 50), 3: (80, 90), 4: (100, 100),
                                  40: (100, 100)}.items():
        assert all(low <= spec.cooldown(failures) <= high for _ in range(20)), failures
    assert ElasticSpec(min_np=1, max_np=2, blacklist_cooldown=5.0).cooldown(3) == 5.0
    assert ElasticSpec(min_np=1, max_np=2).cooldown(1) is None  # for good


@pytest.mark.multiprocess
def test_output_filename_keeps_each_ranks_lines(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = ("import os, sys; r = os.environ['HOROVOD_RANK']; print('out', r); "
            "print('err', r, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-m", "gradsync", "run", "-np", "11",
                           "--output-filename", str(tmp_path / "logs"), sys.executable, "-c",
                           code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == \
        [f"rank.{r:02d}" for r in range(11)]  # padded: they sort in rank order
    for r in range(11):
        folder = tmp_path / "logs" / f"rank.{r:02d}"
        assert (folder / "stdout").read_text() == f"out {r}\n"
        assert (folder / "stderr").read_text() == f"err {r}\n"
    assert "[10]<stdout>:out 10" in proc.stdout  # the console still gets every line


def test_an_interface_this_host_lacks_is_a_usage_error_for_a_local_job(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "-np", "1", "--network-interface", "nosuch0", "true"])
    assert info.value.code == 2
    assert "no such interface" in capsys.readouterr().err
    spec_of("-np", "1", "-H", "far-away-host:1", "--network-interface", "nosuch0", "true")


def test_an_addr_that_is_neither_address_nor_interface_names_both():
    from types import SimpleNamespace
    from gradsync.config import Config
    from gradsync.connect.world import listen_addr
    env = SimpleNamespace(store_addr="127.0.0.1", store_port=1)
    assert listen_addr(Config(addr="lo"), env) == "127.0.0.1"
    with pytest.raises(ConfigError, match="neither an address of this host nor one of its"):
        listen_addr(Config(addr="nosuch0.invalid"), env)
