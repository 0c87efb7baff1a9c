"""Elastic state: what a worker commits in memory and restores after a failure.

Horovod's model (``hvd.elastic``), for any framework: a ``State`` is saved by ``commit()``
(a copy in host memory), rolled back by ``restore()`` after a failure (every change since the
last commit is undone), and made equal on every rank by ``sync()`` (a broadcast from rank 0,
which after a re-formation is the lowest surviving rank). ``commit()`` also runs
``check_host_updates()``: rank 0 looks whether the launcher has formed a newer generation
(new hosts, or a lost worker) and broadcasts the answer, so that every rank raises
``HostsUpdatedInterrupt`` at the same commit, never some ranks only.

Outside an elastic job (no ``gradsync run --min-np/--max-np``) the same code runs: commits are
local copies, ``check_host_updates`` is free (no broadcast: every rank knows it is not
elastic), and a lost peer ends the job as usual.

A value that a deep copy cannot commit (it holds connections, its position is the job's and
not the process's) may bring its own *handler*: an object with a method ``elastic_handler()``
given to an ``ObjectState`` (or a ``TorchState``) is kept as it is, and the handler it returns
takes part in every step: ``save()`` at a commit (on every rank: it may be a collective),
``restore()`` on survivors before a roll-back, ``sync()`` to take rank 0's saved state,
``sync_from(root)`` to take the live state of a recovery's root (both on every member of the
new generation, in the same order). ``gradsync.data.Loader`` is such a value
(``gradsync/data/elastic.py``): its position in the epoch commits and rolls back with the model.
A handler may also have ``at_update()``: a state that counts optimizer updates (``TorchState``)
calls it after each one is applied, so that the handler knows the point a redone step starts
from (a compressor's residuals, ``gradsync/compress/elastic.py``).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

from ..liveness.straggler_watch import on_report
from . import worker

__all__ = ["State", "ObjectState", "HostsUpdatedInterrupt"]


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit()``/``check_host_updates()`` on every rank at once when the launcher
    has formed a new generation; ``hvd.elastic.run`` catches it and re-forms the world without
    rolling back.

    Attributes:
        skip_sync: True when the state need not be broadcast after the reset (Horovod's flag;
            gradsync always syncs, since new workers may have joined).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the elastic job has a new generation of workers")
        self.skip_sync = skip_sync


class State:
    """Base of elastic state objects.

    Args:
        bcast_object: ``bcast_object(obj, root_rank=0, name=...)`` returns rank 0's ``obj``.
        get_rank: returns this process's rank.

    Attributes:
        rollback: ``"auto"`` (default): after a failure inside a step's gradient exchange the
            survivors go on from their live state and redo that step; other failures roll
            back to the last commit. ``"always"``: every failure rolls back to the last
            commit, as in Horovod. (``gradsync/elastic/recovery.py`` has the rule.)
        last_recovery: the latest ``recovery.Recovery`` of this process (None before one).
    """

    rollback = "auto"

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._straggler_callbacks: list[Callable[[Any], None]] = []
        self.last_recovery = None

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Adds functions called after every re-formation, before the state is synced (e.g.
        to scale the learning rate with the new ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def register_straggler_callbacks(self, callbacks: list[Callable[[Any], None]]) -> None:
        """Adds functions called with each new straggler report (what ``gradsync.stragglers()``
        returns: the ranks named, their hosts, where their steps go), on this rank's training
        thread at its first step after the report came (docs/troubleshooting.md,
        "Stragglers"): e.g. to leave the slow host out of what the discovery script prints,
        so that the next generation runs without it. Ranks get a report at different steps:
        a callback must not issue collectives."""
        if not self._straggler_callbacks:
            me = weakref.ref(self)  # the process-wide registration must not keep a State alive

            def deliver(report) -> None:
                state = me()
                for callback in [] if state is None else state._straggler_callbacks:
                    callback(report)

            on_report(deliver)
        self._straggler_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state in memory, then checks for new hosts (may raise
        HostsUpdatedInterrupt). Costs a copy of the state: commit every few batches."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when the launcher has formed a newer
        generation of the job. One small broadcast in an elastic job; free outside one."""
        if not worker.is_elastic():
            return
        newer = worker.newer_generation() if self._rank() == 0 else None
        if self._bcast_object(newer, root_rank=0, name="elastic.check_host_updates"):
            raise HostsUpdatedInterrupt()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Adapts to the new world after a re-formation (before ``sync``)."""

    # The recovery protocol (recovery.py). A state that does not count its updates (this
    # base, ObjectState) always rolls back after a failure.
    def applied_updates(self) -> int | None:
        """Optimizer updates applied to the live state; None: not counted."""
        return None

    def saved_updates(self) -> int | None:
        """Updates of the last ``save()``; None: not counted."""
        return None

    def resumable(self) -> bool:
        """Whether the failure just caught left the live state at a resume point (asked by
        ``hvd.elastic.run`` before anything else runs)."""
        return False

    def sync_from(self, root_rank: int) -> None:
        """Makes every rank's live state ``root_rank``'s live state, leaving the saved state
        alone."""
        raise NotImplementedError

    def adopt_updates(self, updates: int | None) -> None:
        """Takes the update count of the state just synced to (None: keeps its own)."""


class ObjectState(State):
    """State made of plain Python values, given as keyword arguments and kept as attributes.

    ``state.epoch = 3`` changes the live value; ``commit()`` saves a deep copy of every
    attribute; ``restore()`` puts the saved copies back; ``sync()`` broadcasts rank 0's saved
    values. A value with an ``elastic_handler()`` (a ``gradsync.data.Loader``) is not copied:
    its handler does each of these (module docstring), after the plain values.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs):
        handled = {name: value for name, value in kwargs.items()
                   if callable(getattr(value, "elastic_handler", None))}
        self._value_handlers = {name: value.elastic_handler() for name, value in handled.items()}
        self._saved_state = copy.deepcopy({name: value for name, value in kwargs.items()
                                           if name not in handled})
        self._set_attrs()
        for name, value in handled.items():
            setattr(self, name, value)
        super().__init__(bcast_object, get_rank)
        for handler in self._value_handlers.values():
            # A handler that moves its value with a broadcast uses this state's own.
            if callable(getattr(handler, "bind_broadcast", None)):
                handler.bind_broadcast(bcast_object)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}
        for handler in self._value_handlers.values():
            handler.save()

    def restore(self) -> None:
        self._set_attrs()
        for handler in self._value_handlers.values():
            handler.restore()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank=0,
                                                   name="elastic.object_state")
            self._set_attrs()
        for handler in self._value_handlers.values():
            handler.sync()

    def sync_from(self, root_rank: int) -> None:
        # The live values, not the saved ones: a failure in the middle of this broadcast must
        # leave every rank's saved state as it was, the point a roll-back returns to.
        if self._saved_state:
            live = {name: getattr(self, name) for name in self._saved_state}
            live = self._bcast_object(live, root_rank=root_rank, name="elastic.object_live")
            for name, value in live.items():
                setattr(self, name, value)
        for handler in self._value_handlers.values():
            handler.sync_from(root_rank)

    def _values_at_update(self) -> None:
        """Tells the value handlers that ask (``at_update``) that an optimizer update was
        applied (the module docstring)."""
        for handler in self._value_handlers.values():
            at_update = getattr(handler, "at_update", None)
            if callable(at_update):
                at_update()

    def _values_resumable(self) -> bool:
        """Whether every value handler that can tell (``resumable()``) says its live state
        is a resume point (a Loader that lost a data server does not)."""
        return all(h.resumable() for h in self._value_handlers.values()
                   if callable(getattr(h, "resumable", None)))

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
