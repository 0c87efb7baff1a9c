"""Process sets: groups of ranks that run Horovod-API operations among themselves.

Every process set, the global one included, runs on a World of its own (``World.subworld``):
its own connections (shared memory inside a host, TCP between hosts), its own sequence
numbers and its own ``negotiation.Controller`` thread. So sets run concurrently, an operation
of one set never waits behind another set's, and the global set's operations never wait on a
set's (Horovod 0.28.1 can hang when a global operation is issued around a set's). The numpy
API (``gradsync.allreduce``) keeps the job's own World, beside all of these.

Lifecycle, as in Horovod: ``hvd.init(process_sets=[...])`` or ``add_process_set(ranks)`` (every
rank of the job calls it, in the same order; only the set's members connect) gives the set the
next id; ``remove_process_set`` (every rank again) stops its controller once every member has
asked and closes its World. The global set has id 0 and lives from ``init`` to ``shutdown``.

Store connections: all the sets of a process share one client of the store (``_Registry``),
whatever their number. A set *meets* (its barrier, which blocks in the store until every
member arrives) over a client of its own, closed once it has met: a blocking wait on a
shared TCPStore client holds its only connection, and would hold up every other set's
request meanwhile (a failure posted by a running set's thread while a new set waits for its
members). After that a set's World asks only what the store answers at once (its abort
record, a goodbye), and its record is kept by the root World's bell (``abort_watch.py``), so
with K sets a process holds 4 store connections, not 2 + 2K.
"""

from __future__ import annotations

import itertools
import threading
from typing import Sequence

from .. import api as gs
from .. import job
from ..errors import GradsyncError
from ..liveness.pace import meter
from ..pipeline.negotiation import Controller
from . import naming

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "controller", "is_member", "start", "stop", "set_timeline", "all_controllers"]


class ProcessSet:
    """A set of ranks that runs collectives among themselves, as in Horovod.

    Args:
        ranks: the global ranks of the set.

    ``process_set_id`` is None until ``hvd.init(process_sets=...)`` or ``add_process_set``
    registers the set, and again after ``remove_process_set``.
    """

    process_set_id: int | None = None
    ranks: list[int]
    mpi_comm = None

    def __init__(self, ranks: Sequence[int]):
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks (gradsync has no MPI "
                             "communicators)") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self.ranks = ranks

    def size(self) -> int | None:
        """The number of ranks in the set, or None if it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's index in the set (None if not registered); a ValueError if not in it."""
        if self.process_set_id is None:
            return None
        if gs.rank() not in self.ranks:
            raise ValueError(f"rank {gs.rank()} is not in {self}")
        return self.ranks.index(gs.rank())

    def included(self) -> bool | None:
        """Whether this rank belongs to the set (None if the ranks are not known)."""
        return None if self.ranks is None else gs.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


_ABANDON_JOIN_S = 5.0  # how long an abandoned controller's thread gets to see its World failed

