"""``gradsync bench``: starts the benchmark's ranks through ``gradsync run``.

    gradsync bench allreduce -np 2 [--compare gloo] [--sizes 4K:64M] ...
    gradsync bench train -np 2 [--compare ddp] [--model mlp|cnn|both] [--profile] ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys

__all__ = ["main"]

BENCHMARKS = {"allreduce": "gradsync.bench.allreduce", "probe": "gradsync.bench.probe",
              "train": "gradsync.bench.train"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("-np", dest="np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("-H", "--hosts", help="hosts and slots, as for gradsync run")
    args, rest = parser.parse_known_args(argv)
    if args.np < 1:
        parser.error("-np must be at least 1")
    module = BENCHMARKS[args.benchmark]
    # Validate the benchmark's own options here, before any rank starts.
    __import__(module, fromlist=["parser"]).parser().parse_args(rest)
    cmd = [sys.executable, "-m", "gradsync", "run", "-np", str(args.np),
           *(["-H", args.hosts] if args.hosts else []), sys.executable, "-m", module, *rest]
    return subprocess.call(cmd)
