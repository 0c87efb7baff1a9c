"""Runs rank scripts through the real launcher, with a deadline that can never hang CI.

Each rank arms ``faulthandler.dump_traceback_later`` (via GS_TEST_DEADLINE, read by
``tests/ranks/common.py``), so a stuck rank prints every thread's stack and exits a few seconds
before the harness gives up; the launcher then stops the others. If even that fails, the
harness kills every process of the job, found by a mark in its environment (``run_job``).

Every process here starts through ``gradsync.run.processes.start`` (a session of its own, so a
signal to its group reaches everything it started) and is signalled through its ``Process``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from gradsync.run.processes import Process, start
from gradsync.testbed.procfs import gone
from gradsync.transport import tcp
from gradsync.transport.comm import Comm
from gradsync.transport.tcp import TcpPair

RANKS = Path(__file__).parent / "ranks"


# --- what a failed job shows -------------------------------------------------------------
#
# A test asserts on a job's result with the result as the message (``assert r.returncode ==
# 0, r``). pytest prints a str message whole but cuts any other object's repr to 240
# characters in its middle ("..."): a job's output lost the reason a rank failed that way
# (CI: test_ps.py's async-3-2, "worker 0 exited 1" and nothing of its traceback). So a result
# *is* a str, its report (``report``), and keeps its exit status and whole output as
# attributes.

REPORT_CHARS = 20_000
"""The most characters of a job's output that its report shows."""


# How a rank's first error starts in its output: a Python traceback, or the stack dump of a
# rank at its deadline (``faulthandler``, tests/ranks/common.py) or of a crash.
_FIRST_ERROR = ("Traceback (most recent call last)", "Timeout (", "Fatal Python error")


def report(head: str, output: str, limit: int = REPORT_CHARS) -> str:
    """``head``, then ``output`` whole if it fits in ``limit`` characters; else its first
    error (a traceback or a stack dump: the failing rank's reason, which the output of the
    ranks stopped after it can push far from the end) and as much of its end as fits, cut
    at line starts."""
    if len(output) <= limit:
        return f"{head}\n{output}"
    lines = output.splitlines(keepends=True)
    tail, size = [], 0
    for line in reversed(lines):
        if size + len(line) > limit * 2 // 3:
            if not tail:
                tail.append(line[-(limit * 2 // 3):])  # one huge line: its end
            break
        tail.append(line)
        size += len(line)
    tail.reverse()
    start = len(lines) - len(tail)
    shown = [f"{head}\n"]
    first = next((i for i in range(start) if any(m in lines[i] for m in _FIRST_ERROR)), None)
    if first is not None:
        block, size = [], 0
        for line in lines[first:start]:
            if size + len(line) > limit // 3:
                break
            block.append(line)
            size += len(line)
        shown += [f"[... {first} lines ...]\n", *block]
        first += len(block)
    else:
        first = 0
    if start > first:
        shown.append(f"[... {start - first} lines ...]\n")
    return "".join(shown + tail)


class Result(str):
    """A job's end: ``returncode`` and ``output`` (also ``stdout``, as subprocess names it;
    ``args``, the command). As a str it is its report: the exit status and the output, whole
    or its first traceback and its tail (``report``)."""

    def __new__(cls, returncode: int, output: str, args=None):
        self = super().__new__(cls, report(f"exit {returncode}", output))
        self.returncode, self.output, self.args = returncode, output, args
        return self

    @property
    def stdout(self) -> str:
        return self.output


def launch(np_: int, script: str, *args: str, timeout: float = 60, env: dict | None = None,
           launcher_args: tuple = ()) -> Result:
    """Runs ``gradsync run -np N python tests/ranks/<script> args`` and returns its result; the
    whole job (launcher and ranks) is stopped at ``timeout`` (``run_job``)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full_env.update({"GS_TEST_DEADLINE": str(max(5.0, timeout - 8)),
                     "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "gradsync", "run", "-np", str(np_), *launcher_args,
           sys.executable, str(RANKS / script), *args]
    proc = run_job(cmd, timeout=timeout, env=full_env, mark=full_env.get(MARK),
                   what=f"{script} with {np_} ranks")
    return Result(proc.returncode, proc.stdout)


class Rank(str):
    """One rank's end (``spawn``): ``rank``, ``returncode``, ``output``; as a str, its report
    (as ``Result``)."""

    def __new__(cls, rank: int, returncode: int, output: str):
        self = super().__new__(cls, report(f"rank {rank} exit {returncode}", output))
        self.rank, self.returncode, self.output = rank, returncode, output
        return self


def worker_results(output: str) -> dict[str, dict]:
    """Each ``RESULT id=<worker> key=value ...`` line of a job's output, by worker id (the
    elastic rank scripts end with one)."""
    found = {}
    for line in re.findall(r"RESULT (.*)", output):
        fields = dict(item.split("=", 1) for item in line.split())
        found[fields.pop("id")] = fields
    return found


def spawn(np_: int, script: str, *args: str, timeout: float = 60, env: dict | None = None,
          per_rank_env=None, agent_store: bool = True) -> list[Rank]:
    """Starts ``np_`` ranks the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ...), without
    gradsync's launcher, so that each rank's own exit status and output can be checked (the
    launcher would stop the survivors of a failure before they report it).

    Args:
        agent_store: host the store here, as torchrun's agent does
            (TORCHELASTIC_USE_AGENT_STORE=True); otherwise rank 0 hosts it.
    """
    import socket

    store = None
    if agent_store:
        import loopback  # an IPv4 listener: no client waits on a reverse DNS look-up

        store = loopback.store(timeout)
        port = store.port
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    procs = []
    for r in range(np_):
        e = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
        e.update({"RANK": str(r), "WORLD_SIZE": str(np_), "LOCAL_RANK": str(r),
                  "LOCAL_WORLD_SIZE": str(np_), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                  "GS_TEST_DEADLINE": str(max(5.0, timeout - 8)),
                  "TORCHELASTIC_USE_AGENT_STORE": str(agent_store)})
        e.update(env or {})
        e.update((per_rank_env or (lambda r: {}))(r))
        cmd = [sys.executable, str(RANKS / script), *args]
        # Forked where it can be (each rank leads its own session either way, so the deadline's
        # signal below reaches it alike): "One import of torch for every job", below.
        procs.append(_fork_from_session(cmd, e) or start(cmd, e, merge_stderr=True, text=True))
    results = []
    try:
        for r, p in enumerate(procs):
            out, _ = p.proc.communicate(timeout=timeout)
            results.append(Rank(r, p.proc.returncode, out))
    except subprocess.TimeoutExpired:
        dump = []
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.signal(signal.SIGKILL)
            dump.append(report(f"--- rank {r} ---", p.proc.communicate()[0],
                               REPORT_CHARS // np_))
        raise AssertionError(f"{script} passed its {timeout}s deadline:\n"
                             + "\n".join(dump)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.signal(signal.SIGKILL)
    return results


def bench(benchmark: str, *args: str, timeout: float = 120) -> Result:
    """Runs ``gradsync bench BENCHMARK ARGS`` to its end (the whole job stopped at
    ``timeout``: ``run_job``); returns the result with stdout and stderr together."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return run_job([sys.executable, "-m", "gradsync", "bench", benchmark, *args],
                   timeout=timeout, env=env, what=f"bench {benchmark}")


