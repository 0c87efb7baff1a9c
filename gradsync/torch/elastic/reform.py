"""The Horovod API's side of an elastic reset: its process sets follow the World.

``gradsync.elastic.reset`` re-forms the process's job (a new generation's World, new rank and
size). The Horovod API runs each process set on a World of its own, made from the job's, with
its own controller thread; those belong to the generation that lost a rank and cannot stop by
agreement (a member is gone). So they are abandoned first (each set's World is failed, which
ends its controller and every operation still waiting in it), then the job re-forms, then the
global set's negotiation starts again on the new World, with fresh names for unnamed calls on
every rank alike. Other sets are not re-made: their ranks changed, and as in Horovod the
script adds them again.

The abandonment is a lost peer to the members still waiting in that generation: a rank can
re-form before its peers have met the failure (rank 0 takes ``check_host_updates``'
interrupt while rank 1 still waits in an allreduce on a worker the launcher stopped), and
then its post is the generation's abort record. Each of them raises the ``PeerLostError``
that ``hvd.elastic.run`` recovers from, and re-forms too. It names no peer: the rank re-forms,
it does not exit, and the launcher must not wait for it to.
"""

from __future__ import annotations

from ... import job
from ...elastic import worker
from ...errors import PeerLostError
from .. import naming
from .. import process_sets as psets

__all__ = ["reform"]


def reform() -> None:
    """Re-forms the job and the Horovod API's global set (``hvd.elastic.run``'s reset); a
    recording timeline goes on in the same file."""
    started = bool(psets.all_controllers())
    current = job.current()  # (None when an earlier try left the old World and failed)
    who = "a rank" if current is None else f"rank {current.world.rank}"
    timeline = psets.stop(abandon=PeerLostError(
        f"{who} left generation {worker.generation()} to re-form the elastic job; "
        "operations of that generation do not run"))
    worker.reset()
    if started:
        naming.reset()
        psets.start(timeline=timeline)
