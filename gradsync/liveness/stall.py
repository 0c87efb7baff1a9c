"""Stall reports: a collective that waits too long names the ranks it waits for, and shows them.

A rank stuck in user code (a deadlock, an endless loop, a blocked read) while its peers wait
in a collective is otherwise reported only when the collective's ``timeout`` (300 s) fires,
as a timeout, without the stuck rank's stack. Here, once a collective has waited
``stall_report`` seconds (30 by default), every waiting rank reports once, long before the
timeout, with a WARNING of the ``gradsync`` logger that says:

- which ranks have not arrived in the collective;
- what each of them is doing: its Python stacks, taken by that process itself
  (``sys._current_frames``, as faulthandler or py-spy would show them);
- the last operation each one completed, from its flight recorder (``flight_recorder.py``).

Who has arrived. Every rank of a World numbers its collectives alike (``Comm.seq``, one per
``begin``, whatever the front door), so a rank has arrived in collective #s when its number
is s or more. The waiting rank asks each rank of the World for its number; that is the one
source that is exact for every algorithm (in a ring a rank waits only for its neighbour, which
may itself wait for the stuck one) and costs nothing until a stall.

How a rank is asked. Each process already listens for its peers' connections (one listener per
process, ``transport/tcp.py``); every root World adds a *route* for its job id plus
``/stall`` to it (``serve``), so a waiting rank dials a peer, proves the job's secret as any
pair does, sends the question (which World, which collective) and reads the answer. The
answer is made on the listener's handshake thread of the asked process: a Python thread,
which runs while the process's main thread sleeps (``time.sleep`` releases the GIL), loops
in Python (the GIL changes hands every 5 ms) or waits in C code that releases it. A process
whose C code holds the GIL, or that is stopped, does not answer within ``ASK_S`` seconds and
is reported so. No store request, no thread and no cost at all until a stall; during one,
each waiting rank makes one connection per peer.

Once per stall: a World reports each collective number at most once (``watch``), on a thread
of its own, so the wait itself goes on (and raises at its deadline as before).

One survey per stall, not one per waiting rank. Every waiting rank asking every other rank
would cost N² connections when one rank of N is stuck. So the waiting ranks draw lots in the
World's store (one ``add`` each, on a key of the collective): the first surveys the ranks and
posts its report in the store; the others read it there (a few ``check``s each, spaced out
to 2 s, then one ``get``) and log it, saying whose survey it is. A rank that finds no report
within ``2 * ASK_S`` seconds, or no store, surveys itself. The reads look (``check``) rather
than block: a thread blocked in the store's C++ client when the process exits aborts it
(``abort_watch.py`` says why), and a stall often ends, and the job with it, seconds later.

The Horovod API. Its operations are matched by name, and its background loop keeps the
World's collectives going while a rank sleeps, so no wait of the World stalls. There, each
rank's loop looks at its own requests (``watch_named``): one issued more than ``stall_report``
seconds ago gets a report, once per name, and a rank has arrived when it has issued that
name too (``Controller.issued``). Rank 0's Horovod-style warning (``stall_warning``) stays.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Protocol

from ..errors import GradsyncError
from ..flight_recorder import COMPLETED, FAILED, SCHEDULED, STARTED, recorder
from ..transport import tcp

if TYPE_CHECKING:
    from ..transport.comm import Comm

__all__ = ["serve", "watch", "answer", "ROUTE", "ASK_S"]

log = logging.getLogger("gradsync")

ROUTE = "/stall"
"""Suffix of a root World's job id that names its stall route on the process's listener."""

ASK_S = 5.0
"""Seconds a waiting rank gives a peer to connect and answer."""

_MAX_ANSWER = 1 << 20  # bytes: a question or an answer longer than this is refused
_DEPTH = 16  # innermost frames shown per thread
_ASKING = 32  # peers asked at once
_SHOWN = 8  # ranks shown in full, of those not arrived and of the others; the rest listed


# What ``answer`` reads of a World and of a Horovod API loop. Both live on floors above this
# one (``connect/world.py``, ``pipeline/negotiation.py``), which this module must not import,
# even for its types: so it names what it uses of them.
class _Asked(Protocol):
    comm: Comm


class _Named(Protocol):
    def issued(self, name: str) -> bool: ...


_worlds: "weakref.WeakValueDictionary[str, _Asked]" = weakref.WeakValueDictionary()
_reported: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_controllers: "weakref.WeakValueDictionary[str, _Named]" = weakref.WeakValueDictionary()
_named: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_LEN = struct.Struct(">I")
# gradsync's own service threads, idle in their loops whatever the rank does: not shown (the
# threads that run the user's operations, the progress thread and the lanes, are).
_QUIET = ("gradsync-abort-watch", "gradsync-heartbeat", "gradsync-listener",
          "gradsync-handshake", "gradsync-stall", "gradsync-pulse", "gradsync-pace")


def serve(world, root: bool) -> None:
    """Lets the ranks of ``world`` ask this process about it; for a root World (``root``:
    the World owns its listener), opens the stall route on the process's listener."""
    _worlds[world.env.job_id] = world
    if not root or world.size == 1:
        return
    holder: list = []

    def on_accept(peer: int, sock: socket.socket) -> None:
        try:
            _answer_on(sock)
        finally:
            # The route admits one connection per peer until its slot is free again: a peer
            # asks again at its next stall.
            holder[0].slots.pop(peer, None)

    holder.append(world.listener.route(world.env.job_id + ROUTE, world.rank,
                                       set(range(world.size)) - {world.rank}, on_accept))


