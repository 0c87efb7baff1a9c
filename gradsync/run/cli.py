"""The ``gradsync`` command: ``gradsync run`` starts a job, ``gradsync bench`` measures,
``gradsync top`` shows a running job (``top.py``).

``gradsync run -np 4 -H a:2,b:2 python train.py`` is horovodrun's command line; see
``launcher.py`` for what the launcher does with it. ``--servers S`` adds S parameter-server
ranks after the NP workers (the job's last S ranks); ``--data-servers D`` adds D data-server
ranks after those (``gradsync.data``). ``tests/test_cli_surface.py`` pins the
options of ``run``: adding one is a deliberate change of that list.

Everything from the command on belongs to the command. argparse, left to itself, reads the
whole line and matches prefixes of its options, so ``gradsync run -np 1 python train.py --n 3``
died with "ambiguous option: --n could match --num-proc, --network-interface, ...". So
``split_command`` cuts the line first, by one rule, and argparse sees only the launcher's part:
the launcher's options come first, each written in full (no abbreviations: an option added
later can never change what an existing command line means); the command starts at the first
word that is neither such an option nor one of its values, or after ``--``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Mapping, Sequence

from ..config import ENV_PREFIX, HOROVOD_IDENTITY, IDENTITY_VARIABLES
from . import binding
from .elastic import ElasticSpec, launch_elastic
from .forkserver import ELASTIC_PRELOAD
from .hosts import Host, parse_hosts, read_hostfile
from .launcher import DEFAULT_START_TIMEOUT, LaunchSpec, is_local, launch, place
from .ranks import SERVER_RESTARTS, START_METHODS

__all__ = ["main", "build_parser", "add_run_arguments", "split_command", "option_values",
           "parse_hosts", "read_hostfile", "resolve_exports", "flag_settings"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``gradsync`` command and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Distributed training: launch jobs and measure them.",
        allow_abbrev=False)
    from .. import __version__  # the package's one version (pyproject reads it too)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    run = add_run_arguments(commands.add_parser(
        "run", help="start a job's ranks on this host or over ssh", allow_abbrev=False,
        description="Start COMMAND as NP ranks, forward their output, and stop every rank "
                    "when one fails (exiting with that rank's status). With --servers, a "
                    "failing worker is reported and the other ranks go on. The options come "
                    "first, written in full; everything from COMMAND on (or after --) is "
                    "the command's."))
    # On the top parser, so that main() finds run's parser before parsing, and usage errors
    # found later print run's usage.
    parser.set_defaults(run_parser=run)
    # ``bench`` owns its arguments: main() hands them over before this parser sees them, and
    # the entry here only lists it in ``gradsync --help``.
    commands.add_parser("bench", add_help=False,
                        help="collective, training and parameter-server benchmarks")
    commands.add_parser("plan", add_help=False,
                        help="the planner's predicted time per algorithm and size")
    commands.add_parser("probe", add_help=False,
                        help="measure each network tier, write a topology file")
    commands.add_parser("simulate", add_help=False,
                        help="project training steps to any number of GPUs of a cluster")
    commands.add_parser("build-native", add_help=False,
                        help="build the compiled kernel ahead of first use, say where it is")
    commands.add_parser("top", add_help=False,
                        help="a live view of a running job: one row per rank")
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of ``gradsync run`` to ``parser`` (returned for chaining)."""
    job = parser.add_argument_group("job")
    job.add_argument("-np", "--num-proc", type=int, required=True, metavar="NP",
                     help="number of ranks")
    job.add_argument("--servers", type=int, default=0, metavar="S",
                     help="also start S parameter-server ranks after the NP workers (the last S "
                          "ranks; see gradsync.ps)")
    job.add_argument("--ps-replicas", type=int, metavar="R",
                     default=int(os.environ.get("GRADSYNC_PS_REPLICAS", "1") or 1),
                     help="keep each parameter-server shard on R of the S servers (S a multiple "
                          "of R): a lost server costs no acknowledged update and the job goes "
                          "on (GRADSYNC_PS_REPLICAS)")
    job.add_argument("--server-restarts", type=int, default=SERVER_RESTARTS, metavar="N",
                     help="with --ps-replicas above 1, start each failed server rank again at "
                          f"most N times while workers run (default {SERVER_RESTARTS}): a long "
                          "soak that kills servers often needs more; in an elastic job, each "
                          "failed data server too")
    job.add_argument("--data-servers", type=int, default=0, metavar="D",
                     help="also start D data-server ranks, the job's last D ranks, that load, "
                          "cache and transform the data for the workers (see gradsync.data); "
                          "in an elastic job they run outside the workers' generations, on "
                          "this machine unless --data-hosts places them")
    job.add_argument("--data-hosts", metavar="HOST:SLOTS,...",
                     help="with --data-servers, the hosts that run the data servers, filled "
                          "in order, and no worker (even when -H or the discovery script "
                          "lists them); default: after the workers in -H's slots (an elastic "
                          "job: this machine)")
    job.add_argument("--data-workers", type=int, default=None, metavar="K",
                     help="with --data-servers, K producers per data server (forked helper "
                          "processes sharing the server's cache, as a DataLoader's "
                          "num_workers; GRADSYNC_DATA_WORKERS, default 1)")
    where = job.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, filled in order (default localhost:NP+S+D)")
    where.add_argument("--hostfile", metavar="FILE",
                       help="file with one 'host slots=N' per line, instead of -H")
    remote = parser.add_argument_group("remote hosts")
    remote.add_argument("--ssh-command", default="ssh", metavar="CMD",
                        help="command that runs a command on a remote host (default: ssh)")
    remote.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                        help="ssh port of the hosts")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="private key ssh logs in with (ssh -i)")
    remote.add_argument("--start-timeout", type=float, metavar="SECONDS",
                        help="seconds for ssh to connect (default "
                             f"{DEFAULT_START_TIMEOUT:g}); when given, also how long the ranks "
                             "wait for each other in init() (GRADSYNC_CONNECT_TIMEOUT) and, in "
                             "an elastic job, how long a new worker may take to become ready "
                             "(default 120)")
    elastic = parser.add_argument_group(
        "elastic", "re-form the job when workers fail or hosts come (docs/elastic.md); any of "
                   "these makes the job elastic")
    elastic.add_argument("--min-np", type=int, metavar="N",
                         help="fewest workers the job runs with (default: NP)")
    elastic.add_argument("--max-np", type=int, metavar="N",
                         help="most workers the job runs with (default: NP, or no limit with "
                              "--host-discovery-script)")
    elastic.add_argument("--host-discovery-script", metavar="CMD",
                         help="command printing the usable hosts as 'host:slots' lines, run "
                              "every second (instead of -H)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="most re-formations before the job fails (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="how long to wait for hosts while below --min-np (default 600)")
    cooldown = elastic.add_mutually_exclusive_group()
    cooldown.add_argument("--blacklist-cooldown", type=float, metavar="SECONDS",
                          help="seconds a failed host stays out (default: for good)")
    cooldown.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                          metavar=("MIN", "MAX"),
                          help="a failed host stays out MIN*2^n seconds plus up to MIN more at "
                               "its n-th failure, within [MIN, MAX] (horovodrun's rule)")
    env = parser.add_argument_group("environment")
    env.add_argument("-x", action="append", default=[], metavar="VAR[=VALUE]", dest="exports",
                     help="set VAR for every rank, to VALUE or to its value here; repeatable "
                          "(local ranks inherit the whole environment, remote ranks get only "
                          "these and the GRADSYNC_* and HOROVOD_* settings)")
    tuning = parser.add_argument_group(
        "settings", "set the ranks' GRADSYNC_* variable named (docs/configuration.md); a -x of "
                    "that variable wins")
    tuning.add_argument("--network-interface", metavar="NAME",
                        help="network interface the ranks listen on and advertise, e.g. eth1 "
                             "(its address on each host; GRADSYNC_ADDR)")
    tuning.add_argument("--log-level", type=str.upper, metavar="LEVEL",
                        choices=sorted(_LOG_LEVELS, key=list(_LOG_LEVELS).index),
                        help="level of the ranks' gradsync logger: TRACE (as DEBUG), DEBUG, "
                             "INFO, WARNING, ERROR, FATAL (as CRITICAL) (GRADSYNC_LOG_LEVEL); "
                             "at INFO or DEBUG the launcher also names each rank's host and "
                             "pid")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="record a timeline of the Horovod API's operations: rank 0 writes "
                             "FILE, rank r FILE.r (GRADSYNC_TIMELINE)")
    tuning.add_argument("--fusion-threshold-mb", type=int, metavar="MB",
                        help="MiB of small tensors fused into one allreduce "
                             "(GRADSYNC_FUSION_THRESHOLD; default 64)")
    placement = parser.add_argument_group("placement")
    placement.add_argument("--bind-to", choices=binding.MODES, metavar="{core,none,auto}",
                           default=os.environ.get("GRADSYNC_BIND", "none"),
                           help="bind each rank started on this host to cores of its own "
                                "(an equal share, one core when the ranks fill the host), as "
                                "mpirun does (core), or not (none: the default, or "
                                "GRADSYNC_BIND); auto: core when the ranks fit the usable "
                                "cores and the affinity was not restricted already (taskset, "
                                "cpusets)")
    placement.add_argument("--start-method", choices=START_METHODS,
                           default=os.environ.get("GRADSYNC_START_METHOD", "exec"),
                           help="how each rank on this host starts: exec, a new interpreter "
                                "(the default, or GRADSYNC_START_METHOD), or forkserver, forked "
                                "from one process that imported gradsync, torch and NumPy once "
                                "(for `python script.py` and `python -m module` commands of "
                                "this interpreter; docs/launch.md)")
    placement.add_argument("--preload", action="append", default=[], metavar="MODULE",
                           help="with --start-method forkserver, also import MODULE once "
                                "before forking the ranks; repeatable (torch._dynamo for a "
                                "script that builds an optimizer: its first one imports it; "
                                "an elastic job's templates import it anyway)")
    output = parser.add_argument_group("output")
    output.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.<rank>/stdout and "
                             ".../stderr (the rank padded with zeros)")
    output.add_argument("--output-prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="prefix each line of a rank's output with [RANK]<stdout>: or "
                             "[RANK]<stderr>: (default: on)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the program every rank runs, with its arguments")
    return parser