SSH_STAND_IN = """\
#!/bin/sh
# Stands in for ssh: logs its arguments, skips the options, fails for host 'unreachable', and
# runs the command here with an almost empty environment, like a fresh login on another host.
printf '%s\\n' "$*" >> "$FAKE_SSH_LOG"
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ "$1" = unreachable ]; then
  echo "ssh: connect to host unreachable port 22: Connection refused" >&2
  exit 255
fi
shift
exec env -i PATH="$PATH" PYTHONPATH="$PYTHONPATH" {session}sh -c "$*"
"""


def ssh_stand_in(directory: Path, own_session: bool = False) -> tuple[Path, Path]:
    """Writes an ssh stand-in into ``directory``; returns the script and the log it appends
    its arguments to (set FAKE_SSH_LOG to it in the launcher's environment).

    ``own_session``: run the command in a session of its own (``setsid -w``), as on a real
    remote host: the launcher cannot signal it, so only closing ssh's stdin (the lifeline) or
    the command's own end stops it."""
    script = directory / ("remote_ssh" if own_session else "fake_ssh")
    script.write_text(SSH_STAND_IN.replace("{session}", "setsid -w " if own_session else ""))
    script.chmod(0o755)
    return script, directory / "ssh.log"


def remote_ssh(directory: Path) -> tuple[Path, Path]:
    """``ssh_stand_in`` for another host: the command runs in a session of its own."""
    return ssh_stand_in(directory, own_session=True)


def tcp_mesh(n, splice_on=lambda r: True, comm_class=lambda r: Comm, **comm_args):
    """``n`` Comms joined by loopback TCP, as in a job over TCP (without the handshake; the
    sockets tuned as a job's are)."""
    socks = {}
    for a in range(n):
        for b in range(a + 1, n):
            server = socket.create_server(("127.0.0.1", 0))
            client = socket.create_connection(server.getsockname())
            socks[a, b], _ = server.accept()
            socks[b, a] = client
            server.close()
            for sock in (socks[a, b], client):
                tcp._tune(sock)
    comms = [comm_class(r)(r, n, {p: TcpPair(p, socks[r, p], splice_on(r))
                                  for p in range(n) if p != r}, 10.0, **comm_args)
             for r in range(n)]
    return comms


