"""A replacement server joins a replicated shard and copies it while training goes on.

``gradsync run --servers S --ps-replicas R`` restarts a server rank that fails (at most
``--server-restarts`` times per rank, ``run/launcher.py``). The new process finds its rank's
address already in the store, so it knows it replaces a lost copy: it publishes its new
address and asks to join by setting ``ps/join/<server>`` to a fresh token and the newest view
it found. The shard's primary sees the request on its next beat (replication.py) and, on a
thread of its own, *brings the joiner in* (a joiner still in the view, whose earlier process
died unnoticed, is dropped from it first):

1. under the primary's update lock (pushes wait; none is lost), it connects to the joiner
   and calls ``install(phase="setup")`` with the spec: the joiner allocates its regions;
2. it writes its parameters and each optimizer state array into the joiner's regions
   (``params``, ``copy.<name>``), then ``install(phase="state")`` with the optimizer's
   scalars and the clock's snapshot: the joiner now holds exactly the primary's version;
3. it proposes the shard's next view with the joiner appended (the store's claim makes it
   the only change of that view number), adopts it, and calls ``install(phase="view")``;
   from the next update on, the joiner is a backup like any other. The view is the shard's
   once the store holds it: the joiner's beat may read it before that call arrives (the call
   then finds the joiner in it already), and the primary goes on in it whatever the call says.

The joiner serves nothing before step 3: until then its own view does not hold it, and a
push or a forwarded update gets ``{"stale": ...}``. If the primary fails between steps 2 and
3, the joiner learns the view on its own beat; if it fails before the view change, the joiner
asks again with a new token.

A request stays in the store after it was served, and a primary's memory of the requests it
served dies with it: a new primary would read the request of a joiner that has since joined
and been cut off, and bring in that old process (which no longer joins; the chaos soak saw
the join thread die of its refusal). So a request is *stale* once a view newer than the one
it names holds its server: that process joined (or a later one did), and whatever left that
view since has ended or will ask again. The primary skips a stale request, and checks again
under its update lock before it copies; a join that fails for any reason is logged, never an
uncaught error that ends the thread.

The joiner's regions are fenced from the start at the newest
view it found (``serve``) and the writes of step 2 carry the primary's view, so a primary that
the others have replaced cannot fill a joiner with its stale copy. Training pauses for the
copy only (step 1 to 3 hold the lock): a memory copy on one host, the shard's bytes over TCP
between hosts (over TCP on one host too: the joiner's regions are written through it).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

import numpy as np

from ..errors import GradsyncError
from ..transport.regions import StaleWriteError
from .replication import View, abandon, workers_done

__all__ = ["request", "requested", "bring_in", "install", "wait_joined",
           "serve_requests"]

log = logging.getLogger("gradsync.ps")

def request(store, server: int, epoch: int) -> None:
    """The joiner's request: a new token each time (a primary serves one token once) and
    ``epoch``, the newest view the joiner found (what makes an old request stale)."""
    store.set(f"ps/join/{server}", json.dumps({"token": secrets.token_hex(8),
                                               "epoch": int(epoch)}))


def requested(store, server: int) -> dict | None:
    """Server ``server``'s request (``{"token", "epoch"}``), if any."""
    key = f"ps/join/{server}"
    return json.loads(store.get(key)) if store.check(key) else None


def stale(server, joiner: int, since: int) -> int | None:
    """(The primary.) The view after ``since`` that already held ``joiner``, which makes its
    request of view ``since`` stale; None if the request is current."""
    return server.views.held(joiner, since, server.view.epoch)


def bring_in(server, joiner: int, since: int) -> bool:
    """(The primary.) Copies the shard to ``joiner``, whose request named view ``since``, and
    adds it to the view; True if it joined. Runs on a thread of its own: the beat thread must
    keep beating meanwhile. Never raises: a join that fails is logged (the joiner asks again).
    """
    try:
        return _bring_in(server, joiner, since)
    except Exception as exc:  # the thread's last frame: nothing may end it uncaught
        log.warning("parameter server %d: server %d could not join: %s: %s", server.index,
                    joiner, type(exc).__name__, exc)
        return False


