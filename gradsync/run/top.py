"""``gradsync top``: a live view of a running job, one row per rank, from its store alone.

Every rank of a job posts its *pace* to the job's store once a second
(``straggler_watch.py``): its steps since its last post (each step's time and the time it
was blocked in collectives), its operation count, the payload bytes per second of its
collectives, its last operation and its elastic generation; rank 0 adds the straggler
verdict and says under ``top/current`` which job (and generation) is the newest to post.
``gradsync top`` reads those keys, so it reaches a job from any machine that reaches its
store, and costs the job nothing but the store's answers to it.

Each row shows a rank's host, generation, step and operation counts, its steps split into
compute / data / waiting / communication (milliseconds, averaged over the steps that every
rank has posted, by the same rule that names stragglers: communication is the least any rank
blocked in a step, waiting the rest of a rank's blocked time, data the time its loop waited
for its next batch, compute the rest of the step),
the MB/s of its operations' payload and the MB/s it moved through each tier of the topology
(``local``: the host's shared memory; ``host``: the network between hosts; ``group``: between
groups of hosts, where the topology names them; ``traffic.py``), the last operation and its
age, and ``late`` (the steps of the last few it arrived late in, by the rule). A rank named a straggler is marked ``STRAGGLER`` (and, on a terminal,
drawn in reverse video).

Finding the store: ``--store HOST:PORT``; else the job file the launcher writes on this
machine (``jobfile.py``): ``gradsync top`` takes the newest running job, ``gradsync top JOB``
the one whose id starts with JOB. ``--once`` prints one table (after waiting up to
``--wait`` seconds for every rank's first post and a step of all of them judged) and exits 0:
for scripts and CI. Once the job has ended (its launcher's store with it), both forms say so;
``--once`` then exits 1, the live view 0. On a terminal the live view redraws in place, its
rows cut to the terminal's width (the last operation gives way, not the STRAGGLER mark).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import shutil
import sys
import time
from datetime import timedelta
from typing import Sequence

from ..cluster.rendezvous import Store
from ..cluster.topology import TIERS
from ..liveness.straggler_watch import CURRENT_KEY, TOP_NAMESPACE, Judge, Ledger
from . import jobfile

__all__ = ["main", "build_parser", "read", "table"]

_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_WINDOW = 10  # steps judged together (straggler_window's default)
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
    # A plain connection first: where nothing listens (the job has ended), torch's client
    # retries until its timeout and prints C++ stack traces meanwhile.
    try:
        socket.create_connection((addr, port_), timeout=5.0).close()
    except OSError as exc:
        raise SystemExit(f"gradsync top: cannot reach the store at {addr}:{port_} ({exc}): "
                         "has the job ended?") from None
    # torch's C++ logs each failed store request as a warning with its C++ stack (at the
    # job's end, 20 lines over the view's last table); top says what failed itself. Read
    # when torch loads, so set before; a user's own setting wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
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


class View:
    """What the view keeps from one read to the next (one per job it shows).

    Ranks post once a second each, at their own moments: one read often finds no step that
    every rank's post holds, so the view keeps the steps of its reads and judges each once
    every rank's has come, as rank 0 does (``straggler_watch.Ledger``). A rank posts only
    when it moved: ``changed`` holds when its post last changed, on this clock, so that the
    age of its last operation keeps growing while it waits (the post's own age is as old as
    the post).
    """

    def __init__(self, current: dict):
        self.key = (current["job"], int(current["size"]))
        size = self.key[1]
        self.ledger = Ledger(size, _WINDOW, 0.1)
        self._moved: list = [None] * size  # (ops, step) of each rank's newest post
        self.changed: list[float] = [0.0] * size

    @property
    def judge(self) -> Judge:
        return self.ledger.judge

    def update(self, posts: list, now: float) -> None:
        for r, post in enumerate(posts):
            if post is not None and (post["ops"], post["step"]) != self._moved[r]:
                self._moved[r], self.changed[r] = (post["ops"], post["step"]), now
        self.ledger.read(posts)


def _aged(last: str, waited: float) -> str:
    """``last`` (a record in words, ending in its age when posted) with ``waited`` more
    seconds of age."""
    if waited < 0.05:
        return last
    return re.sub(r"(\d+(?:\.\d+)?)s ago$", lambda m: f"{float(m[1]) + waited:.1f}s ago", last)


def table(current: dict, posts: list, verdict: dict, colour: bool = False,
          view: "View | None" = None, width: "int | None" = None, now: "float | None" = None) \
        -> str:
    """The view: a head line and one row per rank. ``view`` carries the steps of earlier
    reads (default: this read alone); ``width``: rows are cut to it (a terminal's width: a
    wrapped row would push the next ones, and its own STRAGGLER mark, out of place)."""
    size = len(posts)
    posted = [p for p in posts if p is not None]
    now = time.monotonic() if now is None else now
    if view is None:
        view = View(current)
        view.update(posts, now)
    judge = view.judge
    named = {p["rank"] for p in verdict.get("named", [])}
    gen = next((p["generation"] for p in posted), -1)
    head = (f"gradsync top: job {current['job']}, {size} ranks"
            f"{'' if gen < 0 else f', generation {gen}'}, {len(posted)} posting; step "
            f"{judge.step or '-'} judged; stragglers: "
            f"{', '.join(f'rank {r}' for r in sorted(named)) or 'none'}")
    tiers = [t for t in TIERS if t in ("local", "host")
             or any(t in p.get("tiers", {}) for p in posted)]
    columns = (f"{'rank':>4} {'host':<16} {'gen':>3} {'step':>6} {'ops':>8} {'step ms':>8} "
               f"{'compute':>8} {'data':>8} {'wait':>8} {'comm':>8} {'ops MB/s':>8} "
               + "".join(f"{t + ' MB/s':>10} " for t in tiers) + f"{'late':>5}  last operation")
    lines = [head[:width], columns[:width]]
    for r, post in enumerate(posts):
        if post is None:
            lines.append(f"{r:>4} {'(no post yet)':<16}")
            continue
        pace = judge.pace(r, post["host"], late_only=False)
        if pace.steps:
            late = f"{pace.late_steps}/{pace.steps}"
            split = (f"{pace.step_ms:>8.1f} {pace.compute_ms:>8.1f} {pace.data_ms:>8.1f} "
                     f"{pace.wait_ms:>8.1f} {pace.comm_ms:>8.1f}")
        else:  # no step of it judged yet: nothing measured, not zeros
            late, split = "-", " ".join(f"{'-':>8}" for _ in range(5))
        last = _aged(post.get("last") or "-", now - view.changed[r])
        mark = " STRAGGLER" if r in named else ""
        moved = post.get("tiers", {})  # a job of an older gradsync posts none
        by_tier = "".join(f"{moved[t] / 1e6:>10.2f} " if t in moved else f"{'-':>10} "
                          for t in tiers)
        row = (f"{r:>4} {post['host'][:16]:<16} {post['generation']:>3} {post['step']:>6} "
               f"{post['ops']:>8} {split} {post['bytes_s'] / 1e6:>8.2f} {by_tier}{late:>5}  ")
        if width is not None:  # the last operation gives way, never the mark
            room = max(width - len(row) - len(mark), 0)
            last = last if len(last) <= room else last[:max(room - 3, 0)] + "..."[:room]
        row = (row + last)[:None if width is None else width - len(mark)] + mark
        if mark and colour:
            row = f"{_REVERSE}{row}{_PLAIN}"
        lines.append(row)
    return "\n".join(lines)


def _frame(text: str) -> str:
    """``text`` drawn over the previous frame: from the top left, each line clearing what
    is left of the old one, then clearing below; no clear of the whole screen first, which
    a terminal shows blank for a moment each second (flicker)."""
    return _HOME + (_CLEAR_LINE + "\n").join(text.split("\n")) + _CLEAR_LINE + _CLEAR_BELOW


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
    view = None
    while True:
        try:
            current, posts, verdict = read(base)
        except (RuntimeError, OSError) as exc:
            # The launcher's store goes with the job: the job has ended (or its launcher
            # is gone). Said on a line of its own, below the last table, in both forms.
            print(f"\ngradsync top: the job's store is gone: the job has ended ({exc})",
                  file=sys.stderr)
            return 1 if args.once else 0  # the live view ends with its job
        now = time.monotonic()
        if current is not None:
            if view is None or view.key != (current["job"], int(current["size"])):
                view = View(current)  # the first read, or a new job (generation) posts
            view.update(posts, now)
        complete = current is not None and all(p is not None for p in posts)
        if args.once:
            # One table, once every rank posted and a step of all was judged (or at --wait).
            if (complete and view is not None and view.judge.step) or now >= deadline:
                if current is None:
                    print("gradsync top: no rank of the job has posted its pace yet "
                          "(GRADSYNC_STRAGGLER_INTERVAL=0 turns posting off)", file=sys.stderr)
                    return 1
                print(table(current, posts, verdict, colour, view, now=now))
                return 0
            time.sleep(0.2)
            continue
        width = shutil.get_terminal_size().columns if colour else None
        shown = (table(current, posts, verdict, colour, view, width, now)
                 if current is not None else
                 "gradsync top: waiting for the job's ranks to post their pace ...")
        sys.stdout.write(_frame(shown) if colour else shown + "\n\n")
        sys.stdout.flush()
        time.sleep(args.interval)
