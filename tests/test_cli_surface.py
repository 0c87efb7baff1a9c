"""Pins the command line: a new option or subcommand must be a deliberate change of this file."""

import argparse
import sys
import types

import pytest

from gradsync.run import cli

RUN_OPTIONS = [
    "--bind-to", "--blacklist-cooldown", "--blacklist-cooldown-range", "--elastic-timeout",
    "--fusion-threshold-mb", "--help", "--host-discovery-script", "--hostfile", "--hosts",
    "--log-level", "--max-np", "--min-np", "--network-interface", "--no-output-prefix",
    "--num-proc", "--output-filename", "--output-prefix", "--reset-limit", "--servers",
    "--ssh-command", "--ssh-identity-file", "--ssh-port", "--start-timeout",
    "--timeline-filename", "-H", "-h", "-i", "-np", "-p", "-x",
]


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


def test_run_options_are_pinned():
    assert option_strings(cli.add_run_arguments(argparse.ArgumentParser())) == RUN_OPTIONS


def test_subcommands_are_pinned():
    commands = next(a for a in cli.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    assert sorted(commands.choices) == ["bench", "plan", "probe", "run", "simulate"]


def test_run_defaults_and_command_after_double_dash():
    args = cli.build_parser().parse_args(["run", "-np", "2", "--", "python", "-c", "pass"])
    spec = cli._spec(args.run_parser, args)
    assert list(spec.command) == ["python", "-c", "pass"]
    assert (spec.num_proc, list(spec.hosts), spec.ssh_command, spec.ssh_port,
            spec.start_timeout, spec.output_prefix, dict(spec.env)) == \
        (2, [], "ssh", None, None, True, {})


@pytest.mark.parametrize("argv, message", [
    (["run", "-np", "2"], "no command given"),
    (["run", "-np", "3", "-H", "a:1,b:1", "true"], "3 ranks need 3 slots"),
    (["run", "-np", "0", "true"], "at least 1"),
    (["run", "-np", "1", "-H", "a", "--hostfile", "f", "true"], "not allowed with"),
    (["run", "-np", "1", "-x", "GRADSYNC_RANK=1", "true"], "sets GRADSYNC_RANK"),
])
def test_usage_errors_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_gets_the_remaining_arguments(monkeypatch):
    seen = []
    stub = types.ModuleType("gradsync.bench.cli")
    stub.main = lambda argv: seen.append(argv) or 5
    monkeypatch.setitem(sys.modules, "gradsync.bench.cli", stub)
    assert cli.main(["bench", "allreduce", "--sizes", "1K", "-h"]) == 5
    assert seen == [["allreduce", "--sizes", "1K", "-h"]]


def test_bench_missing_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradsync.bench.cli", None)  # makes the import fail
    assert cli.main(["bench"]) == 2
    assert "gradsync bench is not available" in capsys.readouterr().err