def option_values(parser: argparse.ArgumentParser) -> dict[str, int]:
    """Each option string of ``parser`` and the number of values it takes (0, 1 or more)."""
    values = {}
    for action in parser._actions:  # argparse has no public list of its actions
        if not action.option_strings:
            continue
        count = 1 if action.nargs is None else action.nargs
        # Only a fixed count can be skipped without guessing where the command starts.
        assert isinstance(count, int), f"{action.option_strings}: nargs {action.nargs!r}"
        values.update(dict.fromkeys(action.option_strings, count))
    return values


def split_command(argv: Sequence[str], values: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """Cuts ``gradsync run``'s arguments into the launcher's and the command's.

    The launcher's options come first, each spelled in full: ``--name``, ``--name VALUE``,
    ``--name=VALUE``, and a one-letter option's value may follow it directly (``-p22``). The
    command is the rest from the first word that is neither an option nor an option's value,
    or the rest after ``--``; the launcher never reads it.

    Args:
        argv: the arguments after ``run``.
        values: each launcher option and how many values it takes (``option_values``).

    Returns:
        The launcher's arguments (for argparse) and the command with its arguments.

    Raises:
        ValueError: a word before the command that is not a launcher option, such as an
            abbreviation (its message names the options it abbreviates).
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return list(argv[:index]), list(argv[index + 1:])
        if not word.startswith("-") or word == "-":
            break  # the command
        name, equals, _ = word.partition("=")
        if name in values:
            index += 1 + (0 if equals else values[name])
        elif not word.startswith("--") and values.get(word[:2]) == 1:
            index += 1  # -p22: the value joined to a one-letter option
        else:
            meant = sorted(o for o in values if o.startswith(name))
            hint = f"; did you mean {' or '.join(meant)}?" if meant else ""
            raise ValueError(f"{word} is not an option of gradsync run{hint} (its options are "
                             "spelled in full and come before the command; the command's own "
                             "options go after it)")
    return list(argv[:index]), list(argv[index:])


def resolve_exports(items: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Turns ``-x VAR=value`` and ``-x VAR`` (the launcher's own value) into a mapping.

    Raises:
        ValueError: a bad name, a name gradsync run sets itself, or ``VAR`` not set here.
    """
    exports = {}
    for item in items:
        name, has_value, value = item.partition("=")
        if not name.isidentifier():
            raise ValueError(f"-x {item!r}: {name!r} is not a variable name")
        if (name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] in IDENTITY_VARIABLES) or \
                name in HOROVOD_IDENTITY:
            raise ValueError(f"-x {item!r}: gradsync run sets {name} for each rank itself")
        if not has_value:
            if name not in environ:
                raise ValueError(f"-x {name}: {name} is not set in the launcher's environment")
            value = environ[name]
        exports[name] = value
    return exports


