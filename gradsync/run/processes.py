"""Process mechanics: start a child as a group of its own, here or over ssh, forward its
output, and stop it with everything it started.

The launchers (``launcher.py``, ``elastic.py``), the emulated cluster (``testbed/netns.py``) and
the tests' harness (``tests/harness.py``) compose these pieces to start, watch and stop their
ranks.

**A child is a process group.** ``start`` makes every child the leader of a new session, so
``os.killpg`` on its pid reaches everything it started (a rank's own helper processes, the
command an ``ip netns exec`` or ``sh -c`` runs), and a Ctrl-C in the launcher's terminal
reaches only the launcher, which then stops its children in order.

**Stopping** (``stop``): SIGTERM to every child's group, up to ``grace`` seconds for them to
exit, then SIGKILL to every group. Groups of children that have exited already are signalled
too: a child they left behind would otherwise outlive them. (An empty group's id could in
principle be taken by a new session leader meanwhile; within the seconds a stop takes, pids
do not wrap around.)

**Remote children and the lifeline** (``Ssh``): ``ssh -o BatchMode=yes [-p port] host
"sh -c '<script>'"``. The script reads the job secret from its stdin (so the secret never
appears on a command line, where ``ps`` on the remote host would show it), starts the command
with the variables assigned by ``env``, and keeps a *lifeline*: a background reader on the
rest of ssh's stdin. The launcher keeps that stdin open for the life of the child; when it
closes (the launcher stops the child, dies, or loses the connection) the reader sends SIGTERM
and then SIGKILL to the remote process group, so a remote child never outlives its launcher.
Signalling a remote ``Process`` therefore closes its lifeline first.

**Output** (``Output``, ``pump``): a thread per pipe copies whole lines, one lock keeps every
line whole among children, and a final line without a newline gets one.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, BinaryIO, Callable, Iterator, Mapping, Protocol, Sequence

__all__ = ["STOP_GRACE", "DEFAULT_START_TIMEOUT", "Child", "Process", "StartError", "start",
           "stop", "HostChecks",
           "pump", "Output", "Interrupts", "Ssh", "remote_script", "exit_status", "describe"]

STOP_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when a child is stopped."""

DEFAULT_START_TIMEOUT = 30.0
"""Seconds an ssh connection (and the reachability check before a launch) may take."""

