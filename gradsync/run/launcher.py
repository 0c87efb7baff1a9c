"""``gradsync run``: starts the ranks of one job, forwards their output, ends the job as one.

A job goes through five steps:

1. **Place.** Ranks fill the hosts in the order given, host 1's slots first: with
   ``-H a:2,b:2 -np 3`` ranks 0 and 1 run on ``a`` (local ranks 0, 1) and rank 2 on ``b``
   (local rank 0). A rank's *cross rank* is the index of its host among the hosts that have a
   rank with the same local rank (Horovod's definition): rank 2 has cross rank 1 of 2, rank 1
   cross rank 0 of 1.
2. **Store.** The launcher hosts torch's TCPStore for the rendezvous. It outlives every rank,
   so the death of rank 0 does not take the store (and the job's abort record) with it.
3. **Start.** Each rank gets its identity as ``GRADSYNC_*`` variables (``launch_env`` reads
   them). A local rank is a child in a new session, so ``killpg`` reaches everything it started.
   A remote rank runs under ``ssh`` (see *Remote ranks*).
4. **Watch.** The first rank to exit non-zero or die by a signal ends the job: every rank's
   process group gets SIGTERM, then SIGKILL after ``stop_grace`` seconds. So does SIGINT,
   SIGTERM or SIGHUP sent to the launcher (a second one skips the grace).
5. **Exit** with the failed rank's status (128 + signal number for a signal, as a shell does),
   128 + the signal the launcher received, or 0 when every rank exited 0.

Parameter-server jobs (``servers`` > 0): the ``num_proc`` workers are ranks ``0 .. num_proc - 1``
and the servers the last ``servers`` ranks, placed after them like any rank; every rank runs
the same command and learns the split from ``GRADSYNC_SERVERS``. The servers hold the model, so
a failing server ends the job as above; a failing worker does not (the others can go on without
it): the launcher reports it at once, waits for every rank to end, and then exits with the
status of the first worker that failed. Servers end by themselves once every worker has said
goodbye or died; servers still running ``SERVER_LINGER`` seconds after the last worker ended
(workers that died before reaching their servers, or a script that never used them) are
stopped, so that such a job cannot hang.

Output: every line a rank writes goes to the launcher's stdout or stderr as
``[<rank>]<stdout>:<line>`` or ``[<rank>]<stderr>:<line>`` (horovodrun's format), or as it
is with ``output_prefix=False``. Whole lines are written under one lock, so lines of different
ranks never interleave; a final line without a newline gets one. Python ranks run with
``PYTHONUNBUFFERED=1`` (unless set otherwise) so their lines arrive as they are printed and are
not lost in a buffer when the job is stopped.

Remote ranks: ``ssh -o BatchMode=yes [-p port] host "sh -c '<script>'"``. The script reads the
job secret from its stdin (so the secret never appears on a command line, where ``ps`` on the
remote host would show it), starts the rank with the variables assigned by ``env``, and keeps a
*lifeline*: a background reader on the rest of ssh's stdin. The launcher keeps that stdin open
for the life of the rank; when it closes (the launcher stops the job, dies, or loses the
connection) the reader sends SIGTERM and then SIGKILL to the remote process group, so a remote
rank never outlives its job. Remote ranks see only their identity, the ``-x`` variables and the
launcher's ``GRADSYNC_*`` settings, as under ``mpirun -x``; local ranks inherit the launcher's
whole environment. The elastic launcher (``elastic.py``) starts its remote workers and checks
its discovered hosts with the same methods (``_start``, ``_probe``).
"""

from __future__ import annotations

import math
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import BinaryIO, Callable, Mapping, Sequence

from ..config import ENV_PREFIX, IDENTITY_VARIABLES
from . import binding
from .hosts import Host

__all__ = ["Host", "Slot", "LaunchSpec", "place", "launch", "is_local", "STOP_GRACE",
           "SERVER_LINGER",
           "DEFAULT_START_TIMEOUT"]

