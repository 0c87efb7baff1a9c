"""The job's store keeper: the process that hosts the job's TCPStore for the launcher.

A job's ranks meet through one TCPStore (torch's), which must outlive every rank. Hosting it
in the launcher means importing torch there: about 1.4 s of CPU, and a second of wall time
before the first rank can start, since the ranks are given the store's port. Most launchers
need no client of the store themselves (the elastic policy and a replicated parameter-server
job with restarts do: those host it, ``ranks.Starter.host_store``), so a child hosts it:

- **exec'd** (``spawn``, the ``exec`` start method): the launcher binds the store's listening
  socket itself, without torch (``rendezvous.store_listener``), so the port is known at once
  and the ranks start. The keeper, ``python -m gradsync.run.keeper``, imports torch while
  the ranks import theirs, and serves the store on that socket (torch's
  ``master_listen_fd``). A rank that connects first waits in the socket's backlog.
- **forked** (``forkserver.Forkserver.keep_store``, the ``forkserver`` start method): the
  template, which has torch imported already, forks it. It binds the socket itself.

Either way the keeper says ``{"port": N}`` or ``{"error": why}`` once, on a pipe, when the
store serves or cannot (``serve``). The launcher reads that answer after starting the ranks
(``StoreKeeper.ready``): a store that cannot start ends the job with "cannot start the
rendezvous store", exit status 1, as when the launcher hosted it. The keeper also holds the
read end of a second pipe, its *lifeline*, whose write end only the launcher holds. It ends
when that pipe closes: either the launcher closes it after the ranks (``StoreKeeper.close``)
or the launcher ends in any way, SIGKILL included. The keeper then leaves with ``os._exit``,
so the store's threads are never torn down inside C++ frames (``serve_until_closed``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from .processes import Child, StartError

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["StoreKeeper", "spawn", "serve_until_closed", "READY_TIMEOUT"]

READY_TIMEOUT = 60.0
"""Seconds a keeper may take to start its store and say so (torch's import included: 1-3 s on
an idle 2-core machine, tens on a loaded one)."""

_MODULE = "gradsync.run.keeper"


class StoreKeeper:
    """The launcher's hold on the job's store keeper: the store's ``port``, the keeper's
    process, its lifeline's write end and, until ``ready`` read it, the pipe of its answer."""

    def __init__(self, process: Child, lifeline: int, port: int = 0, answer: int = -1):
        self.process, self._lifeline, self.port, self._answer = process, lifeline, port, answer
        self.serving = False
        """Whether the keeper said its store serves."""

    def answer(self, cancelled: Callable[[], bool] = lambda: False,
               timeout: float = READY_TIMEOUT) -> "dict | None":
        """The keeper's answer, read once: ``{"port": N}``, ``{"error": why}``, or ``{}`` where
        it ended or said nothing within ``timeout``; None where it was read already or
        ``cancelled()`` said to stop waiting (an interrupt: the job ends anyway)."""
        if self._answer < 0:
            return None
        fd, self._answer = self._answer, -1
        try:
            reply = _read_answer(fd, time.monotonic() + timeout, cancelled)
        finally:
            os.close(fd)
        self.serving = reply is not None and "port" in reply
        return reply

    def ready(self, cancelled: Callable[[], bool] = lambda: False,
              timeout: float = READY_TIMEOUT) -> None:
        """Returns once the store serves (at once where that is known already, or once
        ``cancelled()``).

        Raises:
            StartError: the store could not start, or the keeper ended or said nothing within
                ``timeout`` (status 1).
        """
        reply = self.answer(cancelled, timeout)
        if reply is None or "port" in reply:
            return
        if "error" in reply:  # ("cannot start the rendezvous store: ...", serve_until_closed)
            raise StartError(reply["error"], 1)
        try:  # a keeper that closed its pipe is ending: its status in a moment
            code: int | None = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        why = (f"the store keeper ended (exit status {code}); its output is above"
               if code is not None else f"the store keeper said nothing in {timeout:.0f} s")
        raise StartError(f"cannot start the rendezvous store: {why}", 1)

    def close(self) -> None:
        """Ends the store: closes the lifeline and waits for the keeper (SIGKILL after 5 s, or
        at once where its store never said it serves: nothing can depend on it)."""
        if self._answer >= 0:
            os.close(self._answer)
            self._answer = -1
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if not self.serving and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _read_answer(fd: int, deadline: float, cancelled: Callable[[], bool]) -> "dict | None":
    """The keeper's one answer on ``fd`` ({} where it closed the pipe or said nothing by
    ``deadline``), or None once ``cancelled()``."""
    data = b""
    while time.monotonic() < deadline:
        if cancelled():
            return None
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


def spawn(store_addr: str, executable: str = sys.executable) -> StoreKeeper:
    """Starts an exec'd keeper of a store its clients reach at ``store_addr``, on a free port
    that the returned keeper's ``port`` names at once; ``StoreKeeper.ready`` says when it serves.

    Raises:
        OSError: no keeper can serve it from here (an address that is not a literal IPv4 one:
            torch then opens its own socket; the port cannot be bound; no process can start).
            The launcher then hosts the store itself.
    """
    from ..cluster.rendezvous import store_listener

    listener = store_listener(store_addr, 0)
    if listener is None:
        raise OSError(f"the keeper serves stores reached at IPv4 addresses, not {store_addr!r}")
    said_read, said_write = os.pipe()
    life_read, life_write = os.pipe()
    try:
        port = listener.getsockname()[1]
        fds = (listener.fileno(), said_write, life_read)
        process = subprocess.Popen(
            [executable, "-m", _MODULE, *map(str, fds), str(port)], env=_env(),
            stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), pass_fds=fds,
            start_new_session=True)
    except BaseException:
        os.close(said_read)
        os.close(life_write)
        raise
    finally:  # the keeper's ends: only it holds them now
        listener.close()
        os.close(said_write)
        os.close(life_read)
    return StoreKeeper(process, life_write, port, said_read)


def _env() -> dict[str, str]:
    """The launcher's environment, with the folder this gradsync was imported from first on
    ``PYTHONPATH``: a launcher called from a program that found gradsync on a path of its own
    (``sys.path`` changed in the program) still starts a keeper that finds the same one."""
    env = dict(os.environ)
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([home, *filter(None, [env.get("PYTHONPATH")])])
    return env


def serve_until_closed(start: "Callable[[], TCPStore]", said: int, lifeline: int) -> None:
    """Makes this process the job's store keeper (module docstring): starts the store
    (``start``), writes ``{"port": N}`` or ``{"error": why}`` on ``said``, then waits for the
    ``lifeline`` to close, and leaves without the interpreter's finalization. Never returns."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends it, by the lifeline
        try:
            store = start()
            answer: dict[str, object] = {"port": store.port}
        except (RuntimeError, OSError, ImportError) as exc:
            answer = {"error": f"cannot start the rendezvous store: {exc}"}
        os.write(said, json.dumps(answer).encode())
        os.close(said)
        while "port" in answer and os.read(lifeline, 4096):
            pass
    finally:
        os._exit(0)


def main(argv: "list[str]") -> None:
    """``python -m gradsync.run.keeper LISTENER SAID LIFELINE PORT``: the exec'd keeper."""
    listener, said, lifeline, port = map(int, argv)

    def start() -> "TCPStore":
        from ..cluster.rendezvous import serve_store

        return serve_store(listener, port, "127.0.0.1", 30.0)

    serve_until_closed(start, said, lifeline)


if __name__ == "__main__":
    main(sys.argv[1:])