def serve_named(world, controller) -> None:
    """Lets the ranks ask this process about the Horovod API's operations on ``world``."""
    _controllers[world.env.job_id] = controller


def watch_named(controller) -> None:
    """Called by a Horovod API loop (``Controller``): reports each of its requests that has
    waited ``stall_report`` seconds, once per name."""
    world = controller.world
    threshold = world.config.stall_report
    if not threshold:
        return
    now = time.monotonic_ns()  # the records' clock
    # name -> (when the request reported was issued, how many of that name were reported): a
    # name is reported once per request, and its count tells its stalls apart in the store.
    reported = _named.setdefault(controller, {})
    for name, issued in controller.waiting():
        waited = (now - issued) / 1e9
        last, count = reported.get(name, (None, 0))
        if waited >= threshold and last != issued:
            reported[name] = (issued, count + 1)
            threading.Thread(target=_report, args=(world, 0, f"Horovod API operation '{name}' "
                             f"({controller.label})", waited, name, f"op/{name}/{count + 1}"),
                             name="gradsync-stall-report", daemon=True).start()


def watch(world, waited: float) -> None:
    """Called by a World's waits (``World.on_idle``): past ``stall_report`` seconds, starts
    this collective's report, once."""
    threshold = world.config.stall_report
    if not threshold or waited < threshold or world.size == 1:
        return
    seq = world.comm.seq
    if _reported.get(world) == seq:
        return
    _reported[world] = seq
    threading.Thread(target=_report, args=(world, seq, world.comm.description, waited, None,
                                           f"seq/{seq}"),
                     name="gradsync-stall-report", daemon=True).start()


def answer(job: str, seq: int, name: "str | None" = None) -> dict:
    """What this process says when asked about collective ``seq`` of the World ``job``, or,
    given ``name``, about that Horovod API operation there."""
    world = _worlds.get(job)
    controller = _controllers.get(job) if name is not None else None
    held = recorder.records()
    last = next((rec for rec in reversed(held) if rec.state == COMPLETED), None)
    running = [rec.words() for rec in held if rec.state in (SCHEDULED, STARTED)][-4:]
    failed = [rec.words() for rec in held if rec.state == FAILED][-1:]
    return {
        "rank": recorder.rank, "host": socket.gethostname(), "pid": os.getpid(),
        "seq": None if world is None else world.comm.seq,
        "in": None if world is None else world.comm.description,
        "last": None if last is None else last.words(), "running": running, "failed": failed,
        "stacks": _stacks(),
        # (a controller is looked up only for a name, but the type checker cannot see that)
        "issued": None if controller is None or name is None else controller.issued(name),
    }


def _stacks() -> str:
    """Every thread's Python stack but the caller's, the main thread first."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    shown = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        name = names.get(ident, str(ident))
        if ident == me or name.startswith(_QUIET):
            continue
        lines = traceback.format_stack(frame)[-_DEPTH:]
        shown.append(f"thread {name}:\n" + "".join(lines))
    return "".join(shown)


# ------------------------------------------------------------------ the wire
def _send(sock: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _receive(sock: socket.socket) -> dict:
    head = _exact(sock, _LEN.size)
    (length,) = _LEN.unpack(head)
    if length > _MAX_ANSWER:
        raise ValueError(f"a stall message of {length} bytes (at most {_MAX_ANSWER})")
    found = json.loads(_exact(sock, length))
    if not isinstance(found, dict):
        raise ValueError("a stall message that is not an object")
    return found


def _exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _answer_on(sock: socket.socket) -> None:
    """The asked side, on the listener's handshake thread: one question, one answer."""
    try:
        sock.settimeout(ASK_S)
        question = _receive(sock)
        name = question.get("name")
        _send(sock, answer(str(question.get("job")), int(question.get("seq", 0)),
                           None if name is None else str(name)))
    except (OSError, ValueError, TypeError) as exc:
        log.debug("stall question not answered: %s", exc)
    finally:
        sock.close()