# horovodrun's --log-level names, and the logging level each stands for.
_LOG_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING",
               "ERROR": "ERROR", "FATAL": "CRITICAL", "CRITICAL": "CRITICAL"}


def flag_settings(args: argparse.Namespace) -> dict[str, str]:
    """The GRADSYNC_* variables the settings flags (``--log-level``, ...) give every rank.

    Raises:
        ValueError: a flag's value gradsync cannot honour.
    """
    settings = {}
    if args.network_interface is not None:
        names = [n for n in args.network_interface.split(",") if n]
        if len(names) != 1:
            raise ValueError(f"--network-interface {args.network_interface}: gradsync's ranks "
                             "listen on one interface; name one")
        settings["ADDR"] = names[0]
    if args.log_level is not None:
        settings["LOG_LEVEL"] = _LOG_LEVELS[args.log_level]
    if args.timeline_filename is not None:
        settings["TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            raise ValueError(f"--fusion-threshold-mb must be >= 0, got {args.fusion_threshold_mb}")
        settings["FUSION_THRESHOLD"] = str(args.fusion_threshold_mb << 20)  # MiB, as horovodrun
    if getattr(args, "data_workers", None) is not None:
        if args.data_workers < 1:
            raise ValueError(f"--data-workers must be >= 1, got {args.data_workers}")
        settings["DATA_WORKERS"] = str(args.data_workers)
    return {ENV_PREFIX + name: value for name, value in settings.items()}


def _is_elastic(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.min_np, args.max_np, args.host_discovery_script))