def _bring_in(server, joiner: int, since: int) -> bool:
    with server.clock.lock:
        if server.fenced or server.view.primary != server.index:
            return False
        held = stale(server, joiner, since)
        if held is not None:
            log.info("parameter server %d: server %d's join request of view %d is stale (view "
                     "%d held it since)", server.index, joiner, since, held)
            return False
        if joiner in server.view.members:
            # Its earlier process died before any update found out: that copy is gone.
            server._adopt(server.views.propose(server.view, joiner, "it restarted"))
            if server.fenced or server.view.primary != server.index:
                return False
        old = server._copies.pop(joiner, None)
        if old is not None:
            abandon(old)
        peer = None
        epoch = server.view.epoch
        try:
            addr, port = server._locate(joiner)
            peer = server.endpoint.connect(server.workers + joiner, addr, port,
                                           time.monotonic() + server.connect_timeout,
                                           f"parameter server {joiner} (rank "
                                           f"{server.workers + joiner})")
            peer.call("install", phase="setup", spec=server.spec)
            peer.refresh()
            peer.region("params").write(server.params, fence=epoch)
            state = server.optimizer.state_dict()
            scalars = {}
            for name, value in state.items():
                if isinstance(value, np.ndarray):
                    peer.region(f"copy.{name}").write(value, fence=epoch)
                else:
                    scalars[name] = value
            version = server.clock.version
            peer.call("install", phase="state", scalars=scalars,
                      clock=server.clock.snapshot())
            view = server.views.change(server.view, server.view.members + (joiner,),
                                       f"server {joiner} joined with a copy of version "
                                       f"{version}")
            if joiner not in view.members:
                server._adopt(view)  # someone else changed the view first; it asks again
                abandon(peer)
                return False
        except (GradsyncError, OSError) as exc:
            log.warning("parameter server %d: server %d could not join: %s", server.index,
                        joiner, exc)
            if peer is not None:
                abandon(peer)
            if isinstance(exc, StaleWriteError):  # the joiner knows a newer view: look
                server._adopt(server.views.newest(server.view))
            return False
        # The view is in the store: it is the shard's now, whatever the last step says (the
        # joiner may take it on its own beat first, and a joiner lost now is dropped by the
        # next forward, as any backup). A primary that went on in the view before it would
        # forward nothing to a copy the workers and the joiner count as a member.
        server._copies[joiner] = peer
        server._adopt(view)
        log.warning("shard %d: server %d joined with a copy of version %d (view %d: %s)",
                    server.shard, joiner, version, view.epoch, list(view.members))
        try:
            peer.call("install", phase="view", view=[view.epoch, list(view.members), view.why])
        except (GradsyncError, OSError, ValueError) as exc:
            log.warning("parameter server %d: server %d did not take view %d from its primary "
                        "(%s); it reads it from the store, or the next update drops it",
                        server.index, joiner, view.epoch, exc)
        return True


def install(server, peer: int, args: dict) -> dict:
    """(The joiner.) One step of ``bring_in`` from the primary (rank ``peer``)."""
    phase = args["phase"]
    if phase == "view":
        # Its own beat may have taken this view from the store first (``Server.look``).
        epoch, members, why = args["view"]
        server.accept(View(server.shard, int(epoch), tuple(members), why))
        if server.joining or server.view.epoch < int(epoch):
            raise ValueError(f"parameter server {server.index} is not in view {epoch} of "
                             f"shard {server.shard} (rank {peer} tried to install it)")
        return {}
    if not server.joining:
        raise ValueError(f"parameter server {server.index} is not joining (rank {peer} "
                         f"tried to install a copy)")
    if phase == "setup":
        if server.spec is None:
            try:
                server._setup(args["spec"])
                for name, value in server.optimizer.state_dict().items():
                    if isinstance(value, np.ndarray):
                        server.endpoint.allocate(f"copy.{name}", value.shape, value.dtype,
                                                 fenced=True)
            except Exception as exc:
                # Half set up, and its listener will not admit this primary again: end this
                # process (wait_joined raises) so that the launcher starts a fresh one.
                server.join_error = exc
                server.joined.set()
                raise
        return {}
    if phase == "state":
        state = dict(args["scalars"])
        for name, value in server.optimizer.state_dict().items():
            if isinstance(value, np.ndarray):
                state[name] = server.endpoint.region(f"copy.{name}").array.copy()
        with server.clock.lock:
            server.optimizer.load_state_dict(state)
            server.clock.install(args["clock"])
            server.meta[0] = server.clock.version
            server.installed = True
        return {}
    raise ValueError(f"unknown install phase {phase!r}")


def wait_joined(server, store, workers: int, timeout: float) -> bool:
    """(The joiner.) Asks to join and waits until a view holds it; False if the workers
    finished first (nothing left to serve). Asks again every few seconds."""
    end = time.monotonic() + timeout
    while not server.joined.wait(0) or server.join_error is not None:
        if server.join_error is not None:
            raise GradsyncError(f"parameter server {server.index}: could not set up a copy of "
                                f"shard {server.shard}: {type(server.join_error).__name__}: "
                                f"{server.join_error}")
        if workers_done(store, workers):
            return False
        # The newest view now, not the one found at the start: an earlier process of this
        # server that died unnoticed may stay in a view or two after it (another member was
        # dropped first), and a request naming a view older than those would look stale.
        request(store, server.index, server.views.newest(server.view).epoch)
        server.joined.wait(min(3.0, max(0.0, end - time.monotonic())))
        if time.monotonic() > end and not server.joined.is_set():
            raise GradsyncError(f"parameter server {server.index}: no primary of shard "
                                f"{server.shard} brought it in within {timeout:.0f}s")
    return True


def serve_requests(server, store, handled: dict) -> None:
    """(The primary's beat.) Starts ``bring_in`` for each new join request of its shard."""
    if server.clock is None or server.fenced or server.view.primary != server.index:
        return
    for b in server.views.first.members:
        if b in server.view.members:
            continue
        asked = requested(store, b)
        if asked is None or handled.get(b) == asked["token"]:
            continue
        handled[b] = asked["token"]
        if stale(server, b, asked["epoch"]) is not None:
            continue  # served before (maybe by an earlier primary): that process joined
        threading.Thread(target=bring_in, args=(server, b, asked["epoch"]), daemon=True,
                         name=f"gradsync-ps-join{b}").start()

