"""Pins the command line: a new option or subcommand must be a deliberate change of this file."""

import argparse
import sys
import types

import pytest

from gradsync.run import cli

RUN_OPTIONS = [
    "--bind-to", "--blacklist-cooldown", "--blacklist-cooldown-range", "--data-hosts",
    "--data-servers", "--data-workers", "--elastic-timeout",
    "--fusion-threshold-mb", "--help", "--host-discovery-script", "--hostfile", "--hosts",
    "--log-level", "--max-np", "--min-np", "--network-interface", "--no-output-prefix",
    "--num-proc", "--output-filename", "--output-prefix", "--preload", "--ps-replicas",
    "--reset-limit", "--server-restarts", "--servers",
    "--ssh-command", "--ssh-identity-file", "--ssh-port", "--start-method", "--start-timeout",
    "--timeline-filename", "-H", "-h", "-i", "-np", "-p", "-x",
]


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


def test_run_options_are_pinned():
    assert option_strings(cli.add_run_arguments(argparse.ArgumentParser())) == RUN_OPTIONS


def test_subcommands_are_pinned():
    commands = next(a for a in cli.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    assert sorted(commands.choices) == ["bench", "build-native", "plan", "probe", "run", "simulate",
                                        "top"]


def test_top_options_are_pinned():
    from gradsync.run import top

    assert option_strings(top.build_parser()) == ["--help", "--interval", "--once", "--store",
                                                  "--wait", "-h"]


def test_run_defaults_and_command_after_double_dash():
    args = cli.build_parser().parse_args(["run", "-np", "2", "--", "python", "-c", "pass"])
    spec = cli._spec(args.run_parser, args)
    assert list(spec.command) == ["python", "-c", "pass"]
    assert (spec.num_proc, list(spec.hosts), spec.ssh_command, spec.ssh_port,
            spec.start_timeout, spec.output_prefix, dict(spec.env)) == \
        (2, [], "ssh", None, None, True, {})



def test_start_method_exec_by_default_forkserver_on_request_or_from_the_environment(monkeypatch):
    monkeypatch.delenv("GRADSYNC_START_METHOD", raising=False)
    spec = _launched(monkeypatch, ["-np", "2", "python", "t.py"])
    assert (spec.start_method, tuple(spec.preload)) == ("exec", ())
    spec = _launched(monkeypatch, ["-np", "2", "--start-method", "forkserver", "--preload",
                                   "transformers", "--preload", "pandas", "python", "t.py"])
    assert (spec.start_method, tuple(spec.preload)) == ("forkserver", ("transformers", "pandas"))
    monkeypatch.setenv("GRADSYNC_START_METHOD", "forkserver")
    assert _launched(monkeypatch, ["-np", "1", "python", "t.py"]).start_method == "forkserver"
    assert _launched(monkeypatch, ["-np", "1", "--start-method", "exec", "python",
                                   "t.py"]).start_method == "exec"


def test_an_elastic_jobs_templates_also_hold_what_a_first_optimizer_imports(monkeypatch):
    """Every worker of an elastic job trains, and torch's first optimizer imports
    ``torch._dynamo`` (1.6 s of CPU): its templates import it once, where installed (``?``),
    after the user's modules; a static job's only on request (forkserver.ELASTIC_PRELOAD)."""
    from gradsync.run.forkserver import ELASTIC_PRELOAD

    assert ELASTIC_PRELOAD == ("?torch._dynamo",)
    specs = []
    monkeypatch.setattr(cli, "launch_elastic", lambda spec, elastic: specs.append(spec) or 0)
    assert cli.main(["run", "-np", "2", "--min-np", "1", "--start-method", "forkserver",
                     "--preload", "pandas", "python", "t.py"]) == 0
    assert tuple(specs[0].preload) == ("pandas", "?torch._dynamo")
    assert tuple(_launched(monkeypatch, ["-np", "2", "--start-method", "forkserver", "python",
                                         "t.py"]).preload) == ()


@pytest.mark.parametrize("argv, message", [
    (["run", "-np", "2"], "no command given"),
    (["run", "-np", "3", "-H", "a:1,b:1", "true"], "3 ranks need 3 slots"),
    (["run", "-np", "0", "true"], "at least 1"),
    (["run", "-np", "1", "--start-method", "spawn", "true"], "invalid choice: 'spawn'"),
    (["run", "-np", "1", "-H", "a", "--hostfile", "f", "true"], "not allowed with"),
    (["run", "-np", "1", "-x", "GRADSYNC_RANK=1", "true"], "sets GRADSYNC_RANK"),
])
def test_usage_errors_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the command's arguments
def _launched(monkeypatch, argv: list[str]):
    """The LaunchSpec ``gradsync run ARGV`` would start (nothing is started)."""
    specs = []
    monkeypatch.setattr(cli, "launch", lambda spec: specs.append(spec) or 0)
    assert cli.main(["run", *argv]) == 0
    return specs[0]


def _prefixes() -> list[str]:
    """Every prefix of every option of gradsync run, taken from its parser: what argparse's
    prefix matching would have read as a launcher option."""
    options = cli.option_values(cli.build_parser().get_default("run_parser"))
    return sorted({option[:end] for option in options for end in range(2, len(option) + 1)})


@pytest.mark.parametrize("word", _prefixes())
def test_each_launcher_option_prefix_after_the_command_is_the_commands(word, monkeypatch):
    # With and without a value after it, and joined to one by "=" (argparse splits "--n=3").
    argv = ["python", "train.py", word, "3", f"{word}=x", word]
    spec = _launched(monkeypatch, ["-np", "2", *argv])
    assert list(spec.command) == argv
    assert (spec.num_proc, spec.servers, list(spec.hosts), dict(spec.env)) == (2, 0, [], {})


def test_the_issues_command_line_reaches_the_script(monkeypatch):
    argv = ["python", "script.py", "--n", "3", "--out", "x", "--b", "1", "--", "-h"]
    assert list(_launched(monkeypatch, ["-np", "1", *argv]).command) == argv


def test_launcher_options_before_the_command_are_read_and_after_it_are_not(monkeypatch):
    spec = _launched(monkeypatch, ["-np=2", "--servers", "1", "-xA=1", "-x", "B=2",
                                   "--blacklist-cooldown", "4", "--no-output-prefix", "--",
                                   "python", "t.py", "-np", "5", "--servers", "3", "-x", "C=3"])
    assert (spec.num_proc, spec.servers, spec.output_prefix, dict(spec.env)) == \
        (2, 1, False, {"A": "1", "B": "2"})
    assert list(spec.command) == ["python", "t.py", "-np", "5", "--servers", "3", "-x", "C=3"]


@pytest.mark.parametrize("argv, message", [
    (["--num", "2", "true"], "--num is not an option of gradsync run; did you mean --num-proc?"),
    (["-np", "1", "--out", "d", "true"],
     "did you mean --output-filename or --output-prefix?"),
    (["-n", "2", "true"], "-n is not an option of gradsync run; did you mean -np?"),
    (["-np", "1", "--lr", "0.1", "python", "t.py"], "--lr is not an option of gradsync run ("),
])
def test_an_abbreviated_or_unknown_option_before_the_command_is_a_usage_error(argv, message,
                                                                            capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gradsync run") and message in err


def test_split_command_cuts_at_the_first_word_that_is_no_option_or_value():
    values = {"-a": 1, "--flag": 0, "--pair": 2}
    assert cli.split_command(["-a", "-1", "--flag", "--pair", "x", "y", "cmd", "-a", "--"],
                             values) == (["-a", "-1", "--flag", "--pair", "x", "y"],
                                         ["cmd", "-a", "--"])
    assert cli.split_command(["-a=v", "-av", "--", "--flag"], values) == \
        (["-a=v", "-av"], ["--flag"])
    assert cli.split_command(["--flag", "-", "x"], values) == (["--flag"], ["-", "x"])
    assert cli.split_command(["--flag"], values) == (["--flag"], [])


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


def test_the_chaos_benchmarks_help_names_its_server_jobs(capsys):
    # Its --servers is its own (a parameter-server job): the launch options' --servers is
    # left out of its help instead of colliding with it.
    from gradsync.bench.cli import main as bench_main
    assert bench_main(["chaos", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradsync bench chaos")
    for option in ("--servers S", "--data-servers D", "--ps-replicas R", "--hosts HOSTS"):
        assert option in out, option


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