def run_ranks(comms, fn):
    """Runs ``fn(comm)`` on one thread per rank; returns their results, raises their errors."""
    results, errors = [None] * len(comms), []

    def run(c):
        try:
            results[c.rank] = fn(c)
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    return results


# --- a launcher's whole job, found and stopped by a mark in its environment -----------------
#
# A launcher starts each rank in a session of its own (so that it can signal each rank's
# process group), and torchrun's agent starts its workers likewise: killing the launcher's
# process group misses the ranks, and a rank whose launcher died is reparented, so ancestry
# finds it no more. What every process of one job keeps is its environment: ``job`` gives the
# launcher a variable that no other job carries, which its ranks inherit, and ``marked`` finds
# exactly those processes; other jobs on the machine (other tests, other users) are invisible.

MARK = "GS_TEST_JOB"
"""The environment variable whose value marks the processes of one test's job."""

START_METHOD = "GRADSYNC_START_METHOD"
"""How a launcher started by ``run_job`` starts its local ranks (``gradsync run
--start-method``): ``forkserver`` unless the job's environment says otherwise, or this
process's ``GS_TEST_START_METHOD`` (``exec``: every job as users' jobs start by default)."""


def new_mark() -> str:
    """A value of ``MARK`` that no other job on this machine carries."""
    import uuid

    return uuid.uuid4().hex


def marked(mark: str) -> list[int]:
    """The live processes (zombies excluded) whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone, or another user's: not ours
            continue
        if not gone(int(entry)):
            found.append(int(entry))
    return found


def kill_marked(mark: str) -> None:
    """SIGKILL to every process of the job marked ``mark``, wherever it was reparented."""
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --- one import of torch for every job ---------------------------------------------------
#
# Each job's launcher and its template (or tests/ranks/forked.py) used to import torch,
# torch._dynamo and gradsync afresh: 2 to 3 s of CPU a job, a third of the default tier's CPU
# on the 2-core machine (docs/testing.md, "One import of torch for every job"). So each pytest
# process keeps one template of its own (gradsync's forkserver, ``_session_template``) that
# imported them once, and ``run_job`` forks from it the jobs that can be: ``gradsync run``
# (through tests/ranks/handed_launcher.py, which forks the job's template before it becomes the
# launcher), tests/ranks/forked.py, and ``spawn``'s ranks. A forked job's processes do not show the job's mark in
# /proc/<pid>/environ (the kernel shows the environment a process was exec'd with: here the
# session template's, which carries ``SESSION_MARK``), so a job whose caller looks for its
# processes by its mark (``mark=`` or ``MARK`` in ``env``) is exec'd as before, and a forked
# job is stopped by its process tree (``_kill_forked``). ``GS_TEST_FORK_JOBS=0`` execs every job.

SESSION_MARK = "GS_TEST_SESSION_TEMPLATE"
"""The variable in the session template's environment (and so in the /proc environ of every
process forked from it), valued by the pytest process that started it."""

_SESSION_PRELOAD = ("?torch._dynamo", "?gradsync.torch", "gradsync.run.cli",
                    "gradsync.run.launcher", "gradsync.run.elastic")
_session: list = []  # [the Forkserver], once started


def _session_template():
    """This process's template (started at the first call), or None where jobs are exec'd."""
    if os.environ.get("GS_TEST_FORK_JOBS", "1") == "0":
        return None
    if not _session:
        import atexit

        from gradsync.run.forkserver import Forkserver

        forks = Forkserver(_SESSION_PRELOAD)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
        env.update({SESSION_MARK: str(os.getpid()), "OMP_NUM_THREADS": "1"})
        forks.begin(env)
        atexit.register(forks.close)
        _session.append(forks)
    return _session[0]


def _forkable(cmd: list, env: dict) -> list | None:
    """``cmd`` as the session template runs it, or None when it is exec'd."""
    words = [str(w) for w in cmd]
    if not words or words[0] != sys.executable:
        return None
    if words[1:4] == ["-m", "gradsync", "run"]:
        if env.get(START_METHOD) == "forkserver":
            return [sys.executable, str(RANKS / "handed_launcher.py"), *words[3:]]
        return words
    if len(words) > 1 and words[1] == str(RANKS / "forked.py"):
        return words
    return None


def _fork_from_session(cmd: list, env: dict, cwd=None) -> Process | None:
    """``cmd`` forked from the session template, its stderr on its stdout, read as a
    ``Popen`` (``_ForkedJob``); None where jobs are exec'd or the template cannot run it."""
    template = _session_template()
    forked = None if template is None else template.start(cmd, env, cwd=cwd, merge_stderr=True)
    return None if forked is None else Process(_ForkedJob(forked.proc, list(cmd)))