STOP_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when the job is stopped."""

DEFAULT_START_TIMEOUT = 30.0
"""Seconds an ssh connection (and the reachability check before the launch) may take."""

SERVER_LINGER = 10.0
"""Seconds servers may run on after every worker of a parameter-server job has ended."""

_POLL = 0.05  # how often the watcher looks at the ranks: the delay before a failure is seen
_DRAIN = 2.0  # seconds to wait for the last output after the ranks are gone
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and its place among the job's ranks."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def place(hosts: Sequence[Host], num_proc: int) -> list[Slot]:
    """Puts ``num_proc`` ranks on ``hosts`` in order, filling each host's slots before the next.

    Raises:
        ValueError: fewer slots than ranks, or a host named twice.
    """
    if num_proc < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {num_proc}")
    names = [h.name for h in hosts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"host(s) named more than once: {', '.join(repeated)}; give each host "
                         "once with its total number of slots")
    total = sum(h.slots for h in hosts)
    if total < num_proc:
        raise ValueError(f"{num_proc} ranks need {num_proc} slots but the hosts have {total} ("
                         + ", ".join(f"{h.name}:{h.slots}" for h in hosts) + ")")
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host.name] = min(host.slots, num_proc - sum(counts.values()))
    used = [name for name, count in counts.items() if count > 0]
    slots = []
    for name in used:
        for local_rank in range(counts[name]):
            same_local = [h for h in used if counts[h] > local_rank]
            slots.append(Slot(rank=len(slots), host=name, local_rank=local_rank,
                              local_size=counts[name], cross_rank=same_local.index(name),
                              cross_size=len(same_local)))
    return slots


# What every rank gets unless the environment sets glibc's malloc itself. By default glibc
# gives the top of the heap back to the kernel once more than a moving threshold is free, and
# serves blocks above another moving threshold with mmap; a training step that frees and
# allocates megabytes of gradients can then take every page back in again at each step. For
# the MLP of ``gradsync bench train``, in some runs and not others: up to about 2000 minor page
# faults and 3-4 ms a step (docs/benchmarks.md, "Freed memory kept for reuse"). So freed memory
# stays in the process for reuse, as the jemalloc and tcmalloc settings recommended for
# PyTorch on CPU keep it.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                     "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
_MALLOC_SETTINGS = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to launch and how; ``gradsync run``'s options fill these fields."""

    command: Sequence[str]
    """The program and its arguments, run by every rank."""
    num_proc: int
    """Number of worker ranks: all the ranks when ``servers`` is 0."""
    servers: int = 0
    """Parameter-server ranks started after the workers: the last ``servers`` ranks."""
    hosts: Sequence[Host] = ()
    """Hosts in placement order; empty means ``localhost`` with ``size`` slots."""
    ssh_command: str = "ssh"
    """Command (split like a shell would) that runs a command on a remote host."""
    ssh_port: int | None = None
    """Port passed to ssh as ``-p``."""
    start_timeout: float | None = None
    """Seconds for ssh to connect; when given, also the ranks' GRADSYNC_CONNECT_TIMEOUT."""
    output_prefix: bool = True
    """Prefix each forwarded line with ``[rank]<stdout>:`` or ``[rank]<stderr>:``."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set for every rank (``-x``), local and remote."""
    stop_grace: float = STOP_GRACE
    """Seconds between SIGTERM and SIGKILL when the job is stopped."""
    bind_to: str = "none"
    """``core``, ``none`` or ``auto``: bind each rank started on this host to cores of its
    own (``binding.py``; auto: only when they fit and the affinity is not restricted)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command to run")
        if self.num_proc < 1:
            raise ValueError(f"the number of ranks must be at least 1, got {self.num_proc}")
        if self.servers < 0:
            raise ValueError(f"the number of servers must be >= 0, got {self.servers}")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise ValueError(f"start_timeout must be positive, got {self.start_timeout}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise ValueError(f"ssh_port must be a TCP port (1-65535), got {self.ssh_port}")
        if self.stop_grace < 0:
            raise ValueError(f"stop_grace must be >= 0, got {self.stop_grace}")
        if self.bind_to not in binding.MODES:
            raise ValueError(f"bind_to must be one of {', '.join(binding.MODES)}, "
                             f"got {self.bind_to!r}")

    @property
    def size(self) -> int:
        """Number of ranks in the job: workers and servers."""
        return self.num_proc + self.servers


def launch(spec: LaunchSpec, stdout: BinaryIO | None = None,
           stderr: BinaryIO | None = None) -> int:
    """Runs the job described by ``spec`` to its end and returns the launcher's exit status.

    Signal handling (SIGINT, SIGTERM, SIGHUP stop the job) is only installed when this is
    called from the main thread.

    Args:
        spec: the job.
        stdout, stderr: binary streams for the ranks' output and the launcher's messages;
            the process's own by default.

    Raises:
        ValueError: the hosts cannot hold ``spec.size`` ranks.
    """
    slots = place(spec.hosts or [Host("localhost", spec.size)], spec.size)
    output = _Output(spec.output_prefix, stdout or sys.stdout.buffer,
                     stderr or sys.stderr.buffer)
    return _Job(spec, slots, output).run()


def is_local(name: str) -> bool:
    """Whether ``name`` is this host, so its ranks start as children rather than over ssh."""
    here = socket.gethostname()
    return name in _LOCAL_NAMES or name.startswith("127.") or name in (here, here.split(".")[0])


def _store_addr(remote_hosts: Sequence[str], reachable: bool = False) -> str:
    """The store address every rank gets: loopback for a one-host job, else one remote hosts
    can reach. All ranks must get the same one, because a rank listens for its peers on the
    interface that routes to the store: a loopback store would hide local ranks from the
    remote ones.

    Args:
        remote_hosts: the job's remote hosts known now.
        reachable: the job may add remote hosts later (an elastic job's discovery script):
            an address other hosts can reach even when ``remote_hosts`` is empty.
    """
    if not remote_hosts and not reachable:
        return "127.0.0.1"
    # The source address of a route to a remote host is an address of this host on a network
    # that host shares. A UDP "connect" sends nothing; it only asks for the route. With no
    # remote host yet, the route asked for is the default one (198.51.100.1 is a
    # documentation address: no packet goes there).
    target = remote_hosts[0] if remote_hosts else "198.51.100.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(target, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _status(code: int) -> int:
    """The launcher's exit status for a rank's return code: 128 + signal, as a shell does."""
    return code if code > 0 else 128 - code


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with status {code}"


class _Output:
    """Copies the ranks' output line by line; one lock keeps every line whole."""

    def __init__(self, prefix: bool, stdout: BinaryIO, stderr: BinaryIO):
        self.prefix, self.stdout, self.stderr = prefix, stdout, stderr
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, rank: int, proc: subprocess.Popen) -> None:
        for name, pipe, dest in (("stdout", proc.stdout, self.stdout),
                                 ("stderr", proc.stderr, self.stderr)):
            tag = f"[{rank}]<{name}>:".encode() if self.prefix else b""
            thread = threading.Thread(target=self._pump, args=(tag, pipe, dest), daemon=True,
                                      name=f"gradsync-output-{rank}-{name}")
            thread.start()
            self.threads.append(thread)

    def _pump(self, tag: bytes, pipe: BinaryIO, dest: BinaryIO) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                self.write(dest, tag + (line if line.endswith(b"\n") else line + b"\n"))

    def write(self, dest: BinaryIO, data: bytes) -> None:
        with self.lock:
            try:
                dest.write(data)
                dest.flush()
            except (OSError, ValueError):
                # The reader went away (`gradsync run ... | head`): keep draining the ranks'
                # pipes so that they never block on a full pipe, and drop the text.
                pass

    def message(self, text: str) -> None:
        self.write(self.stderr, f"gradsync run: {text}\n".encode())

    def drain(self, timeout: float) -> None:
        """Waits for the pipes to close; a process that escaped its group may keep one open."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))


@dataclass
class _Rank:
    slot: Slot
    proc: subprocess.Popen
    remote: bool

    def signal(self, signum: int) -> None:
        """Signals the rank's whole process group (and drops a remote rank's lifeline).

        Groups of ranks that have already exited are signalled too: a child they left behind
        would otherwise survive the job. (An empty group's id could in principle be taken by
        a new session leader meanwhile; within the seconds a job takes to end, pids do not
        wrap around.)
        """
        if self.remote and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class _StartError(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Job:
    """One run of the launcher; see the module docstring for its steps."""

    def __init__(self, spec: LaunchSpec, slots: list[Slot], output: _Output):
        self.spec, self.slots, self.output = spec, slots, output
        self.remote_hosts = list(dict.fromkeys(s.host for s in slots if not is_local(s.host)))
        self.store_addr = _store_addr(self.remote_hosts)
        self.secret = secrets.token_bytes(32)
        self.job_id = secrets.token_hex(8)
        self.ranks: list[_Rank] = []
        self.received: int | None = None  # the first stopping signal the launcher got
        self.hurry = False  # a second signal: skip the grace period
        self.cores: "list[list[int]] | None" = None  # CPUs of each local rank, when bound

    def run(self) -> int:
        with _handling(self._on_signal):
            try:
                self._check_hosts()
                self._plan_binding()
                store = self._start_store()
                for slot in self.slots:
                    if self.received is not None:
                        break
                    self.ranks.append(self._start(slot, store.port))
                status, summary, others = self._watch()
            except _StartError as exc:
                status, summary, others = exc.status, str(exc), "other "
            finally:
                # Reached on every path (an exception included), so no rank outlives the job.
                stopped = self._stop()
                self.output.drain(_DRAIN)
        if summary and self.ranks and others is not None:
            summary += f"; stopped {stopped} {others}rank{'' if stopped == 1 else 's'}"
        if summary:
            self.output.message(summary)
        return status

    # ------------------------------------------------------------------ start
    def _plan_binding(self) -> None:
        """Which cores the ranks started here get (``binding.py``); an elastic job, whose
        local ranks come and go, does not bind."""
        here = [slot for slot in self.slots if is_local(slot.host)]
        if here:
            try:
                self.cores = binding.plan(self.spec.bind_to, here[0].local_size)
            except ValueError as exc:
                raise _StartError(str(exc), 2) from None

    def _on_signal(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.hurry = True

    def _check_hosts(self) -> None:
        """Runs ``true`` on each remote host first, so that an unreachable host is reported
        by name before any rank starts, instead of as one rank's ssh failure."""
        checks: dict[str, subprocess.Popen] = {}
        end = time.monotonic() + self._probe_limit()
        try:
            for host in self.remote_hosts:
                checks[host] = self._probe(host)
            # Polled rather than waited on, so that a Ctrl-C is honoured at once.
            while self.received is None and any(p.poll() is None for p in checks.values()):
                if time.monotonic() > end:
                    late = [h for h, p in checks.items() if p.poll() is None]
                    raise _StartError(f"ssh to {', '.join(late)} did not finish within "
                                      f"{self._ssh_timeout():.0f}s", 255)
                time.sleep(_POLL)
            for host, proc in checks.items():
                error = self._probe_error(host, proc)
                if error is not None:
                    raise _StartError(error, proc.returncode)
        finally:
            for proc in checks.values():
                _end_probe(proc)

    def _probe(self, host: str) -> subprocess.Popen:
        """Starts ``ssh host true``: the reachability check of a remote host (see
        ``_check_hosts``; the elastic launcher runs it on each host discovery adds)."""
        try:
            return subprocess.Popen(self._ssh_argv(host, "true"), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise _StartError(f"cannot run '{self.spec.ssh_command}': {exc}", 127) from None

    def _probe_limit(self) -> float:
        """Seconds a reachability check may take: ssh's own ConnectTimeout bounds the
        connection; the margin covers the login itself."""
        return self._ssh_timeout() + 5.0

    def _probe_error(self, host: str, proc: subprocess.Popen) -> str | None:
        """What a finished reachability check says is wrong with ``host`` (None: nothing)."""
        if proc.returncode in (0, None):
            return None
        detail = proc.stderr.read().decode(errors="replace").strip().splitlines()
        return (f"cannot run commands on {host} with '{self.spec.ssh_command}' (status "
                f"{proc.returncode}" + (f": {detail[-1]}" if detail else "") + ")")

    def _start_store(self):
        # Imported here: torch takes a second to import and only this step needs it.
        from torch.distributed import TCPStore

        # The server listens on every interface whatever host name it is given; the name is
        # only where the launcher's own client connects. Port 0 lets the kernel choose a free
        # port without a race.
        try:
            return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                            wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise _StartError(f"cannot start the rendezvous store: {exc}", 1) from None

    def _identity(self, slot: Slot, port: int) -> dict[str, str]:
        variables = {
            "RANK": slot.rank, "SIZE": len(self.slots), "LOCAL_RANK": slot.local_rank,
            "LOCAL_SIZE": slot.local_size, "CROSS_RANK": slot.cross_rank,
            "CROSS_SIZE": slot.cross_size, "HOSTNAME": slot.host,
            "STORE_ADDR": self.store_addr, "STORE_PORT": port, "JOB_ID": self.job_id,
            "LAUNCHER_PID": os.getpid(), "SERVERS": self.spec.servers,
        }
        return {ENV_PREFIX + name: str(value) for name, value in variables.items()}

    def _torch_identity(self, slot: Slot, port: int) -> dict[str, str]:
        """torchrun's variables, so ``init_process_group()`` (env://) works under ``gradsync
        run`` too: every rank a client of the launcher's store, as under torchrun's agent."""
        return {"RANK": str(slot.rank), "WORLD_SIZE": str(len(self.slots)),
                "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(slot.local_size),
                "MASTER_ADDR": self.store_addr,
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def _settings(self, slot: Slot) -> dict[str, str]:
        """What a rank gets besides its identity, before the -x variables."""
        settings = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
        if slot.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: ranks sharing a host would otherwise each start a BLAS/OpenMP
            # thread per core and fight over the cores (a server's small matrix product
            # running 3x slower beside its workers on 2 cores was measured).
            settings["OMP_NUM_THREADS"] = "1"
        if not any(name in os.environ for name in (*KEEP_FREED_MEMORY, *_MALLOC_SETTINGS)):
            settings.update(KEEP_FREED_MEMORY)
        if self.spec.start_timeout is not None:
            settings[ENV_PREFIX + "CONNECT_TIMEOUT"] = str(self.spec.start_timeout)
        return settings

    def _start(self, slot: Slot, port: int) -> _Rank:
        """Starts one rank: a child here, or over ssh (``_start_remote``) on another host."""
        remote = not is_local(slot.host)
        try:
            if remote:
                proc = self._start_remote(slot, port)
            else:
                env = {**os.environ, **self._torch_identity(slot, port), **self._settings(slot),
                       **self.spec.env, **self._identity(slot, port),
                       ENV_PREFIX + "SECRET": self.secret.hex()}
                proc = subprocess.Popen(list(self.spec.command), env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
                if self.cores is not None:
                    # The child has just exec'd: no thread of its own yet, and every thread
                    # it starts inherits the binding.
                    try:
                        binding.bind(proc.pid, self.cores[slot.local_rank])
                    except OSError:
                        pass  # it exited already: _watch reports that
        except OSError as exc:
            # 127 and 126 are what a shell returns for a missing or unrunnable command.
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            raise _StartError(f"cannot start rank {slot.rank} on host {slot.host}: {exc}",
                              status) from None
        self.output.follow(slot.rank, proc)
        return _Rank(slot, proc, remote)

    def _start_remote(self, slot: Slot, port: int) -> subprocess.Popen:
        forwarded = {name: value for name, value in os.environ.items()
                     if name.startswith(ENV_PREFIX)
                     and name[len(ENV_PREFIX):] not in IDENTITY_VARIABLES}
        assignments = {**forwarded, **self._torch_identity(slot, port), **self._settings(slot),
                       **self.spec.env, **self._identity(slot, port)}
        proc = subprocess.Popen(self._ssh_argv(slot.host, _remote_script(
            os.getcwd(), assignments, self.spec.command, self.spec.stop_grace)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        try:
            proc.stdin.write(self.secret.hex().encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # ssh already failed; the watcher reports its exit status
        return proc

    def _ssh_timeout(self) -> float:
        return self.spec.start_timeout or DEFAULT_START_TIMEOUT

    def _ssh_argv(self, host: str, command: str) -> list[str]:
        argv = shlex.split(self.spec.ssh_command)
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={math.ceil(self._ssh_timeout())}"]
        if self.spec.ssh_port is not None:
            argv += ["-p", str(self.spec.ssh_port)]
        return argv + [host, command]

    # ------------------------------------------------------------------ watch and stop
    def _watch(self) -> tuple[int, str | None, str | None]:
        """Waits for the end: every rank ended, one stopping the job failed, or the launcher
        got a signal. A failed worker of a parameter-server job is reported, not stopping.

        Returns:
            The exit status, the summary line (None for success) and what the ranks that
            ``_stop`` finds running are called in it: "other " when the summary is about one
            rank, "" after a signal, None when every rank ended by itself (nothing to count).
        """
        failed: list[tuple[int, str, str]] = []  # a parameter-server job's failed workers
        seen: set[int] = set()
        workers_ended: float | None = None
        while True:
            if self.received is not None:
                name = signal.Signals(self.received).name
                return 128 + self.received, f"interrupted by {name}", ""
            running = False
            for rank in self.ranks:
                code = rank.proc.poll()
                if code is None:
                    running = True
                elif code != 0 and rank.slot.rank not in seen:
                    who, what = self._failure(rank, code)
                    if not self.spec.servers or rank.slot.rank >= self.spec.num_proc:
                        return _status(code), f"{who} {what}", "other "
                    seen.add(rank.slot.rank)
                    failed.append((_status(code), who, what))
                    self.output.message(f"{who} {what}; the other ranks go on "
                                        "(parameter-server job)")
            if self.spec.servers and workers_ended is None and all(
                    r.proc.poll() is not None for r in self.ranks[:self.spec.num_proc]):
                workers_ended = time.monotonic()
            lingered = workers_ended is not None and \
                time.monotonic() - workers_ended > SERVER_LINGER
            if not running or lingered:
                linger = (f"; the servers were still running {SERVER_LINGER:g}s after the last "
                          f"worker ended and were stopped") if running else ""
                if not failed:
                    return 0, (f"every worker ended{linger}" if linger else None), \
                        ("" if linger else None)
                status, who, what = failed[0]
                first = f", the first of {len(failed)} failed workers" if len(failed) > 1 else ""
                summary = f"{who} failed earlier ({what}){first}; the job ran to its end{linger}"
                return status, summary, ("" if linger else None)
            time.sleep(_POLL)

    def _failure(self, rank: _Rank, code: int) -> tuple[str, str]:
        """Who failed and how, e.g. ("rank 5 (server 1) on host a", "exited with status 1")."""
        index, workers = rank.slot.rank, self.spec.num_proc
        if not self.spec.servers:
            name = f"rank {index}"
        elif index < workers:
            name = f"worker rank {index}"
        else:
            name = f"rank {index} (server {index - workers})"
        what = _describe(code)
        if rank.remote and code == 255:
            what += " (ssh returns 255 when the connection fails)"
        return f"{name} on host {rank.slot.host}", what

    def _stop(self) -> int:
        """Stops every rank: SIGTERM, then SIGKILL after the grace. Returns how many ranks
        were still running."""
        running = [r for r in self.ranks if r.proc.poll() is None]
        for rank in self.ranks:
            rank.signal(signal.SIGTERM)
        end = time.monotonic() + self.spec.stop_grace
        while not self.hurry and time.monotonic() < end and \
                any(r.proc.poll() is None for r in running):
            time.sleep(_POLL)
        for rank in self.ranks:
            rank.signal(signal.SIGKILL)
        for rank in self.ranks:
            try:
                rank.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                # Only a process stuck in the kernel (uninterruptible I/O) ignores SIGKILL.
                self.output.message(f"rank {rank.slot.rank} (pid {rank.proc.pid}) did not "
                                    "exit after SIGKILL")
        return len(running)


def _end_probe(proc: subprocess.Popen) -> None:
    """Kills a reachability check that is still running and closes its pipe."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stderr.close()


def _remote_script(cwd: str, assignments: Mapping[str, str], command: Sequence[str],
                   grace: float) -> str:
    """The shell command ssh runs: ``sh -c '<script>'``, for any login shell.

    The rank's stdin is /dev/null; ssh's stdin carries the secret, then serves as the lifeline
    (see the module docstring). The lifeline reader ignores SIGTERM so that it survives its own
    ``kill -TERM 0`` to send the SIGKILL. It reads with the shell's builtin ``read``, so killing
    it once the rank has exited leaves no process behind.
    """
    env = " ".join(shlex.quote(f"{name}={value}") for name, value in assignments.items())
    steps = [
        "IFS= read -r GRADSYNC_SECRET || exit 255",
        "export GRADSYNC_SECRET",
        f"cd {shlex.quote(cwd)} || exit 255",
        # Background commands of a non-interactive shell read /dev/null unless told otherwise:
        # fd 3 hands ssh's stdin to the lifeline reader.
        "exec 3<&0",
        f"env {env} {shlex.join(command)} </dev/null & rank=$!",
        "( trap '' TERM; while read -r _ <&3; do :; done; kill -TERM 0; "
        f"sleep {grace:g}; kill -KILL 0 ) >/dev/null 2>&1 & lifeline=$!",
        "exec 3<&-",
        "wait $rank; status=$?",
        "kill -KILL $lifeline 2>/dev/null",
        "exit $status",
    ]
    return "sh -c " + shlex.quote("; ".join(steps))


@contextmanager
def _handling(callback: Callable[[int], None]):
    """Routes SIGINT, SIGTERM and SIGHUP to ``callback`` while the job runs.

    The ranks live in their own sessions, so a Ctrl-C in the terminal reaches only the
    launcher, which then stops them in order; the default handlers would leave them running.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: callback(signum))
                for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