def _ask(world, member: int, seq: int, name: "str | None") -> dict:
    """Asks rank ``member`` of ``world`` about collective ``seq``; its answer, or what went
    wrong in ``error``."""
    root_job, root_ranks = world.root
    peer = world.peers[member]
    try:
        sock = tcp.connect(peer.addr, peer.port, root_ranks[world.rank], root_ranks[member],
                           world.listener.secret, root_job + ROUTE,
                           time.monotonic() + ASK_S)
        if sock is None:
            raise ConnectionError("busy")
        try:
            sock.settimeout(ASK_S)
            _send(sock, {"job": world.env.job_id, "seq": seq, "name": name})
            return _receive(sock)
        finally:
            sock.close()
    except (GradsyncError, OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "host": peer.host, "pid": peer.pid}


def _report(world, seq: int, description: str, waited: float, name: "str | None",
            key: str) -> None:
    """One waiting rank's report: the survey's, its own or another waiting rank's."""
    try:
        key = f"stall/{key}"
        try:
            first = world.store.add(key, 1) == 1
        except (GradsyncError, RuntimeError, OSError):
            first = True  # no store to share the survey through: survey alone
        text = None if first else _posted(world.store, key + "/report")
        if text is None:
            text = words(world, seq, description, waited, _survey(world, seq, name), name)
            if first:
                try:
                    world.store.set(key + "/report", text)
                except (GradsyncError, RuntimeError, OSError):
                    pass
        else:
            me = world.root[1][world.rank]
            text = f"{text}\n  (rank {me} waits in it too; the survey above is another rank's)"
        log.warning("%s", text)
    except Exception as exc:  # noqa: BLE001  (a report must never end the rank)
        log.warning("rank %d: the stall report of collective #%d failed: %s", world.rank, seq,
                    exc)


def _survey(world, seq: int, name: "str | None") -> dict:
    """Every other rank's answer (``answer``), asked at once."""
    members = [r for r in range(world.size) if r != world.rank]
    with concurrent.futures.ThreadPoolExecutor(min(_ASKING, len(members)),
                                               thread_name_prefix="gradsync-stall") as pool:
        return dict(zip(members, pool.map(lambda r: _ask(world, r, seq, name), members)))


def _posted(store, key: str) -> "str | None":
    """The report another rank posted at ``key``, looked for until ``2 * ASK_S`` seconds have
    passed (looks spaced from 0.1 s to 2 s); None if it did not come."""
    deadline = time.monotonic() + 2 * ASK_S
    pause = 0.1
    try:
        while True:
            if store.check(key):
                return store.get(key).decode()
            if time.monotonic() + pause > deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, 2.0)
    except (GradsyncError, RuntimeError, OSError, UnicodeDecodeError):
        return None


def words(world, seq: int, description: str, waited: float, answers: dict,
          name: "str | None" = None) -> str:
    """The report: the ranks not arrived first, with their stacks; then the others."""
    root = world.root[1]
    if name is None:
        late = [r for r, a in answers.items() if "error" in a or (a.get("seq") or 0) < seq]
        what = f"collective #{seq} {description}"
    else:
        late = [r for r, a in answers.items() if "error" in a or not a.get("issued")]
        what = description
    lines = [f"gradsync stall report: rank {root[world.rank]} has waited {waited:.1f}s in "
             f"{what}; not arrived: "
             f"{'ranks ' + str([root[r] for r in late]) if late else 'none (all are in it)'}"
             f"; it fails after {world.config.timeout:.0f}s (GRADSYNC_TIMEOUT)"]
    arrived = [r for r in answers if r not in late]
    for r in late[:_SHOWN] + arrived[:_SHOWN]:
        a = answers[r]
        head = f"rank {root[r]} on host {a.get('host')} (pid {a.get('pid')})"
        if "error" in a:
            lines.append(f"  {head}: did not answer ({a['error']}): stopped, gone, or its "
                         "C code holds the GIL")
            continue
        if name is not None:
            where = "has issued it" if a.get("issued") else "has not issued it"
        else:
            where = ("has no such World" if a.get("seq") is None else
                     f"at collective #{a['seq']} {a.get('in')}")
        lines.append(f"  {head}: {'NOT ARRIVED, ' if r in late else ''}{where}")
        lines.append(f"    last completed: {a.get('last') or 'nothing yet'}")
        for rec in a.get("running") or []:
            lines.append(f"    in flight: {rec}")
        for rec in a.get("failed") or []:
            lines.append(f"    last failed: {rec}")
        if r in late:
            lines.append("    its stacks:")
            lines.extend("      " + line for line in str(a.get("stacks", "")).splitlines())
    for rest, how in ((late[_SHOWN:], "not arrived"), (arrived[_SHOWN:], "arrived")):
        if rest:
            lines.append(f"  and {len(rest)} more {how}: ranks {[root[r] for r in rest]}")
    return "\n".join(lines)