class _ForkedJob:
    """A job forked from the session template, read as ``run_job`` reads a ``Popen``:
    ``communicate`` (text, stderr merged), ``poll``, ``wait``, ``returncode``, ``args``."""

    def __init__(self, child, args: list):
        self.child, self.args, self.pid = child, args, child.pid
        self._data = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        self._data = self.child.stdout.read()  # to the end: every holder of the pipe gone
        self.child.stdout.close()

    @property
    def returncode(self):
        return self.child.returncode

    def poll(self):
        return self.child.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.child.wait(timeout)

    def communicate(self, timeout: float | None = None):
        end = None if timeout is None else time.monotonic() + timeout
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.child.wait(None if end is None else max(0.0, end - time.monotonic()))
        text = self._data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        return text, None


def _tree(*roots: int) -> list[int]:
    """``roots`` and every process below them, from one reading of /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def session_forks() -> list[int]:
    """The live processes below this one forked from its session template, the template
    itself left out (its /proc environ carries ``SESSION_MARK`` with this process's pid)."""
    template = _session[0].template_pid if _session else None
    needle = f"{SESSION_MARK}={os.getpid()}".encode()
    found = []
    for pid in _tree(os.getpid()):
        if pid in (os.getpid(), template) or gone(pid):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def _kill_forked(job: _ForkedJob) -> None:
    """SIGKILL to a forked job's every process: its tree (stopped first, so that none forks
    meanwhile; the launcher is a subreaper, so its ranks stay below it), and the processes the
    session template's forks left as this process's children (a launcher that ended before its
    ranks: they were reparented here, a subreaper too)."""
    stopped: set[int] = set()
    roots = [job.pid, *session_forks()]
    while True:
        fresh = [pid for pid in _tree(*roots) if pid not in stopped]
        if not fresh:
            break
        for pid in fresh:
            stopped.add(pid)
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_job(cmd: list, *, timeout: float, env: dict | None = None, cwd=None,
            mark: str | None = None, grace: float = 8.0,
            what: str | None = None, fork: bool = True) -> Result:
    """Runs a launcher command (``gradsync run``/``bench``, torchrun) to its end, stdout and
    stderr together, with a deadline for the whole job, not only the launcher.

    At ``timeout`` the launcher's process group gets SIGTERM (a launcher then stops its
    ranks), and after ``grace`` seconds every process that carries the job's mark gets
    SIGKILL; then AssertionError with the output's tail. Every process of the job is also
    killed if the caller is interrupted, so none outlives the test.

    Args:
        cmd: the command line.
        env: the launcher's environment (default this process's without its ``GRADSYNC_*``
            settings, as ``launch`` and ``bench`` give); ``MARK`` is added to it, and
            ``START_METHOD`` where it does not say.
        cwd: the launcher's working directory.
        mark: the value of ``MARK`` for this job (default a new one), for a test that looks
            for its own processes with ``marked``.
        what: how the deadline's error names the job (default the command's start).
        fork: whether the job may be forked from the session template ("One import of torch
            for every job", above); False for a test of what an exec'd launcher is.
    """
    looked_for = mark is not None or MARK in (env or {})  # by the caller, with ``marked``
    mark = mark or new_mark()
    full_env = dict(env if env is not None else
                    {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")})
    full_env[MARK] = mark
    # Local ranks fork from one template that imported torch once (docs/testing.md, "Ranks
    # forked from a template"); a test of the exec'd start sets it to exec.
    full_env.setdefault(START_METHOD, os.environ.get("GS_TEST_START_METHOD", "forkserver"))
    forked = _forkable(cmd, full_env) if fork and not looked_for else None
    launcher = None if forked is None else _fork_from_session(forked, full_env, cwd)
    # Read while it stops its ranks, so that it never blocks on a full pipe meanwhile.
    launcher = launcher or start(cmd, full_env, merge_stderr=True, text=True, cwd=cwd)
    proc = launcher.proc

    def kill() -> None:
        if isinstance(proc, _ForkedJob):
            _kill_forked(proc)
        kill_marked(mark)  # the ranks it exec'd (reparented here, once a forked one ended)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            kill()
            out, _ = proc.communicate()
        kill()  # ranks the launcher did not stop in its grace
        what = what or f"{' '.join(map(str, cmd[:6]))} ..."
        raise AssertionError(report(f"{what} passed its {timeout}s deadline:", out)) from None
    except BaseException:
        kill()
        proc.wait()
        raise
    return Result(proc.returncode, out, proc.args)
