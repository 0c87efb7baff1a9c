"""``gradsync bench``: starts the benchmark's ranks through ``gradsync run``.

    gradsync bench allreduce -np 2 [--compare gloo] [--sizes 4K:64M] ...
    gradsync bench backend -np 2 [--sizes 1M:64M] [--collectives all_reduce,...]
    gradsync bench train -np 2 [--compare ddp] [--model mlp|cnn|both] [--profile] [--overhead] ...
    gradsync bench ps -np 2 --servers 1 [--sizes 1K:64M] [--transport auto|tcp] [--straggler]
    gradsync bench scale -np 16[,64,128,...] [--hosts H] [--emulate auto|netns|names]
    gradsync bench chaos [--hosts H] [--ranks-per-host K] [--minutes T] [--every F] ...
    gradsync bench compress [--hosts H] [--ranks-per-host K] [--task lm|cnn] [--rates ...]
    gradsync bench data -np W [--data-servers D] [--cost-ms 2] [--emulate none|netns]
    gradsync bench BENCHMARK --help      (that benchmark's options)

A benchmark module that defines ``drive`` starts its jobs itself (``ps`` starts one job per
model size, because a parameter server keeps the model of its first hello): it gets the
``gradsync run`` command line built here, ``--servers`` included. ``scale`` starts its ranks
itself too (it emulates hosts, which ``gradsync run`` cannot), and is the one benchmark whose
``-np`` may be a list (a sweep, one run per number) and whose ``--hosts`` is a number of
emulated hosts.

``--json`` means one thing in every command of ``gradsync`` (``gradsync/testbed/rows.py``):
``--json FILE`` writes the rows to FILE as JSON; ``--json`` alone (or ``--json -``) prints them
to stdout. A benchmark's modules take a file only, so for stdout this command gives them a temporary file
and prints it once the job has ended, after the job's own output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Callable

from ..testbed.rows import JSON_HELP

__all__ = ["main", "parse_counts", "BENCHMARKS"]

BENCHMARKS = {"allreduce": "gradsync.bench.allreduce", "backend": "gradsync.bench.backend",
              "chaos": "gradsync.bench.chaos", "compress": "gradsync.bench.compress",
              "data": "gradsync.bench.data",
              "elastic": "gradsync.bench.elastic",
              "probe": "gradsync.bench.probe",
              "ps": "gradsync.bench.ps", "scale": "gradsync.bench.scale",
              "train": "gradsync.bench.train"}

def parse_counts(text: str) -> list[int]:
    """``-np``: ``"16"`` -> [16], ``"16,64"`` -> [16, 64] (a sweep, scale only).

    Raises:
        ValueError: not a comma-separated list of integers of at least 1.
    """
    try:
        counts = [int(part, 10) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a number of ranks or a list of them (16,64)") \
            from None
    if min(counts) < 1:
        raise ValueError(f"{text!r}: the number of ranks must be at least 1")
    return counts


def _common(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
            taken: set[str] = frozenset()) -> None:
    """The options of every benchmark, read here rather than by the benchmark's module;
    those whose names are in ``taken`` (the module's own: chaos's ``--servers``) are left
    out."""
    options = [
        (("-np",), {"dest": "np", "default": "2",
                    "help": "number of ranks (default 2; for ps: of workers; for scale: a "
                            "list too, 16,64,128: one run per number)"}),
        (("-H", "--hosts"), {"help": "hosts and slots, as for gradsync run (for scale, chaos "
                                     "and compress: how many emulated hosts, default one per rank "
                                     "and 4)"}),
        (("--servers",), {"type": int, "metavar": "S",
                          "help": "parameter-server ranks after the -np workers (ps only; "
                                  "default 1)"})]
    for names, settings in options:
        if not taken & set(names):
            parser.add_argument(*names, **settings)


def _parser() -> argparse.ArgumentParser:
    # Help is handled by main(): with a benchmark named, it is that benchmark's help.
    parser = argparse.ArgumentParser(prog="gradsync bench", description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help (or, after BENCHMARK, that benchmark's) and exit")
    parser.add_argument("benchmark", nargs="?", choices=sorted(BENCHMARKS), metavar="BENCHMARK",
                        help=", ".join(sorted(BENCHMARKS)))
    _common(parser)
    return parser


def _module(name: str):
    return __import__(BENCHMARKS[name], fromlist=["parser"])


def benchmark_parser(name: str) -> argparse.ArgumentParser:
    """The whole command line of ``gradsync bench NAME``, for its ``--help``: the module's
    options and the launch options this command reads."""
    parser = _module(name).parser()
    for action in parser._actions:
        if action.dest == "json":  # the modules take a file; main() also offers stdout
            action.nargs, action.const, action.metavar, action.help = "?", "-", "FILE", JSON_HELP
    if name != "probe":  # probe is also "gradsync probe": its usage names no launch options
        _common(parser.add_argument_group("ranks (gradsync bench)"),
                taken=set(parser._option_string_actions))
    return parser


def _json_to_stdout(rest: list[str]) -> tuple[list[str], bool]:
    """Replaces ``--json`` without a file (or ``--json -``) by a temporary file's path.

    Returns:
        The arguments for the benchmark's module, and whether a temporary file is used.
    """
    out = []
    stdout = False
    items = iter(range(len(rest)))
    for i in items:
        arg = rest[i]
        following = rest[i + 1] if i + 1 < len(rest) else None
        if arg == "--json=-" or (arg == "--json" and (following is None or following == "-"
                                                       or following.startswith("-"))):
            stdout = True
            if following == "-":
                next(items, None)  # the "-" is consumed with the option
            continue
        out.append(arg)
    return out, stdout


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.help:
        (benchmark_parser(args.benchmark) if args.benchmark else parser).print_help()
        return 0
    if args.benchmark is None:
        parser.error("name a benchmark: " + ", ".join(sorted(BENCHMARKS)))
    try:
        counts = parse_counts(args.np)
    except ValueError as exc:
        parser.error(f"-np: {exc}")
    if args.benchmark == "scale":
        return _scale(parser, args, counts, rest)
    if args.benchmark == "chaos":
        return _chaos(parser, args, rest)
    if args.benchmark == "compress":
        return _compress(parser, args, rest)
    if len(counts) > 1:
        parser.error("-np takes a list of numbers for the scale benchmark only")
    args.np = counts[0]
    if args.benchmark != "ps" and args.servers is not None:
        parser.error("--servers applies to the ps benchmark only")
    if args.benchmark == "ps":
        if args.hosts:
            parser.error("gradsync bench ps runs on this host (its gRPC peer listens on "
                         "127.0.0.1): leave out -H")
        args.servers = 1 if args.servers is None else args.servers
        if args.servers < 1:
            parser.error("--servers must be at least 1")
    rest, to_stdout = _json_to_stdout(rest)
    if not to_stdout:
        return _run(args, rest)
    return _rows_to_stdout(lambda path: _run(args, [*rest, "--json", path]))


def _rows_to_stdout(run: Callable[[str], int]) -> int:
    """Calls ``run`` with a temporary file for the rows, then prints the file; returns the
    status ``run`` returned."""
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as folder:
        path = os.path.join(folder, "rows.json")
        status = run(path)
        if os.path.exists(path):
            with open(path) as rows:
                sys.stdout.write(rows.read())
        return status


def _scale(parser: argparse.ArgumentParser, args: argparse.Namespace, counts: list[int],
           rest: list[str]) -> int:
    """``gradsync bench scale``: its ``-np`` may be a list, its ``--hosts`` is a number."""
    if args.servers is not None:
        parser.error("--servers applies to the ps benchmark only")
    hosts = None
    if args.hosts is not None:
        if not args.hosts.isdigit() or int(args.hosts) < 1:
            parser.error(f"--hosts {args.hosts!r}: the scale benchmark takes a number of "
                         "emulated hosts (at least 1)")
        hosts = int(args.hosts)
    scale = _module("scale")
    rest, to_stdout = _json_to_stdout(rest)
    options = scale.parser().parse_args(rest)
    if not to_stdout:
        return scale.drive(counts, hosts, options)

    def run(path: str) -> int:
        options.json = path
        return scale.drive(counts, hosts, options)

    return _rows_to_stdout(run)


def _chaos(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    """``gradsync bench chaos``: its ``--hosts`` is a number of emulated hosts (default 4);
    its size is hosts x ``--ranks-per-host`` (less one host per server in a server job, whose
    ``--servers`` is the chaos module's), so it takes no ``-np``."""
    if args.np != "2":
        parser.error("gradsync bench chaos takes no -np: its job is --hosts x "
                     "--ranks-per-host workers (a server job: one host per server)")
    if args.servers is not None:  # a parameter-server job (chaos_servers.py)
        rest = ["--servers", str(args.servers), *rest]
    hosts = args.hosts or "4"
    if not hosts.isdigit() or int(hosts) < 2:
        parser.error(f"--hosts {hosts!r}: the chaos benchmark takes a number of emulated hosts "
                     "(at least 2)")
    return _on_emulated_hosts("chaos", int(hosts), rest)


def _compress(parser: argparse.ArgumentParser, args: argparse.Namespace,
              rest: list[str]) -> int:
    """``gradsync bench compress``: as chaos, ``--hosts`` is a number of emulated hosts
    (default 4) and the ranks are ``--hosts`` x ``--ranks-per-host``, so no ``-np``."""
    if args.np != "2":
        parser.error("gradsync bench compress takes no -np: its job is --hosts x "
                     "--ranks-per-host ranks")
    if args.servers is not None:
        parser.error("--servers applies to the ps and chaos benchmarks only")
    hosts = args.hosts or "4"
    if not hosts.isdigit() or int(hosts) < 2:
        parser.error(f"--hosts {hosts!r}: the compress benchmark takes a number of emulated "
                     "hosts (at least 2)")
    return _on_emulated_hosts("compress", int(hosts), rest)


def _on_emulated_hosts(name: str, hosts: int, rest: list[str]) -> int:
    """Runs bench ``name``'s ``drive(hosts, options)`` (chaos, compress: jobs on ``hosts``
    emulated hosts), its ``--json`` without a file printed to stdout."""
    bench = _module(name)
    rest, to_stdout = _json_to_stdout(rest)
    options = bench.parser().parse_args(rest)
    if not to_stdout:
        return bench.drive(hosts, options)

    def run(path: str) -> int:
        options.json = path
        return bench.drive(hosts, options)

    return _rows_to_stdout(run)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    module = _module(args.benchmark)
    # Validate the benchmark's own options here, before any rank starts.
    options = module.parser().parse_args(rest)
    run = [sys.executable, "-m", "gradsync", "run", "-np", str(args.np),
           *(["--servers", str(args.servers)] if args.servers else []),
           *(["-H", args.hosts] if args.hosts else [])]
    if hasattr(module, "drive"):
        return module.drive(run, options, rest, workers=args.np, servers=args.servers)
    return subprocess.call([*run, sys.executable, "-m", module.__name__, *rest])
