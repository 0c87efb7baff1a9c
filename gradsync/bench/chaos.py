"""``gradsync bench chaos``: an elastic job on emulated hosts, broken on a schedule.

    gradsync bench chaos [--hosts 4] [--ranks-per-host 1] [--minutes 10] [--every 30]
                         [--count N] [--faults kill,stop,partition,straggler] [--json] [--markdown]
                         [--max-detection 3] [--max-recovery 1] [--min-goodput 0.9]
                         [--servers S [--ps-replicas 2] [--ps-mode sync] | --data-servers D]

The cluster is ``gradsync.testbed.netns.Cluster``: one network namespace per emulated host
(``h0`` ...), and one more, ``head``, where ``gradsync run`` and its store live, out of reach of
every fault. The launcher reaches the hosts through the testbed's ssh stand-in
(``netns.ssh_stand_in``), which runs the worker's command in the host's namespace (``ip netns
exec``, in a session of its own), so the job is started, watched and re-formed exactly as on
real hosts: ``gradsync run -np H*K --min-np K -H h0:K,...
--blacklist-cooldown C`` with ``chaos_rank.py`` as the training script.

First a fault-free run of the same job (``--baseline-minutes``) gives the goodput to compare
with; then the soak: once the job is at full size, a fault every ``--every`` seconds, the
kinds in turn (a kind's target is drawn with ``--seed``):

- ``kill``: SIGKILL of one worker (its host is blacklisted for the cooldown, then rejoins);
- ``stop``: SIGSTOP of one worker for ``--stop-seconds``, then SIGCONT (if it still exists);
- ``partition``: one host's switch port down for ``--partition-seconds``, then up
  (``Cluster.cut``: every packet to and from the host is dropped, sockets stay);
- ``straggler``: one host's link ``--slowdown`` times slower (rate and delay) for
  ``--straggle-seconds`` (``Cluster.reshape``);
- ``server``: not run in this job, which has no server: the report lists it as skipped, and
  a skipped kind fails the verdict; it is not in the default list.

With ``--servers S`` or ``--data-servers D`` the job is a parameter-server or a data-server
job instead, and every fault hits a server (``chaos_servers.py``: the layout, the targets, the
reference run of a ``sync`` job; ``chaos_server_report.py``: what is measured and checked).

A fault whose target is gone when it is injected (a pid that exited on its own) is recorded
as not injected, and fails the verdict: it tested nothing.

With ``--count N`` the soak is N faults instead of a length of time: each is injected as soon
as the job is at full size again after the one before, and the soak ends ``--every`` seconds
after the last one ended, once that one is measured (the job has made a step after it; in a
server job, every worker has given its server up and stepped). A test of every kind once
then costs the kinds' own seconds, not a schedule sized for the slowest re-formation; its
window, for goodput, is mostly recovery, and the seconds after the last fault keep one stall
(a stop's detection, 2-3 s) from being most of it.

A fault waits until the job is at full size again (every host back from its cooldown). Every
phase has a deadline (``--phase-deadline``): start-up to full size, each fault until the job
completes a step after it ended, and the end; a phase that passes it is a *hang*: the job is
stopped and the report says which phase. What is measured, and how, is ``chaos_report.py``'s
docstring; every time in it comes from the workers' own lines.

**The verdict is the exit status** (``chaos_report.verdict``): 0 only when nothing hung,
parameters and samples kept their rules, every fault was injected and stayed within its bounds
(``--max-detection``, ``--max-recovery``; an absorbed fault's stall within both together),
goodput reached ``--min-goodput`` of the fault-free run's, and no check was skipped.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time

from ..run.processes import Process, pump, start, stop
from . import chaos_report as cr
from . import chaos_server_report as csr
from . import chaos_servers as cs
from ..testbed.netns import Cluster, NetnsError, ssh_stand_in, unavailable_reason

__all__ = ["parser", "drive", "FAULTS"]

FAULTS = ("kill", "stop", "partition", "straggler", "server")
_HEAD = "head"
_SAMPLES = 2048  # rows of the job's data set: the sample accounting counts against it
_SERVER_NOTE = ("server: skipped: the elastic worker job has no server (a server job is "
                "--servers S or --data-servers D: chaos_servers.py)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                   help="workers per emulated host (default 1)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak")
    p.add_argument("--every", type=float, default=30.0, metavar="F",
                   help="seconds between faults (default 30)")
    p.add_argument("--count", type=int, default=0, metavar="N",
                   help="a soak of N faults instead of --minutes: each as soon as the job is "
                        "at full size again, the soak ending --every seconds after the last")
    p.add_argument("--faults", help="fault kinds in turn, of " + ",".join(FAULTS) +
                   " (default kill,stop,partition,straggler; in a server job server, which is "
                   "kill,stop,partition of a server)")
    servers = p.add_argument_group("server jobs (chaos_servers.py): one kind at a time")
    servers.add_argument("--servers", type=int, default=0, metavar="S",
                         help="a parameter-server job with S servers, one host each")
    servers.add_argument("--ps-replicas", type=int, default=2, metavar="R",
                         help="copies of each shard (default 2)")
    servers.add_argument("--ps-mode", choices=("sync", "async"), default="sync",
                         help="the parameter servers' mode (default sync)")
    servers.add_argument("--data-servers", type=int, default=0, metavar="D",
                         help="a data-server job with D data servers, one host each")
    p.add_argument("--max-detection", type=float, default=cr.Bounds.detection_s, metavar="S",
                   help="seconds from a fault to the last survivor's exception (default 3)")
    p.add_argument("--max-recovery", type=float, default=cr.Bounds.recovery_s, metavar="S",
                   help="seconds from that exception to the re-formed job's first step "
                        "(default 1)")
    p.add_argument("--min-goodput", type=float, default=cr.Bounds.goodput, metavar="R",
                   help="goodput as a share of the fault-free run's (default 0.9)")
    p.add_argument("--baseline-minutes", type=float,
                   help="length of the fault-free run (default: the soak's, at most 2)")
    p.add_argument("--stop-seconds", type=float, default=20.0, help="SIGSTOP to SIGCONT")
    p.add_argument("--partition-seconds", type=float, default=10.0, help="link down to up")
    p.add_argument("--straggle-seconds", type=float, default=10.0, help="slow link's time")
    p.add_argument("--slowdown", type=float, default=10.0, help="straggler's link factor")
    p.add_argument("--rate", default="1gbit", help="each host link's rate (tc)")
    p.add_argument("--delay", help="each host link's one-way delay (needs the kernel's netem; "
                                   "default none)")
    p.add_argument("--cooldown", type=float, default=2.0,
                   help="--blacklist-cooldown of the job: seconds a failed host stays out "
                        "(default 2: the soak's faults are one at a time, not a flapping host)")
    p.add_argument("--phase-deadline", type=float, default=120.0,
                   help="seconds each phase may take before it counts as a hang")
    p.add_argument("--seed", type=int, default=0, help="draws the faults' targets")
    p.add_argument("--params", type=int, default=100_000, help="the job's model size")
    p.add_argument("--compute", type=float, default=0.02,
                   help="seconds of emulated compute per step (a sleep; default 0.02)")
    p.add_argument("--log", metavar="FILE", help="write the soak's whole output to FILE")
    p.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    return p


class _Job:
    """One run of the training job: the launcher in ``head``, its output parsed as it comes."""

    def __init__(self, cluster: Cluster, options, folder: str, name: str,
                 servers: cs.ServerJob | None = None, script: list[str] | None = None):
        hosts = [h for h in cluster.hosts if h.name != _HEAD]
        self.size = sum(h.slots for h in hosts) - (servers.servers if servers else 0)
        self.log = csr.ServerLog() if servers else cr.Log()
        self.counts: dict[int, dict[str, int]] = {}  # generation -> worker -> steps in it
        self.lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.copy = open(options.log, "a") if options.log else None
        self.stop_file = os.path.join(folder, f"{name}.stop")
        launch = [sys.executable, "-m", "gradsync", "run", "-np", str(self.size),
                  "-H", ",".join(f"{h.name}:{h.slots}" for h in hosts),
                  "--ssh-command", ssh_stand_in(cluster, folder)]
        if servers:  # not elastic: the workers are fixed, the servers come back (docs/ps.md)
            argv = launch + servers.launcher_args() + (
                script or servers.script_args(options, self.stop_file))
        else:
            argv = launch + [
                "--min-np", str(options.ranks_per_host), "--max-np", str(self.size),
                "--blacklist-cooldown", f"{options.cooldown:g}",
                sys.executable, "-m", "gradsync.bench.chaos_rank",
                "--stop-file", self.stop_file, "--params", str(options.params),
                "--samples", str(_SAMPLES), "--compute", f"{options.compute:g}"]
        self.process: Process = start(cluster.exec_argv(_HEAD, argv), merge_stderr=True,
                                      text=True)
        self.reader = pump(self.process.proc.stdout, self._line, f"chaos-{name}")

    def _line(self, line: str) -> None:
        with self.lock:
            seen = len(self.log.steps)
            try:
                self.log.add(line)
            except (ValueError, KeyError, IndexError):
                pass  # a line cut or spliced by a dying process: it is in the tail
            if len(self.log.steps) > seen:  # kept up to date here: the waits poll it often
                st = self.log.steps[-1]
                counts = self.counts.setdefault(st.g, {})
                counts[st.worker] = counts.get(st.worker, 0) + 1
            self.tail.append(line)
            if self.copy is not None:
                self.copy.write(line)

    def current(self) -> tuple[int, dict[str, int]]:
        """The newest generation with steps, and its workers with their step counts in it."""
        with self.lock:
            if not self.counts:
                return -1, {}
            g = max(self.counts)
            return g, dict(self.counts[g])

    def steady(self, since: float = 0.0) -> bool:
        """At full size, every worker past its first steps in the newest generation, counting
        only steps that ended after ``since`` (the last fault's end): a worker killed a moment
        ago is still in that generation until the survivors re-form, but steps no more."""
        g, counts = self.current()
        if since:
            with self.lock:
                counts = {}
                for st in reversed(self.log.steps):  # the newest last: stop a second early
                    if st.wall <= since - 1.0:
                        break
                    if st.g == g and st.wall > since:
                        counts[st.worker] = counts.get(st.worker, 0) + 1
        return len(counts) == self.size and min(counts.values()) >= 3

    def last_step(self) -> float:
        with self.lock:
            return max((st.wall for st in self.log.steps), default=0.0)

    def host(self, worker: str) -> str:
        with self.lock:
            return self.log.hellos[worker]

    def ended(self) -> bool:
        return self.process.poll() is not None

    def finish(self, grace: float, text: str = "") -> bool:
        """Asks the job to stop at its next commit (a data job: after epoch ``text``); True
        when it ended within ``grace``."""
        with open(self.stop_file + ".new", "w") as f:  # whole or not at all: a worker reads it
            f.write(text)
        os.replace(self.stop_file + ".new", self.stop_file)
        end = time.monotonic() + grace
        while not self.ended() and time.monotonic() < end:
            time.sleep(0.2)
        return self.ended()

    def close(self) -> None:
        """Stops whatever is left: the launcher's group, then workers it did not reap."""
        stop([self.process], 3.0)
        self.reader.join(5.0)
        if self.copy is not None:
            self.copy.close()
        with self.lock:
            pids = [int(worker) for worker in self.log.hellos]
        for pid in pids:
            _kill_if_worker(pid)


def _kill_if_worker(pid: int) -> None:
    # A pid is reused only after its process is gone: check it is still one of ours.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"gradsync.bench.chaos_" not in f.read():  # chaos_rank, chaos_server_rank
                return
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


class _Soak:
    """Runs one job, injecting faults when ``faults`` is non-empty, within phase deadlines;
    with ``servers``, a server job whose faults hit servers (``chaos_servers.py``)."""

    def __init__(self, cluster: Cluster, options, folder: str, name: str, faults: list[str],
                 seconds: float, servers: cs.ServerJob | None = None):
        self.cluster, self.options, self.kinds = cluster, options, faults
        self.servers = servers
        self.job = _Job(cluster, options, folder, name, servers)
        self.seconds = seconds
        self.faults: list[cr.Fault] = []
        self.hangs: list[dict] = []
        self.window = (0.0, 0.0)
        self.random = random.Random(options.seed)
        self.hits: dict[int, int] = {}  # server -> faults that hit it

    def _wait(self, phase: str, done, deadline: float | None = None) -> bool:
        deadline = self.options.phase_deadline if deadline is None else deadline
        end = time.monotonic() + deadline
        while not done():
            if self.job.ended() or time.monotonic() > end:
                why = "the job ended" if self.job.ended() else "deadline"
                self.hangs.append({"phase": phase, "deadline_s": deadline, "why": why})
                return False
            time.sleep(0.1)
        return True

    def _steady(self) -> bool:
        since = self.faults[-1].until if self.faults else 0.0
        if self.servers is None:
            return self.job.steady(since)
        with self.job.lock:
            return self.servers.steady(self.job.log, since)

    def _settled(self) -> bool:
        assert self.servers is not None
        with self.job.lock:
            return self.servers.settled(self.job.log, self.faults[-1].until)

    def run(self) -> "_Soak":
        # --count: N faults back to back, no schedule and no end time (the module docstring)
        counted = self.options.count > 0 and bool(self.kinds)
        try:
            if not self._wait("start-up to full size", self._steady,
                              max(self.options.phase_deadline, 300.0)):
                return self
            begin = time.time()
            end = begin + self.seconds
            for k in range(self.options.count if counted else 10 ** 6):
                due = begin + self.options.every * (k + 1)
                kind = self.kinds[k % len(self.kinds)] if self.kinds else None
                if kind is None or not counted and due + self._length(kind) + 5 > end:
                    break
                if not counted:
                    time.sleep(max(0.0, due - time.time()))
                if not self._wait(f"fault {k + 1}: job back at full size", self._steady):
                    return self
                if not counted and time.time() + self._length(kind) + 5 > end:
                    break  # the wait for full size took the time left
                if not self._inject(kind):
                    print("chaos: no more faults: no server may be hit (one data server "
                          "left, or every parameter server started again --server-restarts "
                          "times)", flush=True)
                    break
                after = self.faults[-1].until
                if not self._wait(f"fault {k + 1} ({kind}): a step after it",
                                  lambda: self.job.last_step() > after):
                    return self
            if not counted:
                time.sleep(max(0.0, end - time.time()))
            elif self.faults:
                time.sleep(max(0.0, self.faults[-1].until + self.options.every - time.time()))
            # A server fault is known only once every worker gave the server up (a data
            # server: a worker that does not need its batches may notice it a beat later)
            # and is recovered from at every worker's next step: a fault injected near the
            # end must have both inside the window, or its row says "no step after it".
            if self.servers is not None and self.faults and not self._wait(
                    "the end: every worker stepping after the last fault", self._settled):
                return self
            self.window = (begin, time.time())
            with self.job.lock:
                text = self.servers.stop_text(self.job.log) if self.servers else ""
            if not self.job.finish(self.options.phase_deadline, text):
                self.hangs.append({"phase": "the end", "deadline_s": self.options.phase_deadline,
                                   "why": "the job did not exit"})
        finally:
            self.job.close()
        return self

    def _length(self, kind: str) -> float:
        return {"kill": 0.0, "stop": self.options.stop_seconds,
                "partition": self.options.partition_seconds,
                "straggler": self.options.straggle_seconds}[kind]

    def _inject(self, kind: str) -> bool:
        """Injects one fault of ``kind``; False when a server job has no server it may hit."""
        server = None
        if self.servers is None:
            _, counts = self.job.current()
            worker = self.random.choice(sorted(counts))
            pid, host = int(worker), self.job.host(worker)
            who = f"worker {worker} on {host}"
        else:
            with self.job.lock:
                server = self.servers.target(self.job.log, self.hits, self.random)
                if server is None:
                    return False
                pid = int(self.servers.server_pids(self.job.log)[server])
                host = self.job.log.hellos[str(pid)]
            self.hits[server] = self.hits.get(server, 0) + 1
            role = "data server" if self.servers.kind == "data" else "server"
            who = f"{role} {server} (pid {pid}) on {host}"
        start_wall = time.time()
        injected = True
        if kind == "kill":
            injected = _signal(pid, signal.SIGKILL)
            target = who
        elif kind == "stop":
            injected = _signal(pid, signal.SIGSTOP)
            if injected:
                time.sleep(self.options.stop_seconds)
                _signal(pid, signal.SIGCONT)
            target = who
        elif kind == "partition":
            self.cluster.cut(host)
            time.sleep(self.options.partition_seconds)
            self.cluster.cut(host, connected=True)
            target = f"host {host}" if server is None else f"{who}: its host"
        else:
            slow = _rate_text(_rate_bits(self.options.rate) / self.options.slowdown)
            delay = self.options.delay and \
                f"{_delay_us(self.options.delay) * self.options.slowdown:.0f}us"
            self.cluster.reshape(host, slow, delay)
            time.sleep(self.options.straggle_seconds)
            self.cluster.reshape(host, self.options.rate, self.options.delay)
            link = f"{slow}" + (f", {delay}" if delay else "")
            target = f"host {host} ({link})" if server is None else f"{who} ({link})"
        note = "" if injected else "not injected: target gone"
        if server is None:
            self.faults.append(cr.Fault(kind, target, start_wall, time.time(), note=note,
                                        injected=injected))
        else:
            self.faults.append(csr.ServerFault(kind, target, start_wall, time.time(), note=note,
                                               injected=injected, server=server))
        return True


def _signal(pid: int, signum: int) -> bool:
    """Sends ``signum`` to ``pid``; False when it is gone (it ended on its own, or the
    launcher ended it): the fault then reached nothing."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def _rate_bits(rate: str) -> int:
    from ..testbed.netns import parse_rate

    return parse_rate(rate)


def _rate_text(bits: float) -> str:
    """A rate for ``tc`` and for people: 100000000 -> ``100mbit``."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:.0f}bit"


def _delay_us(delay: str) -> float:
    from ..testbed.netns import parse_delay

    return parse_delay(delay) * 1e6


def _kinds(text: str) -> tuple[list[str], list[str]]:
    """``--faults`` -> (the kinds to run, the skipped ones with why).

    Raises:
        ValueError: an unknown kind, or none to run.
    """
    kinds = [k.strip() for k in (text or "kill,stop,partition,straggler").split(",")
             if k.strip()]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise ValueError(f"--faults: unknown kinds {unknown}; the kinds are {','.join(FAULTS)}")
    run = [k for k in kinds if k != "server"]
    if not run:
        raise ValueError("--faults: no fault that this job can take (server is skipped: "
                         "the worker job has no server; see --servers, --data-servers)")
    return run, [_SERVER_NOTE] if "server" in kinds else []


def drive(hosts: int, options) -> int:
    """Runs the baseline and the soak on ``hosts`` emulated hosts; prints the report.

    Returns:
        0 when the soak passed (``chaos_report.verdict`` found nothing: no hang, mismatch or
        broken sample rule, every fault injected and within its bounds, goodput within its
        bound, no check skipped); 1 otherwise; 2 when it could not run (no namespaces, bad
        options).
    """
    try:
        servers = cs.plan(options, hosts)
        kinds, skipped = _kinds(options.faults) if servers is None else \
            (cs.kinds(options.faults, FAULTS), [])
        bounds = cr.Bounds(detection_s=options.max_detection, recovery_s=options.max_recovery,
                           goodput=options.min_goodput)
    except ValueError as exc:
        print(f"gradsync bench chaos: {exc}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"gradsync bench chaos emulates hosts with network namespaces, which need root: "
              f"{reason}", file=sys.stderr)
        return 2
    baseline_s = 60 * (options.baseline_minutes if options.baseline_minutes is not None
                       else min(options.minutes, 2.0))
    layout = [(f"h{i}", options.ranks_per_host) for i in range(hosts)] if servers is None else \
        [(h, options.ranks_per_host) for h in servers.worker_hosts] + \
        [(h, 1) for h in servers.server_hosts]
    cluster = Cluster([(_HEAD, 0)] + layout, host_rate=options.rate, host_delay=options.delay)
    reference = None
    try:
        with cluster, tempfile.TemporaryDirectory(prefix="gradsync-chaos-") as folder:
            what = "workers" if servers is None else \
                f"workers, then {servers.servers} hosts of one {servers.job} server"
            print(f"chaos: {hosts - (servers.servers if servers else 0)} hosts x "
                  f"{options.ranks_per_host} {what}; fault-free run of {baseline_s:g} s",
                  flush=True)
            base = _Soak(cluster, options, folder, "baseline", [], baseline_s, servers).run()
            baseline = cr.goodput(base.job.log, *base.window) if not base.hangs else None
            print(f"chaos: soak of {options.count} faults, each once the job is whole: "
                  if options.count > 0 else f"chaos: soak of {options.minutes * 60:g} s, a "
                  f"fault every {options.every:g} s: ", f"{','.join(kinds)}", sep="",
                  flush=True)
            soak = _Soak(cluster, options, folder, "soak", kinds, options.minutes * 60,
                         servers).run()
            if servers is not None and servers.job == "ps-sync" and soak.job.log.steps:
                reference = _reference(cluster, options, folder, servers, soak)
    except NetnsError as exc:
        print(f"gradsync bench chaos: {exc}", file=sys.stderr)
        return 2
    window = soak.window if soak.window[1] else (soak.faults[0].wall if soak.faults else 0.0,
                                                 time.time())
    hangs = base.hangs + soak.hangs
    if servers is None:
        data = cr.report(soak.faults, soak.job.log, dataset=_SAMPLES, window=window,
                         baseline=baseline, hangs=hangs, skipped=skipped, bounds=bounds)
    else:
        data = csr.report(soak.faults, soak.job.log, job=servers.job, window=window,
                          baseline=baseline, hangs=hangs, skipped=skipped, bounds=bounds,
                          reference=reference, dataset=cs.data_samples(),
                          replicas=servers.replicas)
    if hangs:
        data["output_tail"] = list(soak.job.tail or base.job.tail)[-40:]
        sys.stdout.write("".join(data["output_tail"]))
    sys.stdout.write(cr.format_markdown(data) if options.markdown else cr.format_text(data))
    if options.json:
        from ..testbed.rows import write_json

        write_json(data, options.json)
    return 1 if data["failures"] else 0


def _reference(cluster: Cluster, options, folder: str, servers: cs.ServerJob,
               soak: _Soak) -> csr.ServerLog | None:
    """The fault-free run of a ``sync`` soak's job to the soak's last step, without the
    emulated compute (a sleep: it changes no number); None when it did not end in time."""
    steps = max(st.s for st in soak.job.log.steps)
    print(f"chaos: fault-free reference run of {steps} steps", flush=True)
    stop_file = os.path.join(folder, "reference.stop")
    job = _Job(cluster, options, folder, "reference", servers,
               servers.script_args(options, stop_file) + ["--steps", str(steps),
                                                          "--compute", "0"])
    # Its start-up is a phase like the soak's (300 s at least); its steps need no more time
    # than the soak's, which took the same steps and every fault besides.
    deadline = max(options.phase_deadline, 300.0) + options.minutes * 60
    end = time.monotonic() + deadline
    try:
        while not job.ended() and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        job.close()
    if not job.log.finals:
        soak.hangs.append({"phase": "the fault-free reference run", "deadline_s": deadline,
                           "why": "the job ended without its final counters" if job.ended()
                           else "deadline"})
        return None
    return job.log
