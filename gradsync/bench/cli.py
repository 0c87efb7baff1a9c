"""``gradsync bench``: starts the benchmark's ranks through ``gradsync run``.

    gradsync bench allreduce -np 2 [--compare gloo] [--sizes 4K:64M] ...
    gradsync bench backend -np 2 [--sizes 1M:64M] [--collectives all_reduce,...]
    gradsync bench train -np 2 [--compare ddp] [--model mlp|cnn|both] [--profile] ...
    gradsync bench ps -np 2 --servers 1 [--sizes 1K:64M] [--transport auto|tcp] [--straggler]

A benchmark module that defines ``drive`` starts its jobs itself (``ps`` starts one job per
model size, because a parameter server keeps the model of its first hello): it gets the
``gradsync run`` command line built here, ``--servers`` included.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

__all__ = ["main"]

BENCHMARKS = {"allreduce": "gradsync.bench.allreduce", "backend": "gradsync.bench.backend",
              "elastic": "gradsync.bench.elastic",
              "probe": "gradsync.bench.probe",
              "ps": "gradsync.bench.ps", "train": "gradsync.bench.train"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("-np", dest="np", type=int, default=2,
                        help="number of ranks (default 2; for ps: of workers)")
    parser.add_argument("-H", "--hosts", help="hosts and slots, as for gradsync run")
    parser.add_argument("--servers", type=int, metavar="S",
                        help="parameter-server ranks after the -np workers (ps only; default 1)")
    args, rest = parser.parse_known_args(argv)
    if args.np < 1:
        parser.error("-np must be at least 1")
    if args.benchmark != "ps" and args.servers is not None:
        parser.error("--servers applies to the ps benchmark only")
    if args.benchmark == "ps":
        if args.hosts:
            parser.error("gradsync bench ps runs on this host (its gRPC peer listens on "
                         "127.0.0.1): leave out -H")
        args.servers = 1 if args.servers is None else args.servers
        if args.servers < 1:
            parser.error("--servers must be at least 1")
    module = __import__(BENCHMARKS[args.benchmark], fromlist=["parser"])
    # Validate the benchmark's own options here, before any rank starts.
    options = module.parser().parse_args(rest)
    run = [sys.executable, "-m", "gradsync", "run", "-np", str(args.np),
           *(["--servers", str(args.servers)] if args.servers else []),
           *(["-H", args.hosts] if args.hosts else [])]
    if hasattr(module, "drive"):
        return module.drive(run, options, rest, workers=args.np, servers=args.servers)
    return subprocess.call([*run, sys.executable, "-m", module.__name__, *rest])
