"""``gradsync bench scale``: the runtime at N ranks, beside the limit measured in the same run.

    gradsync bench scale -np 16 [--hosts 4] [--emulate auto|netns|names] [--iters 10]
    gradsync bench scale -np 16,64,128,256 --json scale.json      (a sweep: one run per N)

N ranks over H emulated hosts (default H = N: every rank a host of its own, so every pair of
ranks talks TCP, the case that costs most): network namespaces (``netns.py``'s ``Cluster``)
where this process is root, else host names alone (``GRADSYNC_HOSTNAME``: ranks of different
names talk TCP over loopback, ranks of one name share memory). ``--emulate`` chooses.

**Two jobs per N, in this order (``--repeats R``: R times in turn, the pair of median ratio
reported), on the same emulated hosts and the same store:**

1. *The limit*: the same N processes start, import what a rank imports (torch,
   torch.distributed, gradsync) and meet once at the store, with no gradsync World: what
   any runtime pays before it can do anything (``scale_rank.py``).
2. *gradsync*: the same start and imports, then ``gradsync.init()``, then a small and a
   1 MiB allreduce, first once and then in the steady state.

Both jobs meet at one TCPStore that a process of its own hosts on the first emulated host,
started before either job, as ``gradsync run`` hosts it in the launcher (so rank 0's figures
are those of any rank), and their ranks are started as an external launcher starts them
(torchrun's variables, ``netns.run``; every rank a client of that store). The store's process
imports torch first, so both jobs find its files in the page cache.

**What is reported, per N.** The job's times, from the launch of its first rank: *limit* until
the last rank has met the others, *init* until the last rank's ``init()`` has returned, and
their ratio (the runtime's own share, not the machine's speed: on a machine with fewer cores
than ranks, start-up dominates both). Per phase (start, import, each phase of ``init()``,
``scale_rank.py`` says how each is timed): median and max over ranks. Sockets per rank (max,
and median) before and after ``init()`` and after the allreduces; store requests of the
whole job (summed over ranks, by operation) for ``init()`` and up to the end, or "n/a" where
the running gradsync does not count them; RSS per rank (median) and its growth over the
baseline taken before ``init()``; the first and the steady allreduce time (the first's max
over ranks, the steady one's median of the ranks' medians).

The run never leaves a process behind: every rank and the store's process lead process groups
of their own, and every job has a deadline that grows with N, after which the groups are
killed (``gradsync/run/processes.py``); SIGTERM and SIGHUP stop them as Ctrl-C does. The
descriptor limit (``ulimit -n``) is raised to its hard limit first: the store's process holds
two connections per rank (the heartbeat's own). Memory is checked before each N: a rank holds
about 150 MiB of private memory once torch is imported (``RssAnon``, measured at 16 ranks on
this project's machine), so 256 ranks need some 37 GiB; an N whose ranks would pass 90% of the
memory available is refused rather than left to the kernel's OOM killer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Sequence

from ..run.processes import Process, pump, start, stop
from ..testbed import netns
from .scale_rank import PREFIX

__all__ = ["parser", "drive", "sweep", "measure", "aggregate", "summary_rows", "markdown",
           "deadline", "HostNames", "PHASES", "SUMMARY_COLUMNS"]

PHASES = ("start", "import", "init", "config", "compile", "store", "address table",
          "store requests", "listen", "tcp connect", "shm", "barrier", "world", "heartbeat",
          "engine", "other", "meet")
"""The phases of the per-N table, in order: ``init`` and those after it up to ``other`` are
gradsync's (``other``: what none of them covers), ``meet`` is the limit's."""

_INIT_PHASES = PHASES[PHASES.index("config"):PHASES.index("other")]

SUMMARY_COLUMNS = ("machine", "N", "hosts", "init s", "limit s", "init ÷ limit",
                   "sockets per rank", "store requests", "RSS MiB", "RSS growth MiB",
                   "small first ms", "small steady ms", "1 MiB first ms", "1 MiB steady ms")
"""The columns of the sweep's summary (its markdown table, the plots' source)."""

_STORE_SCRIPT = """\
import sys
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=float(sys.argv[1])),
                 wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the driver closes it (or goes away)
