"""Pins the command line: a new option or subcommand must be a deliberate change of this file."""

import argparse
import sys
import types

import pytest

from gradsync.run import cli

RUN_OPTIONS = [
    "--bind-to", "--blacklist-cooldown", "--blacklist-cooldown-range", "--data-servers",
    "--elastic-timeout",
    "--fusion-threshold-mb", "--help", "--host-discovery-script", "--hostfile", "--hosts",
    "--log-level", "--max-np", "--min-np", "--network-interface", "--no-output-prefix",
    "--num-proc", "--output-filename", "--output-prefix", "--ps-replicas",
    "--reset-limit", "--servers",
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
    assert sorted(commands.choices) == ["bench", "build-native", "plan", "probe", "run", "simulate"]


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


# ---------------------------------------------------------------- each command's own help
@pytest.mark.parametrize("name, option", [
    ("allreduce", "--compare"), ("train", "--model"), ("ps", "--transport"),
    ("backend", "--collectives"), ("elastic", "--kill-at")])
def test_a_benchmarks_help_is_its_own(name, option, capsys):
    from gradsync.bench.cli import main as bench_main
    assert bench_main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gradsync bench {name}")
    assert option in out and "-np NP" in out
    assert ("--json [FILE]" in out) == (name != "elastic")  # elastic writes no rows


def test_bench_help_without_a_benchmark_lists_them(capsys):
    from gradsync.bench.cli import main as bench_main
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradsync bench") and "allreduce, backend" in out


def test_probe_help_is_probes(capsys):
    assert cli.main(["probe", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: gradsync probe")


# ---------------------------------------------------------------- --json: one meaning
@pytest.mark.parametrize("argv, rest, stdout", [
    (["--sizes", "1K", "--json"], ["--sizes", "1K"], True),
    (["--json", "--sizes", "1K"], ["--sizes", "1K"], True),
    (["--json", "-", "--sizes", "1K"], ["--sizes", "1K"], True),
    (["--json=-"], [], True),
    (["--json", "rows.json"], ["--json", "rows.json"], False),
    (["--json=rows.json"], ["--json=rows.json"], False),
])
def test_bench_json_without_a_file_goes_to_stdout(argv, rest, stdout):
    from gradsync.bench.cli import _json_to_stdout
    assert _json_to_stdout(argv) == (rest, stdout)


def test_bench_json_to_stdout_prints_the_rows_after_the_job(monkeypatch, capsys):
    from gradsync.bench import cli as bench_cli
    seen = []

    def run(args, rest):
        seen.append(rest)
        with open(rest[rest.index("--json") + 1], "w") as out:
            out.write('[{"size": 4}]\n')
        return 0

    monkeypatch.setattr(bench_cli, "_run", run)
    assert bench_cli.main(["allreduce", "--sizes", "4", "--json"]) == 0
    assert capsys.readouterr().out == '[{"size": 4}]\n'
    assert seen[0][:2] == ["--sizes", "4"] and seen[0][2] == "--json"


def test_plan_json_prints_or_writes_the_same_rows(tmp_path, capsys):
    import json
    argv = ["plan", "--hosts", "a:2", "--sizes", "4K:16K"]
    assert cli.main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--json", str(tmp_path / "rows.json")]) == 0
    assert "predicted allreduce time" in capsys.readouterr().out  # the table, with a file
    assert json.loads((tmp_path / "rows.json").read_text()) == printed
    assert [r["size"] for r in printed] == [4096, 16384]
