"""``gradsync plan``: what the planner predicts for each allreduce algorithm, and its choice.

    gradsync plan --hosts h0:2,h1:2 [--alternate] [--topology topo.json] [--sizes 4K:256M]
        [--json [FILE]]

Pure computation, no job: the placement comes from ``--hosts`` (ranks filled host by host,
or dealt across hosts with ``--alternate``), the tiers from ``--topology`` (a file written by
``gradsync probe``) or the defaults. Times are the cost model's (``collectives/planner.py``).
On tiers left to the defaults, the sizes where a job measures the model's choice against a
ring (``planner.Plans``' trials) are listed after the table.
"""

from __future__ import annotations

import argparse
import sys

from ..collectives.planner import CANDIDATES, plan
from ..run.hosts import parse_hosts, rank_hosts
from ..cluster.topology import Topology, load
from .allreduce import size_range
from ..testbed.rows import add_json_option, write_json

__all__ = ["main", "parser", "placement"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", required=True, help="HOST:RANKS,... e.g. h0:2,h1:2")
    p.add_argument("--alternate", action="store_true",
                   help="number ranks across hosts alternately (rank r on host r %% H)")
    p.add_argument("--topology", help="topology file (JSON/YAML) with tiers and groups")
    p.add_argument("--sizes", default="4K:256M", help="MIN:MAX bytes, x4 per row")
    add_json_option(p)
    return p


def placement(hosts: str, alternate: bool) -> list[str]:
    """The host of each rank for ``h0:2,h1:2``-style text (the rules: ``run/hosts.py``).

    Raises:
        ValueError: a bad entry (the message quotes it), a host named twice, or no host.
    """
    return rank_hosts(parse_hosts(hosts, source="--hosts"), alternate)


def main(argv: "list[str] | None" = None) -> int:
    args = parser().parse_args(argv)
    spec = load(args.topology) if args.topology else None
    try:
        ranks = placement(args.hosts, args.alternate)
    except ValueError as exc:
        parser().error(str(exc))
    topo = Topology.from_hosts(ranks, spec)
    rows = plan(topo, size_range(args.sizes, 4))
    if args.json:
        write_json(rows, args.json)
        if args.json == "-":
            return 0
    print("# " + topo.describe().replace("\n", "\n# "))
    print(f"# predicted allreduce time (us) per algorithm; ranks: "
          f"{' '.join(ranks)}")
    print(f"{'size(B)':>12} " + " ".join(f"{a:>16}" for a in CANDIDATES) + f" {'choice':>16}")
    for row in rows:
        print(f"{row['size']:>12} " +
              " ".join(f"{row['predicted'][a] * 1e6:>16.1f}" for a in CANDIDATES) +
              f" {row['choice']:>16}")
    tried = [row for row in rows if row["trial"]]
    if tried:
        print(f"# tier {topo.slowest()} guessed (not in --topology): close calls, measured by a "
              "job's first allreduces of each size class (planner.TRIAL_MARGIN)")
        for row in tried:
            print(f"#   {row['size']}: {row['choice']} or {row['trial']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
