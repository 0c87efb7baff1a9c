"""Ranks forked from a process that imported torch once: ``gradsync run --start-method
forkserver``.

By default a launcher starts each rank as a new interpreter (``exec``, as mpirun and torchrun
do), and each one imports torch before its first line of training: 1.5 s of CPU on this
project's machines (docs/launch.md, "Starting ranks from a template"). Eight ranks on a host
pay it eight times, on the cores they are about to train on, and an elastic job pays it again
for each replacement. With ``forkserver`` the launcher starts one *template* on its host,
``python -m gradsync.run.forkserver``, which imports the preloaded modules once (gradsync, and
torch and NumPy where they are installed, and each ``--preload`` module), starts no thread, and
then forks a rank for each request, as Python's ``multiprocessing`` does with its ``forkserver``
start method and ``set_forkserver_preload``. A forked rank costs milliseconds.

**A request** (one message on a ``SOCK_SEQPACKET`` pair, so one ``send`` is one message): the
rank's whole environment, working directory, cores, command, and its stdout and stderr pipes,
passed as file descriptors (``SCM_RIGHTS``). The answer is the rank's pid, or why it could not
be forked.

**Whose child.** The launcher must see a forked rank as it sees a started one: wait for it, read
its exit status (negative: the signal that ended it), signal its process group. So the rank is
made the launcher's own child: the launcher is a *child subreaper* (``prctl``), the template
forks a short-lived child, that child forks the rank and exits at once, and the orphaned rank
is handed to the nearest subreaper among its ancestors, the launcher. The template answers
only after it has reaped the short-lived child, so by then the rank's parent is the launcher
and ``waitpid`` works on it (``Forked``). The rank calls ``setsid`` before it writes its pid
for the template: it leads its own session and process group, as a started rank does
(``processes.start``), before the launcher can signal that group. It then waits until its
parent is the launcher, so that its first line already sees the launcher as ``os.getppid()``.

**What the rank sees** is what ``python [-u] script.py args`` (or ``python [-u] -m module
args``) would give it: ``sys.argv``, ``sys.path[0]`` (the script's directory, or the working
directory for ``-m``), the script run as a fresh ``__main__`` module, standard streams on its
pipes (stdout buffered unless ``-u`` or ``PYTHONUNBUFFERED``, stderr by line), ``/dev/null`` on
stdin, the launcher's environment and working directory, its cores bound before its first line
runs, and an uncaught exception's traceback from the script's first frame with exit status 1.
What differs, and is documented (docs/launch.md):

- the template was exec'd, and the preloaded modules imported, with the launcher's environment,
  the settings it gives the ranks of its host (``OMP_NUM_THREADS``, glibc's malloc variables,
  which glibc reads once, at a process's start, and a fork keeps) and the ``-x`` variables: a
  setting read only then takes that value for every rank;
- NumPy's global random state, copied from the template, is drawn again from the OS (Python's
  ``random`` does so itself at a fork); torch's default generator starts from its fixed seed in
  any case;
- ``/proc/<pid>/environ`` shows the template's environment (the kernel keeps the block the
  process was exec'd with); ``os.environ`` in the rank is its own.

**Which commands.** A command this interpreter runs as ``<python> [-u] script [args]`` or
``<python> [-u] -m module [args]``, where ``<python>`` is the launcher's own interpreter (the
same file, in the same directory: a virtual environment's ``python`` is another interpreter).
Anything else (another interpreter, ``-c``, other flags, a shell script), and every rank on
another host, is started as before: ``Forkserver.start`` returns None and the launcher execs it.

**The job's store.** The launcher of a job whose template runs asks it for one more child
before the ranks: the *store keeper* (``Forkserver.keep_store``; ``keeper.py``), forked like a
rank (the launcher's child, its own session), which hosts the job's TCPStore on the job's store
address and sends its port back on a pipe. torch is already imported there, so neither the
launcher nor the keeper imports it: a forkserver job pays torch's import once, in the
template. The keeper ends with its lifeline pipe, as ``keeper.py`` says.

**A template handed down.** A program that starts many launchers on one host (this project's
tests start hundreds) can pay torch's import once for all of them: it forks, from a process that
imported torch already, a process that becomes the launcher, and before that a template of its
own (``main``); the launcher finds it in ``HANDED`` (``FD:PID``: its socket and pid), which
``take_handed`` reads and removes, so that no rank inherits it. The template must be the
launcher's child or a descendant of it (the ranks it forks are reparented to the launcher,
a subreaper). The launcher then asks it to import the job's ``--preload`` modules (a
``{"preload": [...]}`` message, answered ``{"ok": true}``; a module that cannot be imported
fails every start, as in a template of the launcher's own), and uses it as its own. What a
template's start reads once (glibc's malloc variables, ``OMP_NUM_THREADS`` as the OpenMP runtime
reads it at its load) is then whatever the forking program had.

**Lifetime.** The template ends when its socket closes: the launcher closed it
(``Forkserver.close``) or ended. A rank it forked lives on without it, and so does the keeper.
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from .keeper import READY_TIMEOUT as KEEPER_TIMEOUT, StoreKeeper, serve_until_closed
from .processes import Process

__all__ = ["Forkserver", "Forked", "Plan", "plan", "DEFAULT_PRELOAD", "ELASTIC_PRELOAD", "MODULE",
           "HANDED", "take_handed", "become_subreaper"]

MODULE = "gradsync.run.forkserver"
"""What the launcher runs (``python -m``) to start a template."""

DEFAULT_PRELOAD = ("numpy", "torch", "torch.distributed", "gradsync", "gradsync.api")
"""What every template imports when it is installed: the imports every rank of a job makes."""

ELASTIC_PRELOAD = ("?torch._dynamo",)
"""What an elastic job's templates import besides (``?``: where installed). A torch process's
first optimizer imports ``torch._dynamo`` (``torch.optim``'s ``_disable_dynamo``): 1.6 s of CPU
on this project's machines, as much as torch itself, paid by every forked rank until the
template holds it. Every worker of an elastic job trains (its ``State`` holds the optimizer's),
and a worker that joins a running job imports it before it says it is ready anyway
(``elastic/worker._prepare``). Other jobs import it only with ``--preload torch._dynamo``: a
job that builds no optimizer would pay it for nothing, 1.4 s at its start (docs/launch.md,
"What a training script imports later")."""

HANDED = "GRADSYNC_TEMPLATE"
"""``FD:PID`` of a template the launcher's starter forked for it (module docstring, "A
template handed down"); read once, by ``take_handed``."""

_MESSAGE = 1 << 20  # the largest request: an environment of a few KiB, with room to spare
_PR_SET_CHILD_SUBREAPER = 36
_READY_TIMEOUT = 300.0  # seconds a template may take to import its modules (a loaded host)


@dataclass(frozen=True)
class Plan:
    """How a rank's command runs in a template: a script (``module`` False) or a module, with
    its arguments, and whether ``-u`` was given."""

    target: str
    args: tuple[str, ...]
    module: bool
    unbuffered: bool


def plan(command: Sequence[str], executable: str = sys.executable) -> Plan | None:
    """How ``command`` runs in a template of ``executable``, or None when it cannot (another
    interpreter, another flag than ``-u`` and ``-m``, no script)."""
    if not command:
        return None
    found = shutil.which(command[0])
    if found is None or not _same_interpreter(found, executable):
        return None
    words, unbuffered = list(command[1:]), False
    while words and words[0] == "-u":
        words.pop(0)
        unbuffered = True
    if len(words) >= 2 and words[0] == "-m":
        return Plan(words[1], tuple(words[2:]), True, unbuffered)
    if not words or words[0].startswith("-"):
        return None
    return Plan(words[0], tuple(words[1:]), False, unbuffered)


def _same_interpreter(found: str, executable: str) -> bool:
    """The same file, reached from the same directory: ``/usr/bin/python3`` and
    ``/usr/bin/python3.11`` are one interpreter, a virtual environment's ``bin/python`` (a
    link to the same file) is another, with other packages."""
    found, executable = os.path.abspath(found), os.path.abspath(executable)
    return os.path.dirname(found) == os.path.dirname(executable) and \
        os.path.realpath(found) == os.path.realpath(executable)


def become_subreaper() -> None:
    """Makes this process a child subreaper (``prctl``): an orphan below it is reparented to
    it, so that it can wait for the ranks a template forks (module docstring, "Whose child").

    Raises:
        OSError: the kernel refused.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def take_handed() -> "tuple[socket.socket, Forked] | None":
    """The template handed down to this process (``HANDED``), its variable removed from the
    environment; None when there is none or it is not one (a descriptor that is not a socket:
    the variable was inherited by a process it was not meant for)."""
    value = os.environ.pop(HANDED, "")
    fd, _, pid = value.partition(":")
    if not (fd.isdigit() and pid.isdigit()):
        return None
    try:
        connection = socket.socket(fileno=int(fd))
    except OSError:
        return None
    if connection.type != socket.SOCK_SEQPACKET:
        connection.detach()  # not ours to close
        return None
    return connection, Forked(int(pid), ["forkserver template"], None, None)


class Forked:
    """A rank forked by a template, made this process's child: the part of
    ``subprocess.Popen`` the launchers use (``pid``, ``poll``, ``wait``, ``returncode``, the
    ``stdout`` and ``stderr`` pipes; no ``stdin``: the rank reads ``/dev/null``)."""

    stdin: IO[bytes] | None = None

    def __init__(self, pid: int, args: Sequence[str], stdout: IO[bytes] | None,
                 stderr: IO[bytes] | None):
        self.pid, self.args, self.stdout, self.stderr = pid, list(args), stdout, stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one waitpid at a time: a second would find no child

    def poll(self) -> int | None:
        """The exit status (negative: the signal that ended it), None while it runs."""
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the rank to end; its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if timeout is None:
            code = self._reap(0)
            assert code is not None  # a blocking waitpid returns only once it ended
            return code
        end, pause = time.monotonic() + timeout, 0.0005
        while (code := self.poll()) is None:
            left = end - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.05)
        return code

    def kill(self) -> None:
        """SIGKILL, unless it was reaped already."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:
                    # Reaped by someone else (a SIGCHLD set to SIG_IGN): its status is lost,
                    # as subprocess.Popen's is in that case.
                    self.returncode = 0
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


class Forkserver:
    """The launcher's end of one host's template: starts it at the first request, then asks it
    for each rank.

    Args:
        preload: modules the template imports beyond ``DEFAULT_PRELOAD``; one that cannot be
            imported fails every start (``OSError``), as a missing program would.
        executable: the interpreter the template runs (the launcher's).
        handed: a template already running (``take_handed``), used instead of starting one.
    """

    def __init__(self, preload: Sequence[str] = (), executable: str = sys.executable, *,
                 handed: "tuple[socket.socket, Forked] | None" = None):
        self.preload, self.executable = tuple(preload), executable
        self._handed = handed
        self._socket: socket.socket | None = None
        self._template: subprocess.Popen | Forked | None = None
        self._failed: OSError | None = None  # why ``begin`` could not start the template
        self._env: Mapping[str, str] | None = None  # the environment ``begin`` was given
        self._lock = threading.Lock()  # one request at a time on the one socket

    def begin(self, env: Mapping[str, str]) -> None:
        """Starts the template now, with the environment ``env``: before the job's store,
        which its keeper may hold (``keep_store``); without it, the first ``start`` starts it
        with that rank's environment. A failure is raised by the first ``start``."""
        with self._lock:
            self._env = env
            try:
                self._connection(env)
            except OSError as exc:
                self._failed = exc

    def start(self, command: Sequence[str], env: Mapping[str, str], *,
              cwd: str | None = None, cores: Sequence[int] | None = None,
              merge_stderr: bool = False) -> Process | None:
        """Forks ``command`` as a rank with the whole environment ``env``, in ``cwd`` (None:
        this process's), bound to ``cores`` (None: not bound); None when ``command`` is not one
        a template runs (``plan``): the caller starts it itself. With ``merge_stderr`` its
        stderr is its stdout's pipe (``stderr`` None), as ``stderr=subprocess.STDOUT`` gives.

        Raises:
            OSError: the template cannot be started, failed to import a module, or could not
                fork the rank.
        """
        how = plan(command, self.executable)
        if how is None:
            return None
        request = {"target": how.target, "args": list(how.args), "module": how.module,
                   "unbuffered": how.unbuffered, "env": dict(env),
                   "cwd": os.path.abspath(cwd or os.getcwd()),
                   "cores": None if cores is None else list(cores)}
        out_read, out_write = os.pipe()
        err_read, err_write = (-1, os.dup(out_write)) if merge_stderr else os.pipe()
        reads = [fd for fd in (out_read, err_read) if fd >= 0]
        try:
            with self._lock:
                connection = self._connection(env)
                socket.send_fds(connection, [json.dumps(request).encode()],
                                [out_write, err_write])
                answer = self._answer(connection)
        except BaseException:
            for fd in reads:
                os.close(fd)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        if "error" in answer:
            for fd in reads:
                os.close(fd)
            raise OSError(f"the forkserver could not start {' '.join(command)}: "
                          f"{answer['error']}")
        child = Forked(answer["pid"], command, os.fdopen(out_read, "rb"),
                       None if err_read < 0 else os.fdopen(err_read, "rb"))
        return Process(child)

    @property
    def template_pid(self) -> int | None:
        """The template's pid, once it runs (or was handed down); None before."""
        return None if self._template is None else self._template.pid

    @property
    def begun(self) -> bool:
        """Whether ``begin`` was called (the template runs, or its start failed)."""
        return self._env is not None

    def keep_store(self, store_addr: str) -> "StoreKeeper":
        """Forks the job's store keeper (module docstring, "The job's store"): a TCPStore
        reached at ``store_addr``, listening on a free port, until ``StoreKeeper.close``.
        Call it once the template was begun (``begin``).

        Raises:
            OSError: the template cannot be started or fork, or the store cannot start.
        """
        port_read, port_write = os.pipe()
        life_read, life_write = os.pipe()
        try:
            try:
                with self._lock:
                    assert self._env is not None, "keep_store before begin"
                    connection = self._connection(self._env)
                    socket.send_fds(connection, [json.dumps({"store": store_addr}).encode()],
                                    [port_write, life_read])
                    answer = self._answer(connection)
            finally:
                os.close(port_write)
                os.close(life_read)
            if "error" in answer:
                raise OSError(f"the forkserver could not start the store: {answer['error']}")
            keeper = StoreKeeper(Forked(answer["pid"], ["store keeper"], None, None), life_write,
                                 answer=port_read)
        except BaseException:
            os.close(port_read)
            os.close(life_write)
            raise
        reply = keeper.answer() or {}
        if "port" not in reply:
            keeper.close()
            raise OSError(reply.get("error") or
                          f"the store keeper gave no port within {KEEPER_TIMEOUT:.0f} s")
        keeper.port = int(reply["port"])
        return keeper

    def close(self) -> None:
        """Ends the template (its socket closes); the ranks it forked live on."""
        with self._lock:
            if self._handed is not None:  # never used: it ends with its socket
                self._socket, self._template = self._handed
                self._handed = None
            if self._socket is not None:
                self._socket.close()
                self._socket = None
            if self._template is not None:
                try:
                    self._template.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._template.kill()
                    self._template.wait()
                self._template = None

    def _connection(self, env: Mapping[str, str]) -> socket.socket:
        if self._failed is not None:
            raise self._failed
        if self._socket is not None:
            return self._socket
        if sys.platform != "linux":
            raise OSError("--start-method forkserver needs Linux (a child subreaper)")
        become_subreaper()
        if self._handed is not None:
            self._socket, self._template = self._handed
            self._handed = None
            self._socket.send(json.dumps({"preload": list(self.preload)}).encode())
            self._answer(self._socket)
            return self._socket
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._template = subprocess.Popen(
                [self.executable, "-m", MODULE, str(theirs.fileno()), *self.preload],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        return ours

    def _answer(self, connection: socket.socket) -> dict:
        """The template's answer to the request just sent (the first waits for its imports)."""
        connection.settimeout(_READY_TIMEOUT)
        try:
            data = connection.recv(_MESSAGE)
        except socket.timeout:
            raise OSError(f"the forkserver did not answer in {_READY_TIMEOUT:.0f} s") from None
        if not data:
            code = None if self._template is None else self._template.poll()
            raise OSError(f"the forkserver ended (exit status {code}); its output is above")
        return json.loads(data)


def keep(request: dict) -> None:
    """Makes this forked process the job's store keeper (``keeper.serve_until_closed``): it
    hosts the store on a socket of its own, says its port, and ends with its lifeline. Never
    returns."""
    from ..cluster.rendezvous import host_store

    said, lifeline = request["fds"]
    serve_until_closed(lambda: host_store(request["store"], 0, 30.0, client_addr="127.0.0.1"),
                       said, lifeline)


# ---------------------------------------------------------------------------------- template
def serve(connection: socket.socket, preload: Sequence[str]) -> dict | None:
    """The template's loop: imports the modules (each of ``DEFAULT_PRELOAD`` only where it is
    installed, then ``preload``), then forks a rank for each request until the socket closes
    (None). Returns only in a forked rank: its request, with its pipes as ``fds``."""
    failure = _preload(preload)
    sys.stdout.flush()  # nothing of the template's may reach a rank's pipes
    sys.stderr.flush()
    # The imported objects out of the collector's reach: a rank's collections would otherwise
    # write to every one of their pages (copy on write) and copy the template's whole heap.
    gc.freeze()
    while True:
        try:
            data, fds, _flags, _address = socket.recv_fds(connection, _MESSAGE, 2)
        except OSError:
            return None
        if not data:
            return None
        try:
            request = json.loads(data)
            if "preload" in request:  # a handed template's launcher (module docstring)
                failure = failure or _preload(request["preload"], defaults=False)
                connection.send(json.dumps({"ok": True}).encode())
                continue
            if failure is not None:
                raise OSError(failure)
            if len(fds) != 2:
                raise OSError(f"a request came with {len(fds)} descriptors, not 2")
            pid = _fork()
            if pid == 0:  # the rank
                connection.close()
                request["fds"] = fds
                return request
            answer: dict[str, object] = {"pid": pid}
        except (OSError, ValueError) as exc:
            answer = {"error": str(exc)}
        for fd in fds:
            os.close(fd)  # the rank has its own copies
        connection.send(json.dumps(answer).encode())


def _preload(preload: Sequence[str], defaults: bool = True) -> str | None:
    """Imports the modules (``DEFAULT_PRELOAD`` first, with ``defaults``); returns why one of
    ``preload`` failed, None when all did."""
    for name in DEFAULT_PRELOAD if defaults else ():
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed: a rank that needs it imports it itself
    for name in preload:
        try:
            importlib.import_module(name.removeprefix("?"))
        except Exception as exc:  # whatever a module's import raises is the user's to see
            if not (name.startswith("?") and isinstance(exc, ImportError)):  # ``?``: if there
                return f"--preload {name}: {type(exc).__name__}: {exc}"
    return None


def _fork() -> int:
    """Forks the rank as the launcher's child (module docstring): 0 in the rank, which leads a
    session of its own by then, its pid in the template."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # the short-lived child: forks the rank and leaves
        rank = -1
        try:
            os.close(read)
            short_lived = os.getpid()
            rank = os.fork()
            if rank == 0:
                # Before the launcher can know the pid, so that a signal to its group always
                # finds it; the template reads the pid only once it is written.
                try:
                    os.setsid()
                    os.write(write, str(os.getpid()).encode())
                    os.close(write)
                except BaseException:
                    os._exit(1)  # the template reads no pid and answers the error
                # Not a line of the rank's own before it is the launcher's child: its parent
                # is the short-lived child until that one has exited, which on a busy machine
                # can come after the script's first lines (os.getppid() read there).
                while os.getppid() == short_lived:
                    time.sleep(0.0002)
        finally:
            if rank != 0:
                os._exit(0)  # never back into the template's loop
        return 0
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        pid = answer.read()  # to the end: the rank's write, once the middle child is gone too
    os.waitpid(middle, 0)  # the rank is the launcher's child from here on
    if not pid:
        raise OSError("the rank could not be forked")
    return int(pid)


def become(request: dict) -> None:
    """Makes this forked process the rank ``request`` describes and runs its script or module
    as ``__main__`` (module docstring, "What the rank sees"); returns when it ends."""
    out, err = request["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request["cores"] is not None:
        os.sched_setaffinity(0, request["cores"])
    _streams(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # the template's state, drawn again from the OS
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["module"]:
        _run_module(request["target"], request["args"])
    else:
        _run_script(request["target"], request["args"])


def _streams(unbuffered: bool) -> None:
    """New standard streams on descriptors 0-2, buffered as a new interpreter's would be on
    pipes: stdout by block (unless ``unbuffered``), stderr by line."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    buffering = 0 if unbuffered else -1

    def stream(fd: int, mode: str, **text) -> io.TextIOWrapper:
        return io.TextIOWrapper(io.open(fd, mode, buffering=buffering, closefd=False),
                                encoding=encoding, write_through=unbuffered, **text)

    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False),
                                 encoding=encoding, errors=errors)
    sys.stdout = stream(1, "wb", errors=errors)
    sys.stderr = stream(2, "wb", errors="backslashreplace",
                                         line_buffering=True)


def _run_script(path: str, args: Sequence[str]) -> None:
    """Runs the file ``path`` as ``python path args`` would: a fresh ``__main__``, the script's
    directory first on ``sys.path``; an uncaught exception's traceback from the script's
    first frame, kept as ``sys.last_value``, then exit status 1."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    try:
        with io.open_code(path) as source:
            code = compile(source.read(), path, "exec")
    except OSError as exc:  # python's own words and status for a script it cannot open
        print(f"{sys.executable}: can't open file {os.path.abspath(path)!r}: "
              f"[Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        if exc.__traceback__ is not None:  # from the script's frame on, as python shows it
            exc = exc.with_traceback(exc.__traceback__.tb_next)
        # What the interpreter keeps of an unhandled exception, for the exit's handlers to
        # read (the Horovod API's tells the other ranks this one left on an error).
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


def _run_module(name: str, args: Sequence[str]) -> None:
    """Runs the module ``name`` as ``python -m name args`` would: the working directory first
    on ``sys.path``, ``sys.argv[0]`` the module's file."""
    sys.argv = [name, *args]
    sys.path[0] = os.getcwd()
    try:
        found = importlib.util.find_spec(name)
    except ImportError:
        found = None
    if found is None:
        print(f"{sys.executable}: No module named {name}", file=sys.stderr)
        raise SystemExit(1)
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str]) -> int:
    """``python -m gradsync.run.forkserver FD [MODULE ...]``: a template on the socket ``FD``
    (a ``?MODULE`` is imported where it is installed, its absence no failure)."""
    connection = socket.socket(fileno=int(argv[0]))
    request = serve(connection, argv[1:])
    if request is None:
        return 0
    if "store" in request:
        keep(request)
    else:
        become(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