"""

_BOOT = ("import time; t = time.time(); from gradsync.bench.scale_rank import main; "
         "import sys; main(t, sys.argv[1:])")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulate", choices=("auto", "netns", "names"), default="auto",
                   help="emulated hosts: network namespaces (root only), host names alone, "
                        "or namespaces where root (default auto)")
    p.add_argument("--iters", type=int, default=10,
                   help="steady allreduces of each size after the first (default 10)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the limit and gradsync this many times in turn; report the pair "
                        "of median ratio (default 1)")
    p.add_argument("--json", metavar="FILE", help="write one object per N to FILE")
    p.add_argument("--markdown", action="store_true",
                   help="end with the summary as a markdown table (docs/benchmarks.md's)")
    return p


def deadline(ranks: int) -> float:
    """Seconds one job of ``ranks`` ranks may take before it is killed: generous, because on
    a machine with fewer cores than ranks the start-up alone grows with N (about 0.8 s per
    rank was measured on 2 cores)."""
    return 120.0 + 3.0 * ranks


class HostNames(netns.Cluster):
    """Emulated hosts by name alone: no namespace, every rank runs here and gets its host's
    name (``GRADSYNC_HOSTNAME``), as ``netns.run`` gives it inside a cluster."""

    def up(self) -> None:
        pass

    def down(self) -> None:
        pass

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return list(argv)


def _hosts(ranks: int, hosts: int) -> list[tuple[str, int]]:
    """``hosts`` hosts ``h0``, ``h1``, ... with the ranks spread as evenly as they go."""
    return [(f"h{i}", ranks // hosts + (i < ranks % hosts)) for i in range(hosts)]


def _raise_descriptor_limit(ranks: int) -> None:
    """Raises this process's (and so the children's) soft descriptor limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The store's process: two connections per rank; a rank: one per peer at most (a mesh).
    if hard != resource.RLIM_INFINITY and hard < 2 * ranks + 64:
        print(f"# warning: the descriptor limit ({hard}) is below what {ranks} ranks may need "
              f"({2 * ranks + 64}): raise the hard limit (ulimit -Hn) as root", flush=True)


def _start_store(cluster: netns.Cluster, timeout: float):
    """Starts the store's process on the first host; returns it and its port."""
    argv = cluster.exec_argv(cluster.hosts[0].name,
                             [sys.executable, "-c", _STORE_SCRIPT, str(timeout)])
    process = start(argv, stdin=subprocess.PIPE, merge_stderr=True, text=True)
    seen = []
    for line in iter(process.proc.stdout.readline, ""):
        if line.strip().isdigit():
            # Drained for the rest of its life: torch warns on stderr about each client
            # whose host name it cannot look up, and a full pipe would stop the store.
            pump(process.proc.stdout, lambda _line: None, "gradsync-scale-store")
            return process, int(line)
        seen.append(line)
    stop([process])
    raise RuntimeError("the store's process did not start: " + "".join(seen)[-2000:].strip())