global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Registry:
    """The process sets of this incarnation of the job (one per ``init``)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.sets: dict[int, ProcessSet] = {}
        self.controllers: dict[int, Controller] = {}
        self.worlds: dict[int, object] = {}
        self.ids = itertools.count(1)
        self.timeline = None
        self.client = None  # the store client the sets share once met (module docstring)


_reg: _Registry | None = None


def _registry() -> _Registry:
    if _reg is None:
        raise ValueError("gradsync.torch has not been initialised: call hvd.init() first")
    return _reg


def _connect(pid: int, ranks: list[int], label: str) -> Controller:
    world, reg = job.world(), _registry()
    name = f"hvd{pid}"  # ids are never reused within one init, so names are unique
    if reg.client is None:
        reg.client = _clone(world.store.base)
    sub = world.subworld(ranks, name, base=_clone(world.store.base))
    sub.store.move_to(reg.client)  # the meeting's client closes with its last reference
    ctl = Controller(sub, label, ranks, world.config.fusion_threshold, reg.timeline)
    ctl.owned_world = sub
    ctl.on_stand_in = lambda name: naming.skip(name, pid)
    return ctl


def _clone(store):
    """A new client of ``store`` (torch's ``Store.clone``), or ``store`` if it cannot."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def start(process_sets: Sequence[ProcessSet] | None = None, timeline=None) -> None:
    """Connects the global set's World and registers ``process_sets`` (from ``init``);
    ``timeline`` carries a recording timeline over an elastic reset (``stop(abandon=True)``)."""
    global _reg
    if _reg is not None:
        return
    _reg = _Registry()
    _reg.timeline = meter.timeline = timeline
    n = gs.size()
    global_process_set.ranks = list(range(n))
    global_process_set.process_set_id = 0
    _reg.sets[0] = global_process_set
    _reg.controllers[0] = _connect(0, list(range(n)), "global")
    for ps in process_sets or ():
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        if ps.ranks == list(range(n)):
            ps.process_set_id = 0  # the global set under another name, as in Horovod
            continue
        add_process_set(ps)


def stop(abandon: "GradsyncError | None" = None):
    """Stops every controller and closes the sets' Worlds (from ``shutdown``).

    The stop is itself negotiated: it ends once every member has asked. ``abandon`` is for
    when that cannot happen: an elastic reset (the generation lost a rank) or a script leaving
    on an unhandled exception while the others go on. Each set's World is then failed with
    ``abandon`` (what the other members raise), which ends its controller and every operation
    still waiting in it. Sets other than the global one are invalidated (a new generation has
    new ranks: add them again, as in Horovod). Returns the timeline, left open for the next
    generation, if abandoning.
    """
    global _reg
    reg, _reg = _reg, None
    if reg is None:
        return None
    for pid in sorted(reg.controllers, reverse=True):
        ctl = reg.controllers[pid]
        try:
            if abandon is not None:
                ctl.world.fail(abandon)
                ctl.stop(timeout=_ABANDON_JOIN_S)
            elif ctl.world.failure is None:
                ctl.stop()
        finally:
            if ctl.owned_world is not None:  # a set's controller owns its sub-world
                ctl.owned_world.close()
    for pid, ps in reg.sets.items():
        if pid:
            ps._invalidate()
    if abandon is not None:
        return reg.timeline
    meter.timeline = None
    if reg.timeline is not None:
        reg.timeline.close()
    return None


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a new process set while the job runs; every rank must call it, in the same
    order. Returns the set, with its ``process_set_id``.

    Raises:
        ValueError: a set with these ranks exists, or a rank is outside the job.
    """
    reg = _registry()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    n = gs.size()
    if not process_set.ranks or any(not 0 <= r < n for r in process_set.ranks):
        raise ValueError(f"a process set needs ranks in 0..{n - 1}, got {process_set.ranks}")
    with reg.lock:
        for existing in reg.sets.values():
            if existing.ranks == process_set.ranks:
                raise ValueError(f"Attempted to add a duplicate process set: {process_set} "
                                 f"(as {existing})")
        pid = next(reg.ids)
        if gs.rank() in process_set.ranks:
            reg.controllers[pid] = _connect(pid, process_set.ranks, f"process set {pid}")
        process_set.process_set_id = pid
        reg.sets[pid] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a set added by ``add_process_set`` or ``init``; every rank must call it.

    Returns:
        True if the set was removed; False for the global set or an unregistered one.
    """
    reg = _registry()
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in reg.sets:
        return False
    with reg.lock:
        del reg.sets[pid]
        ctl = reg.controllers.pop(pid, None)
    process_set._invalidate()
    if ctl is not None:
        try:
            if ctl.world.failure is None:
                ctl.stop()
        finally:
            if ctl.owned_world is not None:  # a set's controller owns its sub-world
                ctl.owned_world.close()
    return True


def controller(process_set: ProcessSet) -> Controller:
    """The controller that runs ``process_set``'s operations on this rank.

    Raises:
        ValueError: the set is not registered, or this rank is not one of its members.
    """
    reg = _registry()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {process_set!r}")
    pid = process_set.process_set_id
    ctl = reg.controllers.get(pid) if pid is not None else None
    if ctl is None:
        if pid is None or pid not in reg.sets:
            raise ValueError(f"{process_set} is not registered: pass it to hvd.init("
                             "process_sets=...) or hvd.add_process_set() first")
        raise ValueError(f"rank {gs.rank()} is not a member of {process_set}; only its ranks "
                         f"{process_set.ranks} may issue its operations")
    return ctl


def is_member(process_set: ProcessSet) -> bool:
    """Whether this rank belongs to ``process_set``.

    Raises:
        ValueError: the set is not registered.
    """
    reg = _registry()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {process_set!r}")
    pid = process_set.process_set_id
    if pid is None or pid not in reg.sets:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init("
                         "process_sets=...) or hvd.add_process_set() first")
    return pid in reg.controllers


def all_controllers() -> list[Controller]:
    reg = _reg
    return [] if reg is None else list(reg.controllers.values())


def set_timeline(timeline) -> None:
    """Makes every controller (and those made later) record into ``timeline`` (or stop)."""
    reg = _registry()
    with reg.lock:
        old, reg.timeline = reg.timeline, timeline
        for ctl in reg.controllers.values():
            ctl.timeline = timeline
    meter.timeline = timeline  # steps and stragglers are marked in it too (pace.py)
    if old is not None and old is not timeline:
        old.close()
