"""The Horovod API's side of an elastic reset: its process sets follow the World.

``gradsync.elastic.reset`` re-forms the process's job (a new generation's World, new rank and
size). The Horovod API runs each process set on a World of its own, made from the job's, with
its own controller thread; those belong to the generation that lost a rank and cannot stop by
agreement (a member is gone). So they are abandoned first (each set's World is failed, which
ends its controller and every operation still waiting in it), then the job re-forms, then the
global set's negotiation starts again on the new World, with fresh names for unnamed calls on
every rank alike. Other sets are not re-made: their ranks changed, and as in Horovod the
script adds them again.
"""

from __future__ import annotations

from ...elastic import worker
from ...errors import GradsyncError
from .. import naming
from .. import process_sets as psets

__all__ = ["reform"]


def reform() -> None:
    """Re-forms the job and the Horovod API's global set (``hvd.elastic.run``'s reset); a
    recording timeline goes on in the same file."""
    started = bool(psets.all_controllers())
    timeline = psets.stop(abandon=GradsyncError(
        "the elastic job re-forms after a lost rank; operations of the previous generation "
        "do not run"))
    worker.reset()
    if started:
        naming.reset()
        psets.start(timeline=timeline)