_POLL = 0.05  # how often a stop looks whether the children have exited
_REAP = 5.0  # seconds to wait for a child to exit after SIGKILL
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StartError(Exception):
    """A child or a host could not be started or reached; ``status`` is the exit status a
    launcher reports for it (127 and 126 as a shell's, 255 as ssh's)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Child(Protocol):
    """What the launchers use of a child: ``subprocess.Popen``'s, or a forked rank's
    (``forkserver.Forked``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Process:
    """A child that leads its own process group; ``lifeline``: its stdin is a remote
    command's lifeline (see the module docstring)."""

    proc: Child
    lifeline: bool = False

    def poll(self) -> int | None:
        """The child's return code (negative: killed by that signal), None while it runs."""
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        """Signals the child's whole process group (after dropping its lifeline)."""
        if self.lifeline and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def start(argv: Sequence[str], env: Mapping[str, str] | None = None, *,
          merge_stderr: bool = False, text: bool = False,
          stdin: int | None = subprocess.DEVNULL, cwd: str | None = None) -> Process:
    """Starts ``argv`` as the leader of a new session, its stdout and stderr on pipes.

    Args:
        env: the child's whole environment; None: this process's.
        merge_stderr: stderr into the stdout pipe.
        text: the pipes in text mode (undecodable bytes replaced) rather than bytes.
        stdin: the child's stdin (``/dev/null`` by default: a child never reads ours).
        cwd: the child's working directory; None: this process's.

    Raises:
        OSError: ``argv`` cannot be run.
    """
    return Process(subprocess.Popen(
        list(argv), env=None if env is None else dict(env), stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=text, errors="replace" if text else None, start_new_session=True, cwd=cwd))


def clear_shared_memory(job_id: str) -> list[str]:
    """Removes what the job's ranks on this host left in /dev/shm, once every one of them has
    ended (``stop`` returned): a rank unlinks its segments once its peers mapped them, or at
    exit, but one SIGKILLed before (a killed data or parameter server, a rank stopped past the
    grace) cannot. Every name a gradsync job makes starts with ``gradsync-<its job id>``;
    returns those removed. Hosts reached over ssh keep theirs (docs/launch.md)."""
    from ..transport import shm  # the launcher imports no transport until the job ends

    return shm.unlink_prefixed(f"gradsync-{job_id}")


def stop(children: Sequence[Process], grace: float = STOP_GRACE, *,
         hurry: Callable[[], bool] = lambda: False,
         on_stuck: Callable[[int], None] | None = None) -> int:
    """Stops ``children``: SIGTERM, then SIGKILL after ``grace`` seconds, then waits for them.

    Args:
        grace: seconds the children get to exit after SIGTERM.
        hurry: polled during the grace; True skips the rest of it (a second Ctrl-C).
        on_stuck: called with the index of a child still there ``_REAP`` seconds after
            SIGKILL (only a process stuck in the kernel ignores SIGKILL).

    Returns:
        How many children were still running when it was called.
    """
    running = [c for c in children if c.poll() is None]
    for child in children:
        child.signal(signal.SIGTERM)
    end = time.monotonic() + grace
    while not hurry() and time.monotonic() < end and any(c.poll() is None for c in running):
        time.sleep(_POLL)
    for child in children:
        child.signal(signal.SIGKILL)
    for index, child in enumerate(children):
        try:
            child.proc.wait(timeout=_REAP)
        except subprocess.TimeoutExpired:
            if on_stuck is not None:
                on_stuck(index)
    return len(running)


def pump(pipe, on_line: Callable, name: str) -> threading.Thread:
    """Calls ``on_line`` with each line read from ``pipe`` (bytes or text) until it closes,
    on a daemon thread (returned, started) named ``name``; closes the pipe at the end."""
    def copy() -> None:
        with pipe:
            for line in iter(pipe.readline, pipe.read(0)):
                on_line(line)

    thread = threading.Thread(target=copy, daemon=True, name=name)
    thread.start()
    return thread


class Output:
    """Copies the children's output line by line to two binary streams; one lock keeps every
    line whole.

    Args:
        prefix: tag each line ``[<rank>]<stdout>:`` or ``[<rank>]<stderr>:`` (horovodrun's
            format).
        stdout, stderr: where the lines go; ``stderr`` also takes ``message``'s lines.
        name: what ``message`` calls the program.
        directory: also write each rank's lines, untagged, to
            ``<directory>/rank.<rank>/stdout`` and ``.../stderr`` (horovodrun's
            ``--output-filename``); the rank is padded with zeros to ``width`` digits, so
            that the folders sort in rank order.
        width: digits of the highest rank.
    """

    def __init__(self, prefix: bool, stdout: BinaryIO, stderr: BinaryIO,
                 name: str = "gradsync run", directory: str | None = None, width: int = 1):
        self.prefix, self.stdout, self.stderr, self.name = prefix, stdout, stderr, name
        self.directory, self.width = directory, width
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.files: list[BinaryIO] = []

    def follow(self, rank: int, proc: Child) -> None:
        """Copies ``proc``'s stdout and stderr (binary pipes), tagged with ``rank``.

        Raises:
            OSError: the copy under ``directory`` cannot be created.
        """
        for name, pipe, dest in (("stdout", proc.stdout, self.stdout),
                                 ("stderr", proc.stderr, self.stderr)):
            tag = f"[{rank}]<{name}>:".encode() if self.prefix else b""
            copy = self._file(rank, name)

            def line(data: bytes, tag: bytes = tag, dest: BinaryIO = dest,
                     copy: BinaryIO | None = copy) -> None:
                data = data if data.endswith(b"\n") else data + b"\n"
                self.write(dest, tag + data)
                if copy is not None:  # only this thread writes it: no lock needed
                    try:
                        copy.write(data)
                        copy.flush()
                    except (OSError, ValueError):
                        pass  # a full disk must not stop the job's console output

            self.threads.append(pump(pipe, line, f"gradsync-output-{rank}-{name}"))

    def _file(self, rank: int, stream: str) -> BinaryIO | None:
        if self.directory is None:
            return None
        folder = os.path.join(self.directory, f"rank.{str(rank).zfill(self.width)}")
        os.makedirs(folder, exist_ok=True)
        handle = open(os.path.join(folder, stream), "wb")
        self.files.append(handle)
        return handle

    def write(self, dest: BinaryIO, data: bytes) -> None:
        """Writes ``data`` whole to ``dest``."""
        with self.lock:
            try:
                dest.write(data)
                dest.flush()
            except (OSError, ValueError):
                # The reader went away (`gradsync run ... | head`): keep draining the
                # children's pipes so that they never block on a full pipe, and drop the text.
                pass

    def message(self, text: str) -> None:
        """Writes one line of the program's own to ``stderr``."""
        self.write(self.stderr, f"{self.name}: {text}\n".encode())

    def drain(self, timeout: float) -> None:
        """Waits for the pipes to close; a process that escaped its group may keep one open."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        for handle in self.files:
            if not any(t.is_alive() for t in self.threads):
                handle.close()  # else a thread still writes it: the process's end closes it


class Interrupts:
    """The stopping signals (SIGINT, SIGTERM, SIGHUP) a launcher got: ``received`` is the
    first (None: none), ``hurry`` is set by a second one (skip the stop's grace)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.hurry = False

    def __call__(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.hurry = True

    @contextmanager
    def catching(self) -> Iterator["Interrupts"]:
        """Routes the stopping signals here while the ``with`` runs (only on the main thread:
        elsewhere Python cannot install handlers, and the caller's own stay).

        The children live in their own sessions, so a Ctrl-C in the terminal reaches only the
        launcher, which then stops them in order; the default handlers would leave them
        running."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, lambda signum, _frame: self(signum))
                    for sig in _SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass(frozen=True)
class Ssh:
    """How to run commands on other hosts.

    Args:
        command: the command (split like a shell would) that runs a command on a host.
        port: passed to ssh as ``-p``.
        timeout: seconds for ssh to connect.
        identity_file: the private key, passed to ssh as ``-i``.
    """

    command: str = "ssh"
    port: int | None = None
    timeout: float = DEFAULT_START_TIMEOUT
    identity_file: str | None = None

    def argv(self, host: str, command: str) -> list[str]:
        """The command line that runs the shell command ``command`` on ``host``."""
        argv = shlex.split(self.command)
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={math.ceil(self.timeout)}"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return argv + [host, command]

    def start(self, host: str, command: Sequence[str], assignments: Mapping[str, str],
              secret: bytes, grace: float, cwd: str | None = None) -> Process:
        """Starts ``command`` on ``host`` with the variables ``assignments`` and
        GRADSYNC_SECRET (``secret``, sent on ssh's stdin), under a lifeline that stops it
        (SIGTERM, SIGKILL ``grace`` seconds later) when its ``Process`` is signalled or this
        process goes away.

        Raises:
            OSError: ssh cannot be run.
        """
        script = remote_script(os.getcwd() if cwd is None else cwd, assignments, command,
                               grace)
        process = start(self.argv(host, script), stdin=subprocess.PIPE)
        process.lifeline = True
        stdin = process.proc.stdin
        assert stdin is not None  # started with stdin=PIPE
        try:
            stdin.write(secret.hex().encode() + b"\n")
            stdin.flush()
        except OSError:
            pass  # ssh already failed; whoever watches the process reports its exit status
        return process

    def probe(self, host: str) -> subprocess.Popen:
        """Starts ``ssh host true``: the reachability check of a host.

        Raises:
            StartError: ssh cannot be run (status 127).
        """
        try:
            return subprocess.Popen(self.argv(host, "true"), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise StartError(f"cannot run '{self.command}': {exc}", 127) from None

    @property
    def probe_limit(self) -> float:
        """Seconds a reachability check may take: ssh's own ConnectTimeout bounds the
        connection; the margin covers the login itself."""
        return self.timeout + 5.0

    def probe_error(self, host: str, proc: subprocess.Popen) -> str | None:
        """What a finished reachability check says is wrong with ``host`` (None: nothing)."""
        if proc.returncode in (0, None):
            return None
        assert proc.stderr is not None  # probe() pipes it
        detail = proc.stderr.read().decode(errors="replace").strip().splitlines()
        return (f"cannot run commands on {host} with '{self.command}' (status "
                f"{proc.returncode}" + (f": {detail[-1]}" if detail else "") + ")"
                + _ssh_fix(host, "\n".join(detail)))

    @staticmethod
    def end_probe(proc: subprocess.Popen) -> None:
        """Kills a reachability check that is still running and closes its pipe."""
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None  # probe() pipes it
        proc.stderr.close()


class HostChecks:
    """The reachability checks in flight (``Ssh.probe``), each with its deadline
    (``Ssh.probe_limit``): what the static start (every remote host before any rank starts,
    ``launcher.py``) and the elastic host pool (hosts as they are listed, ``host_pool.py``)
    both start, poll and collect. Neither waits on a check: each polls ``collect`` from its
    own loop, so a Ctrl-C is honoured at once."""

    def __init__(self, ssh: Ssh):
        self.ssh = ssh
        self._running: dict[str, tuple[subprocess.Popen, float]] = {}

    def start(self, host: str) -> None:
        """Starts ``host``'s check, unless one is running."""
        if host not in self._running:
            self._running[host] = (self.ssh.probe(host), time.monotonic() + self.ssh.probe_limit)

    def __contains__(self, host: str) -> bool:
        return host in self._running

    def __bool__(self) -> bool:
        """True while a check is running."""
        return bool(self._running)

    def collect(self) -> list[tuple[str, str | None, int]]:
        """The checks that ended, or ran past their deadline (then killed), since the last
        call: (host, what is wrong with it or None, the check's exit status: 255 for one
        that did not finish, as ssh's own for a connection that failed)."""
        now = time.monotonic()
        done: list[tuple[str, str | None, int]] = []
        for host, (proc, end) in list(self._running.items()):
            if proc.poll() is None and now < end:
                continue
            error: str | None
            if proc.poll() is None:
                error, code = f"ssh to {host} did not finish within {self.ssh.timeout:.0f}s", 255
            else:
                error, code = self.ssh.probe_error(host, proc), proc.returncode
            self.ssh.end_probe(proc)
            del self._running[host]
            done.append((host, error, code))
        return done

    def end(self) -> None:
        """Kills the checks still running."""
        for proc, _ in self._running.values():
            self.ssh.end_probe(proc)
        self._running.clear()


def _ssh_fix(host: str, detail: str) -> str:
    """The fix for the usual ssh failures, as the end of the error line ("" if unknown).

    ssh runs with BatchMode=yes, so a host that wants a password or an unknown host key fails
    at once instead of prompting (a prompt would hang the job)."""
    if "Permission denied" in detail:
        return (f"; ssh must log in to {host} without a password: install a key there "
                f"(ssh-copy-id {host}) or name one (gradsync run --ssh-identity-file)")
    if "Host key verification failed" in detail:
        return (f"; ssh does not know {host}'s host key: connect once by hand (ssh {host}) "
                f"or add it (ssh-keyscan {host} >> ~/.ssh/known_hosts)")
    if "Connection timed out" in detail or "No route to host" in detail:
        return f"; is {host} up, and is its ssh port open to this host (a firewall)?"
    return ""


def remote_script(cwd: str, assignments: Mapping[str, str], command: Sequence[str],
                  grace: float) -> str:
    """The shell command ssh runs: ``sh -c '<script>'``, for any login shell.

    The command's stdin is /dev/null; ssh's stdin carries the secret, then serves as the
    lifeline (see the module docstring). The lifeline reader ignores SIGTERM so that it
    survives its own ``kill -TERM 0`` to send the SIGKILL. It reads with the shell's builtin
    ``read``, so killing it once the command has exited leaves no process behind.
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


def exit_status(code: int) -> int:
    """A launcher's exit status for a child's return code: 128 + signal, as a shell does."""
    return code if code > 0 else 128 - code


def describe(code: int) -> str:
    """How a child ended, for a message: ``exited with status 3``, ``was killed by ...``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with status {code}"