def _elastic_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ElasticSpec:
    """The elastic options as an ElasticSpec; errors exit with usage."""
    try:
        return _checked_elastic(args)
    except ValueError as exc:
        parser.error(str(exc))


def _checked_elastic(args: argparse.Namespace) -> ElasticSpec:
    if args.servers:
        raise ValueError("--servers cannot be combined with an elastic job (--min-np, --max-np, "
                         "--host-discovery-script)")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise ValueError("give --host-discovery-script or -H/--hostfile, not both")
    # The data hosts are fixed for the job's life (its data servers start once); a discovery
    # script that lists one as well only offers slots that no worker takes.
    data_hosts = tuple(_data_hosts(args, [] if args.host_discovery_script else
                                   _worker_hosts(args) or [Host("localhost", 1)]))
    unlimited = 1 << 20
    spec = ElasticSpec(
        min_np=args.num_proc if args.min_np is None else args.min_np,
        max_np=args.max_np if args.max_np is not None else (
            unlimited if args.host_discovery_script else max(args.num_proc, args.min_np or 0)),
        discovery_script=args.host_discovery_script, reset_limit=args.reset_limit,
        elastic_timeout=args.elastic_timeout, blacklist_cooldown=args.blacklist_cooldown,
        blacklist_cooldown_range=(tuple(args.blacklist_cooldown_range)
                                  if args.blacklist_cooldown_range else None),
        data_hosts=data_hosts)
    if not spec.min_np <= args.num_proc <= spec.max_np:
        raise ValueError(f"-np {args.num_proc} must lie between --min-np {spec.min_np} and "
                         f"--max-np {spec.max_np}")
    return spec


def _check_elastic_only(args: argparse.Namespace) -> None:
    if args.blacklist_cooldown_range and not _is_elastic(args):
        raise ValueError("--blacklist-cooldown-range applies to elastic jobs only (--min-np, "
                         "--max-np, --host-discovery-script)")


def _worker_hosts(args: argparse.Namespace) -> list[Host]:
    """The hosts of ``-H`` or ``--hostfile`` (none given: [])."""
    if args.hostfile:
        return read_hostfile(args.hostfile)
    return parse_hosts(args.hosts) if args.hosts else []


def _data_hosts(args: argparse.Namespace, hosts: Sequence[Host]) -> list[Host]:
    """The hosts of ``--data-hosts`` ([] when not given), checked against the data servers
    they are to hold and the workers' ``hosts``.

    Raises:
        ValueError: no --data-servers, too few slots, or a host that is in both lists.
    """
    if args.data_hosts is None:
        return []
    data_hosts = parse_hosts(args.data_hosts, source="--data-hosts")
    if not args.data_servers:
        raise ValueError("--data-hosts places data servers: give --data-servers D too")
    slots = sum(h.slots for h in data_hosts)
    if slots < args.data_servers:
        raise ValueError(f"--data-servers {args.data_servers} need {args.data_servers} slots "
                         f"but --data-hosts {args.data_hosts} has {slots}")
    both = sorted({h.name for h in hosts} & {h.name for h in data_hosts})
    if both:
        raise ValueError(f"host(s) {', '.join(both)} in both --data-hosts and the workers' "
                         "hosts: a data host runs no worker")
    return data_hosts