def _job(cluster: netns.Cluster, mode: str, ranks: int, port: int,
         options) -> tuple[float, list[dict]]:
    """Runs one job (``mode``: limit or gradsync); returns its launch time and the reports."""
    limit = deadline(ranks)
    addr = "127.0.0.1" if isinstance(cluster, HostNames) else cluster.hosts[0].ip
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port),
           # Every rank a client of the store, as under torchrun's agent (launch_env.py).
           "TORCHELASTIC_USE_AGENT_STORE": "True",
           "GRADSYNC_JOB_ID": f"scale-{os.getpid()}-{ranks}-{mode}-{secrets.token_hex(4)}",
           "GRADSYNC_SECRET": secrets.token_hex(32),
           # The ranks wait for one another at the store: on few cores the last rank may
           # arrive long after the first.
           "GRADSYNC_CONNECT_TIMEOUT": str(limit), "GRADSYNC_TIMEOUT": str(limit)}
    argv = [sys.executable, "-c", _BOOT, "--mode", mode, "--iters", str(options.iters),
            "--timeout", str(limit)]
    launched = time.time()
    results = netns.run(cluster, argv, timeout=limit, env=env, stop_on_failure=True)
    reports, failed = [], []
    for result in results:
        lines = [line for line in result.output.splitlines() if line.startswith(PREFIX)]
        if result.returncode != 0 or len(lines) != 1:
            failed.append(result)
        else:
            reports.append(json.loads(lines[0][len(PREFIX):]))
    if failed:
        first = min(failed, key=lambda r: r.ended)
        why = ("was still running at the deadline" if first.timed_out else
               "was stopped after another rank failed" if first.stopped else
               f"exited with status {first.returncode}")
        raise RuntimeError(f"the {mode} job of {ranks} ranks failed: rank {first.rank} "
                           f"{why} ({limit:.0f} s allowed); its output:\n"
                           f"{first.output[-3000:]}")
    return launched, reports


