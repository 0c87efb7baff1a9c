"""The elastic training loop: run, and after a failure re-form, agree on a state and go on.

``run_fn(func, reset)`` wraps a training function ``func(state, ...)``:

1. **Agree and sync.** In an elastic job every member reports where its state stands and all
   compute the same plan (``recovery.py``): at the job's start, everyone takes rank 0's
   committed state (``state.sync()``: new workers get the parameters, optimizer state, epoch
   and sampler position of the job); after a failure inside a step's gradient exchange on
   every survivor, everyone takes the most advanced survivor's *live* state and the step in
   flight is redone (``state.sync_from(root)``, then ``state.save()``); after any other
   failure, or with ``state.rollback = "always"``, the survivors restore their last commit
   (``state.restore()``) and everyone takes rank 0's (``state.sync()``). Outside an elastic
   job this step is ``state.sync()`` alone.
2. ``func(state)`` runs. If it returns, that is the result.
3. A lost peer (``PeerLostError``, or a ``GradsyncTimeoutError``) is noted with whether the
   live state is a resume point (``state.resumable()``, asked at once, before anything else
   runs); a ``HostsUpdatedInterrupt`` (raised by every rank at the same ``commit()``) leaves
   a resume point, the commit just made.
4. ``reset()`` re-forms the world in place (the next generation: new rank and size), then
   ``state.on_reset()`` runs the state's own reset and the user's callbacks, and the loop goes
   back to 1.

Outside an elastic job a lost peer is re-raised (fail-fast), as without the wrapper. A failure
inside the agreement, ``sync()`` or ``on_reset()`` is a failure like any other: it loops
again, and one inside a sync leaves no resume point (a state half broadcast), so the next
agreement rolls back. How many resets a job may take is the launcher's ``--reset-limit``.

Each recovery is logged on the ``gradsync`` logger (a WARNING, so it reaches stderr without
any logging set-up), one line per worker::

    elastic recovery: generation 1, 3 workers, go_on from update 14 (root rank 0, 0 updates
    lost); failed=1732590000.123456 formed=... resumed=...

and kept in ``state.last_recovery`` (``recovery.Recovery``).

Before ``func``, a script must not run collectives other than those every generation runs in
the same order (``init()``, building the DistributedOptimizer): a new worker's first
collective meets the survivors' agreement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

from .. import job
from ..errors import GradsyncTimeoutError, PeerLostError
from . import recovery, worker
from .state import HostsUpdatedInterrupt

__all__ = ["run_fn", "RECOVERABLE"]

log = logging.getLogger("gradsync")

RECOVERABLE = (PeerLostError, GradsyncTimeoutError)
"""Errors after which an elastic job re-forms and recovers (goes on or rolls back) instead of
failing."""


@dataclasses.dataclass
class _Failure:
    """A failure this worker survived, until the next agreement has dealt with it."""

    failed: float
    reason: str
    resumable: bool
    formed: float = 0.0


def run_fn(func, reset):
    """Wraps ``func(state, *args, **kwargs)`` in the elastic loop; ``reset()`` re-forms."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if state.rollback not in recovery.ROLLBACK_MODES:
            raise ValueError(f"state.rollback must be one of {recovery.ROLLBACK_MODES}, got "
                             f"{state.rollback!r}")
        sync, failure = True, None
        progress: dict[str, Any] = {"joined": False, "phase": "train"}
        while True:
            try:
                if sync:
                    _agree_and_sync(state, failure, progress)
                failure, progress["phase"] = None, "train"
                return func(state, *args, **kwargs)
            except RECOVERABLE as exc:
                # Asked first: anything run after this (a reset, a sync) changes the answer.
                resumable = {"train": state.resumable, "agree": lambda: True,
                             "sync": lambda: False}[progress["phase"]]()
                if not worker.is_elastic():
                    raise
                log.warning("elastic: generation %d lost a worker (%s); %s",
                            worker.generation(), exc,
                            "at a resume point" if resumable else "will roll back")
                if failure is None:
                    failure = _Failure(time.time(), str(exc), resumable)
                # A failure during the agreement changed nothing: the earlier one stands.
                failure.resumable = failure.resumable and resumable
                sync = True
            except HostsUpdatedInterrupt as exc:
                sync = not exc.skip_sync
                if failure is None:  # the commit just made is a resume point
                    failure = _Failure(time.time(), str(exc), True)
            _reset_until_formed(state, reset)
            failure.formed = time.time()

    return wrapper


def _agree_and_sync(state, failure: _Failure | None, progress: dict) -> None:
    """Step 1 of the loop (module docstring). ``failure``: the one this worker survived
    (None at its start); ``progress``: whether it has ever been synced (``joined``; a worker
    that has not holds no state of the job's) and the phase a failure would interrupt."""
    if not worker.is_elastic():
        state.sync()
        return
    survivor = failure is not None and progress["joined"]
    progress["phase"] = "agree"
    plan = recovery.agree(recovery.Report(
        survivor=survivor, live=state.applied_updates(),
        resumable=failure is not None and survivor and failure.resumable,
        saved=state.saved_updates(),
        always=state.rollback == "always"))
    progress["phase"] = "sync"
    if plan.action == "go_on":
        state.sync_from(plan.root)
        state.adopt_updates(plan.updates)
        state.save()  # the agreed state is this re-formation's commit
    else:
        if plan.action == "rollback" and survivor:
            state.restore()
        state.sync()
        state.adopt_updates(plan.updates)
    progress["joined"] = True
    if failure is not None:
        state.last_recovery = recovery.Recovery(
            generation=worker.generation(), size=job.world().size, failed=failure.failed,
            formed=failure.formed, resumed=time.time(), plan=plan, reason=failure.reason)
        _log(state.last_recovery)


def _log(rec: recovery.Recovery) -> None:
    plan = rec.plan
    where = "" if plan.updates is None else f" from update {plan.updates}"
    lost = "" if plan.lost is None else f", {plan.lost} updates lost"
    log.warning("elastic recovery: generation %d, %d workers, %s%s (root rank %d%s); "
                "failed=%.6f formed=%.6f resumed=%.6f", rec.generation, rec.size, plan.action,
                where, plan.root, lost, rec.failed, rec.formed, rec.resumed)


def _reset_until_formed(state, reset) -> None:
    """Re-forms the world and runs the state's reset; a failure meanwhile re-forms again."""
    while True:
        try:
            reset()
            state.on_reset()
            return
        except RECOVERABLE as exc:
            log.warning("generation %d failed while resetting (%s); trying the next",
                        worker.generation(), exc)
