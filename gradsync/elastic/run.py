"""The elastic training loop: run, and after a failure roll back, re-form and go on.

``run_fn(func, reset)`` wraps a training function ``func(state, ...)``:

1. ``state.sync()``: every rank takes rank 0's committed state (new workers get the
   parameters, optimizer state, epoch and sampler position of the job).
2. ``func(state)`` runs. If it returns, that is the result.
3. A lost peer (``PeerLostError``, or a ``GradsyncTimeoutError``) rolls the state back to the
   last commit (``state.restore()``); a ``HostsUpdatedInterrupt`` (raised by every rank at the
   same ``commit()``) does not, as the commit just happened.
4. ``reset()`` re-forms the world in place (the next generation: new rank and size), then
   ``state.on_reset()`` runs the state's own reset and the user's callbacks, and the loop goes
   back to 1.

Outside an elastic job a lost peer is re-raised (fail-fast), as without the wrapper. A failure
inside ``sync()`` or ``on_reset()`` is a failure like any other: it loops again. How many
resets a job may take is the launcher's ``--reset-limit``.

Before ``func``, a script must not run collectives other than those every generation runs in
the same order (``init()``, building the DistributedOptimizer): a new worker's first
collective meets the survivors' ``sync()``.
"""

from __future__ import annotations

import functools
import logging

from ..errors import GradsyncTimeoutError, PeerLostError
from . import worker
from .state import HostsUpdatedInterrupt

__all__ = ["run_fn", "RECOVERABLE"]

log = logging.getLogger("gradsync")

RECOVERABLE = (PeerLostError, GradsyncTimeoutError)
"""Errors after which an elastic job rolls back and re-forms instead of failing."""


def run_fn(func, reset):
    """Wraps ``func(state, *args, **kwargs)`` in the elastic loop; ``reset()`` re-forms."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        sync = True
        while True:
            try:
                if sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except RECOVERABLE as exc:
                if not worker.is_elastic():
                    raise
                log.warning("generation %d lost a worker (%s); rolling back to the last "
                            "commit", worker.generation(), exc)
                state.restore()
                sync = True
            except HostsUpdatedInterrupt as exc:
                sync = not exc.skip_sync
            _reset_until_formed(state, reset)

    return wrapper


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