def measure(ranks: int, hosts: int, emulate: str, options) -> dict:
    """Runs the limit and gradsync at ``ranks`` ranks over ``hosts`` hosts, ``options.repeats``
    times in turn; returns the aggregate (``aggregate``) of the pair whose ratio is the
    median, with every pair's ``init_s``, ``limit_s`` and ``ratio`` under ``repeats``."""
    layout = _hosts(ranks, hosts)
    cluster = (netns.Cluster(layout, prefix="gsscale") if emulate == "netns"
               else HostNames(layout, prefix="gsscale"))
    pairs = []
    with cluster:
        store, port = _start_store(cluster, deadline(ranks))
        try:
            _check_memory(ranks, store)
            for _ in range(options.repeats):
                # In turn, so that a load that comes and goes on a shared machine falls on
                # both jobs alike rather than on one.
                limit = _job(cluster, "limit", ranks, port, options)
                pairs.append(aggregate(_job(cluster, "gradsync", ranks, port, options), limit))
        finally:
            stop([store])
    data = sorted(pairs, key=lambda d: d["ratio"])[(len(pairs) - 1) // 2]
    data.update(hosts=hosts, emulation=emulate, cores=os.cpu_count(), iters=options.iters,
                repeats=[{k: d[k] for k in ("init_s", "limit_s", "ratio")} for d in pairs])
    return data


def _status_mib(pid: int, field: str) -> float:
    """A ``/proc/<pid>/status`` memory field (``RssAnon``, ``MemAvailable``...) in MiB."""
    path = "/proc/meminfo" if pid == 0 else f"/proc/{pid}/status"
    with open(path) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(f"no {field} line in {path}")


def _check_memory(ranks: int, store: Process) -> None:
    """Refuses a job whose ranks would not fit in the memory available.

    Each rank's private memory after its imports is about that of the store's process, which
    has imported torch too: N of them beyond what the machine has would not slow the
    benchmark down but bring the kernel's OOM killer onto whatever runs here.

    Raises:
        RuntimeError: the estimate passes 90% of the memory available.
    """
    try:
        per_rank = _status_mib(store.proc.pid, "RssAnon")
        available = _status_mib(0, "MemAvailable")
    except OSError:
        return  # not Linux's /proc: nothing to estimate from
    need = per_rank * ranks
    if need > 0.9 * available:
        raise RuntimeError(f"{ranks} ranks would hold about {need / 1024:.1f} GiB of private "
                           f"memory ({per_rank:.0f} MiB each after importing torch, as the "
                           f"store's process does), but {available / 1024:.1f} GiB is "
                           f"available: run fewer ranks, or on a machine with more memory")


def _stats(values: list[float]) -> dict | None:
    return ({"median": statistics.median(values), "max": max(values)} if values else None)


def _requests(reports: list[dict], key: str) -> dict | None:
    """The job's store requests (summed over ranks) by operation, with ``total``; None
    where a rank could not count them."""
    counts: dict[str, int] = {}
    for report in reports:
        before, now = report.get("requests_before"), report.get(key)
        if now is None:
            return None
        for op, n in now.items():
            counts[op] = counts.get(op, 0) + n - (before or {}).get(op, 0)
    counts = {op: n for op, n in sorted(counts.items()) if n}
    return {"total": sum(counts.values()), "by_op": counts}


def aggregate(runtime: tuple[float, list[dict]], limit: tuple[float, list[dict]]) -> dict:
    """One N's figures from the ranks' reports of both jobs.

    Args:
        runtime, limit: (the job's launch time, its ranks' reports): gradsync's, the limit's.

    Returns:
        ``ranks``, ``init_s``, ``limit_s``, ``ratio``, ``phases`` (per phase: ``gradsync``
        and ``limit``, each median and max over ranks, None where not measured),
        ``sockets``, ``store_requests``, ``rss_mib`` and ``allreduce``.
    """
    launched, reports = runtime
    limit_launched, limit_reports = limit
    if len(reports) != len(limit_reports) or not reports:
        raise ValueError(f"{len(reports)} gradsync reports and {len(limit_reports)} of the "
                         "limit: the jobs must have the same ranks")
    init_s = max(r["marks"]["init_done"] for r in reports) - launched
    limit_s = max(r["marks"]["met"] for r in limit_reports) - limit_launched
    phases: dict[str, dict] = {}
    for job, base, rs in (("gradsync", launched, reports), ("limit", limit_launched,
                                                            limit_reports)):
        per = {"start": [r["marks"]["boot"] - base for r in rs],
               "import": [r["marks"]["imported"] - r["marks"]["boot"] for r in rs]}
        if job == "limit":
            per["meet"] = [r["marks"]["met"] - r["marks"]["imported"] for r in rs]
        else:
            per["init"] = [r["marks"]["init_done"] - r["marks"]["init_called"] for r in rs]
            instrumented = set(rs[0]["phases_instrumented"])
            for phase in _INIT_PHASES:
                if phase in instrumented:
                    per[phase] = [r["phases"].get(phase, 0.0) for r in rs]
            per["other"] = [r["marks"]["init_done"] - r["marks"]["init_called"]
                            - sum(r["phases"].values()) for r in rs]
        for phase, values in per.items():
            phases.setdefault(phase, {"gradsync": None, "limit": None})[job] = _stats(values)
    rss_before = [r["rss_before_mib"] for r in reports]
    return {
        "ranks": len(reports), "init_s": init_s, "limit_s": limit_s, "ratio": init_s / limit_s,
        "phases": {p: phases[p] for p in PHASES if p in phases},
        "sockets": {"before": _stats([r["sockets_before"] for r in reports]),
                    "init": _stats([r["sockets_init"] for r in reports]),
                    "end": _stats([r["sockets_end"] for r in reports]),
                    "limit": _stats([r["sockets_met"] for r in limit_reports])},
        "store_requests": {"init": _requests(reports, "requests_init"),
                           "end": _requests(reports, "requests_end")},
        "rss_mib": {"before": statistics.median(rss_before),
                    "init": statistics.median(r["rss_init_mib"] for r in reports),
                    "end": statistics.median(r["rss_end_mib"] for r in reports),
                    "growth_init": statistics.median(
                        r["rss_init_mib"] - r["rss_before_mib"] for r in reports),
                    "growth_end": statistics.median(
                        r["rss_end_mib"] - r["rss_before_mib"] for r in reports),
                    "limit": statistics.median(r["rss_before_mib"] for r in limit_reports),
                    "anon_end": statistics.median(r["anon_end_mib"] for r in reports),
                    "anon_growth_end": statistics.median(
                        r["anon_end_mib"] - r["anon_before_mib"] for r in reports)},
        "allreduce": {size: {"bytes": reports[0]["allreduce"][size]["bytes"],
                             "first_ms": max(r["allreduce"][size]["first_ms"] for r in reports),
                             "steady_ms": statistics.median(
                                 r["allreduce"][size]["steady_ms"] for r in reports)
                             if reports[0]["allreduce"][size]["steady_ms"] is not None else None}
                      for size in reports[0]["allreduce"]},
    }


def _cell(stats: dict | None, key: str) -> str:
    return "n/a" if stats is None else f"{stats[key]:.3f}"


def _print_point(data: dict) -> None:
    """The table of one N."""
    n, hosts = data["ranks"], data["hosts"]
    how = {"netns": "network namespaces", "names": "host names, GRADSYNC_HOSTNAME"}
    print(f"# scale: {n} ranks over {hosts} emulated hosts ({how[data['emulation']]}), "
          f"{data['cores']} cores; limit: the same {n} processes start, import torch, "
          "torch.distributed and gradsync, and meet once at the store")
    print(f"# {'phase':<16}{'gradsync med s':>15}{'max s':>9}{'limit med s':>13}{'max s':>9}")
    for phase in PHASES:
        cells = data["phases"].get(phase, {"gradsync": None, "limit": None})
        g, lim = cells["gradsync"], cells["limit"]
        both = phase in ("start", "import")  # the limit's other phase is meet alone
        gm, gx = ("-", "-") if phase == "meet" else (_cell(g, "median"), _cell(g, "max"))
        lm, lx = (_cell(lim, "median"), _cell(lim, "max")) if both or phase == "meet" \
            else ("-", "-")
        name = ("  " if phase in _INIT_PHASES or phase == "other" else "") + phase
        print(f"  {name:<16}{gm:>15}{gx:>9}{lm:>13}{lx:>9}")
    print(f"job: init {data['init_s']:.2f} s (launch to the last rank's init() returned), "
          f"limit {data['limit_s']:.2f} s (launch to the last rank met at the store): "
          f"init / limit = {data['ratio']:.2f}")
    repeats = data.get("repeats", [])
    if len(repeats) > 1:
        print("  each pair, in turn: " + ", ".join(
            f"{r['init_s']:.1f}/{r['limit_s']:.1f} s = {r['ratio']:.2f}" for r in repeats)
            + " (the table: the pair of median ratio)")
    s = data["sockets"]
    print(f"sockets per rank: before init max {s['before']['max']:.0f}; after init median "
          f"{s['init']['median']:.0f}, max {s['init']['max']:.0f}; after the allreduces median "
          f"{s['end']['median']:.0f}, max {s['end']['max']:.0f} (limit: max "
          f"{s['limit']['max']:.0f})")
    for stage, label in (("init", "init"), ("end", "up to the end")):
        counts = data["store_requests"][stage]
        if counts is None:
            print(f"store requests, whole job, {label}: n/a (this gradsync does not count "
                  "them: gradsync.cluster.rendezvous.request_counts)")
        else:
            ops = ", ".join(f"{op} {k}" for op, k in counts["by_op"].items())
            print(f"store requests, whole job, {label}: {counts['total']} ({ops})")
    m = data["rss_mib"]
    print(f"RSS per rank (median): before init {m['before']:.1f} MiB, after init "
          f"{m['init']:.1f} (+{m['growth_init']:.1f}), after the allreduces {m['end']:.1f} "
          f"(+{m['growth_end']:.1f}), of which private (RssAnon) {m['anon_end']:.1f} "
          f"(+{m['anon_growth_end']:.1f}); the limit's ranks {m['limit']:.1f} MiB")
    for size, a in data["allreduce"].items():
        steady = "n/a" if a["steady_ms"] is None else f"{a['steady_ms']:.2f}"
        print(f"allreduce {a['bytes']} B: first {a['first_ms']:.2f} ms (max over ranks), "
              f"steady {steady} ms (median, {data['iters']} after a barrier)")
    print(flush=True)


def summary_rows(points: Sequence[dict]) -> list[dict[str, str]]:
    """One row per measured N, as ``SUMMARY_COLUMNS`` -> text (the markdown table's cells,
    which ``scripts/plot_benchmarks.py`` reads back)."""
    rows = []
    for d in points:
        requests = d["store_requests"]["init"]
        small, large = d["allreduce"]["small"], d["allreduce"]["1MiB"]

        def ms(v):
            return "n/a" if v is None else f"{v:.2f}"

        rows.append(dict(zip(SUMMARY_COLUMNS, (
            f"{d['cores']} cores", str(d["ranks"]), str(d["hosts"]), f"{d['init_s']:.1f}",
            f"{d['limit_s']:.1f}", f"{d['ratio']:.2f}", f"{d['sockets']['end']['max']:.0f}",
            "n/a" if requests is None else str(requests["total"]),
            f"{d['rss_mib']['end']:.0f}", f"{d['rss_mib']['growth_end']:.1f}",
            ms(small["first_ms"]), ms(small["steady_ms"]), ms(large["first_ms"]),
            ms(large["steady_ms"])))))
    return rows


def markdown(points: Sequence[dict]) -> str:
    """The summary as a markdown table."""
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |",
             "| " + " | ".join("---" if c == "machine" else "---:" for c in SUMMARY_COLUMNS)
             + " |"]
    lines += ["| " + " | ".join(row.values()) + " |" for row in summary_rows(points)]
    return "\n".join(lines)