def _static_hosts(args: argparse.Namespace, hosts: list[Host]) -> list[Host]:
    """A static job's hosts with ``--data-hosts``: the workers' (and parameter servers')
    slots of ``hosts`` (default this machine), cut to the NP + S ranks they hold, then the
    data hosts, so that placing the ranks in order (``ranks.place``) puts the last D, the
    data servers, on the data hosts and nowhere else. Without ``--data-hosts``: ``hosts``."""
    data_hosts = _data_hosts(args, hosts or [Host("localhost", 1)])
    if not data_hosts:
        return hosts
    ranks = args.num_proc + args.servers
    hosts = hosts or [Host("localhost", ranks)]
    total = sum(h.slots for h in hosts)
    if total < ranks:
        raise ValueError(f"{ranks} workers and servers need {ranks} slots on the hosts of "
                         f"-H/--hostfile, which have {total} (--data-hosts run only data "
                         "servers)")
    cut: list[Host] = []
    for host in hosts:
        take = min(host.slots, ranks - sum(h.slots for h in cut))
        if take:
            cut.append(Host(host.name, take))
    return cut + data_hosts


def _check_interface(name: str | None, hosts: Sequence[Host]) -> None:
    """A --network-interface that this host lacks is a usage error when every rank runs here
    (another host's interfaces are checked by its ranks, at init)."""
    if name is None or not all(is_local(h.name) for h in hosts):
        return
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ValueError(f"--network-interface {name}: this host has no such interface "
                         f"(it has {', '.join(names)})")


def _spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LaunchSpec:
    """Checks the parsed options and turns them into a LaunchSpec; errors exit with usage."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (e.g. gradsync run -np 2 python train.py)")
    try:
        _check_elastic_only(args)
        hosts = _worker_hosts(args)
        if not _is_elastic(args):
            hosts = _static_hosts(args, hosts)
        spec = LaunchSpec(command=command, num_proc=args.num_proc, servers=args.servers,
                          ps_replicas=args.ps_replicas,
                          server_restarts=args.server_restarts,
                          data_servers=args.data_servers, hosts=hosts,
                          ssh_command=args.ssh_command, ssh_port=args.ssh_port,
                          start_timeout=args.start_timeout, output_prefix=args.output_prefix,
                          env={**flag_settings(args),
                               **resolve_exports(args.exports, os.environ)},
                          bind_to=args.bind_to, ssh_identity_file=args.ssh_identity_file,
                          start_method=args.start_method,
                          preload=tuple(args.preload) + (ELASTIC_PRELOAD if _is_elastic(args)
                                                         else ()),
                          output_filename=args.output_filename)
        if not _is_elastic(args):
            # Placement is checked here, so that too few slots is a usage error.
            place(hosts or [Host("localhost", spec.size)], spec.size)
        _check_interface(args.network_interface, hosts)
        return spec
    except (OSError, ValueError) as exc:
        parser.error(str(exc))


def _bench(argv: list[str]) -> int:
    try:
        # Imported on use: the benchmarks pull in much more than the launcher needs.
        from ..bench.cli import main as bench_main
    except ImportError as exc:
        print(f"gradsync bench is not available: {exc}", file=sys.stderr)
        return 2
    return bench_main(argv) or 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``gradsync`` command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["plan"]:
        from ..bench import plan
        return plan.main(argv[1:])
    if argv[:1] == ["simulate"]:
        from ..simulate.cli import main as simulate_main
        return simulate_main(argv[1:])
    if argv[:1] == ["probe"]:
        return _bench(["probe", *argv[1:]])
    if argv[:1] == ["build-native"]:
        from .. import _native
        return _native.main(argv[1:])
    if argv[:1] == ["top"]:
        from .top import main as top_main
        return top_main(argv[1:])
    parser = build_parser()
    if argv[:1] == ["run"]:
        run_parser = parser.get_default("run_parser")
        try:
            options, command = split_command(argv[1:], option_values(run_parser))
        except ValueError as exc:
            run_parser.error(str(exc))
        args = parser.parse_args(["run", *options])
        args.command = command
    else:
        args = parser.parse_args(argv)  # --help, --version, or a usage error
    spec = _spec(args.run_parser, args)
    if _is_elastic(args):
        return launch_elastic(spec, _elastic_spec(args.run_parser, args))
    return launch(spec)
