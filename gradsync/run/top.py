"""``gradsync top``: a live view of a running job, one row per rank, from its store alone.

Every rank of a job posts its *pace* to the job's store once a second
(``straggler_watch.py``): its newest steps (each step's time and the time it was blocked in
collectives), its operation count, the payload bytes per second of its collectives, its last
operation and its elastic generation; rank 0 adds the straggler verdict and says under
``top/current`` which job (and generation) is the newest to post. ``gradsync top`` reads
those keys, so it reaches a job from any machine that reaches its store, and costs the job
nothing but the store's answers to it.

Each row shows a rank's host, generation, step and operation counts, its steps split into
compute / waiting / communication (milliseconds, averaged over the steps that every rank has
posted, by the same rule that names stragglers: communication is the least any rank blocked
in a step, waiting the rest of a rank's blocked time, compute the step's time not blocked),
MB/s, the last operation and its age, and ``late`` (the steps of the last few it arrived
late in, by the rule). A rank named a straggler is marked ``STRAGGLER`` (and, on a terminal,
drawn in reverse video).

Finding the store: ``--store HOST:PORT``; else the job file the launcher writes on this
machine (``jobfile.py``): ``gradsync top`` takes the newest running job, ``gradsync top JOB``
the one whose id starts with JOB. ``--once`` prints one table (after waiting up to
``--wait`` seconds for every rank's first post) and exits: for scripts and CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from typing import Sequence

from ..rendezvous import Store
from ..straggler_watch import CURRENT_KEY, TOP_NAMESPACE, Judge
from . import jobfile

__all__ = ["main", "build_parser", "read", "table"]

_CLEAR = "\x1b[H\x1b[2J"
_REVERSE, _PLAIN = "\x1b[7m", "\x1b[0m"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync top", allow_abbrev=False,
        description="A live view of a running job: one row per rank, refreshed every second.")
    parser.add_argument("job", nargs="?", metavar="JOB",
                        help="the launcher's job id (or its start) of a job started on this "
                             "machine; default: the newest running one")
    parser.add_argument("--store", metavar="HOST:PORT",
                        help="the job's store, from any machine that reaches it (instead of JOB)")
    parser.add_argument("--once", action="store_true",
                        help="print one table and exit (for scripts and CI)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes (default 1)")
    parser.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                        help="with --once: how long to wait for every rank's first post "
                             "(default 10)")
    return parser


def _connect(args: argparse.Namespace):
    """The torch store client of the job that ``args`` names; exits with a message if none."""
    if args.store:
        host, _, port = args.store.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"gradsync top: --store {args.store}: expected HOST:PORT")
        addr, port_ = host, int(port)
    else:
        entry = jobfile.find(args.job)
        if entry is None:
            which = f"whose id starts with {args.job} " if args.job else ""
            raise SystemExit(f"gradsync top: no running job {which}started on this machine "
                             f"(no file in {jobfile.directory()}); give --store HOST:PORT")
        addr, port_ = entry["store_addr"], int(entry["store_port"])
    from torch.distributed import TCPStore  # imported on use: torch takes a second

    try:
        return TCPStore(addr, port_, None, False, timedelta(seconds=5))
    except (RuntimeError, OSError) as exc:
        raise SystemExit(f"gradsync top: cannot reach the store at {addr}:{port_}: {exc}") \
            from None


def read(base) -> "tuple[dict | None, list, dict]":
    """The newest job's ``{"job", "size"}`` (None before any rank posted), each rank's post
    (None where it has not posted) and rank 0's verdict, from the torch store ``base``."""
    top = Store.over(base, TOP_NAMESPACE, 5.0)
    if not top.check(CURRENT_KEY):
        return None, [], {}
    current = json.loads(top.get(CURRENT_KEY))
    job = Store.over(base, current["job"], 5.0)
    keys = [f"pace/{r}" for r in range(int(current["size"]))]
    if job.add("pace/ready", 0) >= len(keys):  # every rank has posted: one request
        posts = [json.loads(v) for v in job.get_many(keys)]
    else:
        posts = [json.loads(job.get(key)) if job.check(key) else None for key in keys]
    verdict = json.loads(job.get("pace/verdict")) if job.check("pace/verdict") else {}
    return current, posts, verdict


def table(current: dict, posts: list, verdict: dict, colour: bool = False) -> str:
    """The view: a head line and one row per rank."""
    size = len(posts)
    posted = [p for p in posts if p is not None]
    judge = Judge(size, 10, 0.1)
    if len(posted) == size and size:
        steps = [{n: (s, b) for n, s, b in p["steps"]} for p in posts]
        for n in sorted(set.intersection(*(set(s) for s in steps))):
            judge.judge(n, [s[n] for s in steps])
    named = {p["rank"] for p in verdict.get("named", [])}
    gen = next((p["generation"] for p in posted), -1)
    head = (f"gradsync top: job {current['job']}, {size} ranks"
            f"{'' if gen < 0 else f', generation {gen}'}, {len(posted)} posting; step "
            f"{judge.step or '-'} judged; stragglers: "
            f"{', '.join(f'rank {r}' for r in sorted(named)) or 'none'}")
    columns = (f"{'rank':>4} {'host':<16} {'gen':>3} {'step':>6} {'ops':>8} {'step ms':>8} "
               f"{'compute':>8} {'wait':>8} {'comm':>8} {'MB/s':>8} {'late':>5}  last operation")
    lines = [head, columns]
    for r, post in enumerate(posts):
        if post is None:
            lines.append(f"{r:>4} {'(no post yet)':<16}")
            continue
        pace = judge.pace(r, post["host"], late_only=False)
        late = f"{pace.late_steps}/{pace.steps}" if pace.steps else "-"
        row = (f"{r:>4} {post['host'][:16]:<16} {post['generation']:>3} {post['step']:>6} "
               f"{post['ops']:>8} {pace.step_ms:>8.1f} {pace.compute_ms:>8.1f} "
               f"{pace.wait_ms:>8.1f} {pace.comm_ms:>8.1f} {post['bytes_s'] / 1e6:>8.2f} "
               f"{late:>5}  {post.get('last') or '-'}")
        if r in named:
            row = f"{_REVERSE}{row} STRAGGLER{_PLAIN}" if colour else f"{row} STRAGGLER"
        lines.append(row)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``gradsync top``; returns its exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _show(args, _connect(args))
    except KeyboardInterrupt:
        return 0


def _show(args: argparse.Namespace, base) -> int:
    colour = sys.stdout.isatty()
    deadline = time.monotonic() + args.wait
    while True:
        try:
            current, posts, verdict = read(base)
        except (RuntimeError, OSError) as exc:
            print(f"gradsync top: the job's store is gone ({exc})", file=sys.stderr)
            return 0 if not args.once else 1
        complete = current is not None and all(p is not None for p in posts)
        if args.once:
            if complete or time.monotonic() >= deadline:
                if current is None:
                    print("gradsync top: no rank of the job has posted its pace yet "
                          "(GRADSYNC_STRAGGLER_INTERVAL=0 turns posting off)", file=sys.stderr)
                    return 1
                print(table(current, posts, verdict, colour))
                return 0
            time.sleep(0.2)
            continue
        shown = (table(current, posts, verdict, colour) if current is not None else
                 "gradsync top: waiting for the job's ranks to post their pace ...")
        print(_CLEAR + shown, flush=True)
        time.sleep(args.interval)