def sweep(counts: Sequence[int], hosts: int | None, options) -> list[dict]:
    """Measures each N of ``counts`` (``hosts`` hosts each, default N); prints and returns
    the figures."""
    emulate = options.emulate
    if emulate == "auto":
        emulate = "netns" if netns.unavailable_reason() is None else "names"
    elif emulate == "netns":
        reason = netns.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"--emulate netns: network namespaces are unavailable: {reason}")
    _raise_descriptor_limit(max(counts))
    points = []
    for ranks in counts:
        data = measure(ranks, min(hosts or ranks, ranks), emulate, options)
        _print_point(data)
        points.append(data)
        if options.json:  # after every N: a sweep stopped later keeps what it measured
            with open(options.json, "w") as out:
                json.dump(points, out, indent=1)
                out.write("\n")
    print("# summary (store requests: the whole job's during init)")
    if options.markdown:
        print(markdown(points))
    else:
        rows = summary_rows(points)
        widths = [max(len(c), *(len(r[c]) for r in rows)) for c in SUMMARY_COLUMNS]
        print("  ".join(c.rjust(w) for c, w in zip(SUMMARY_COLUMNS, widths)))
        for row in rows:
            print("  ".join(row[c].rjust(w) for c, w in zip(SUMMARY_COLUMNS, widths)))
    return points


def drive(counts: Sequence[int], hosts: int | None, options) -> int:
    """``gradsync bench scale``'s entry (``cli.py``); returns the exit status."""
    if options.iters < 0 or options.repeats < 1:
        print("--iters must be at least 0 and --repeats at least 1", file=sys.stderr)
        return 2
    if hosts is not None and hosts < 1:
        print("--hosts must be at least 1", file=sys.stderr)
        return 2
    main_thread = threading.current_thread() is threading.main_thread()  # handlers: only there
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGHUP)
                if main_thread}
    try:
        sweep(counts, hosts, options)
    except (RuntimeError, netns.NetnsError) as exc:
        print(f"gradsync bench scale: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _stopped(signum: int, _frame) -> None:
    """SIGTERM or SIGHUP: leave through the ``finally`` clauses that stop every rank and the
    store's process (their groups would outlive a default death)."""
    raise SystemExit(128 + signum)

