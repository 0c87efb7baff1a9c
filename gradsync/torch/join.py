"""``join()``: a rank that has run out of data keeps the others' allreduces going.

Horovod's semantics: after ``join()`` a rank takes part in the other ranks' allreduces with
zeros until every rank has joined; then ``join()`` returns, on every rank, the rank that joined
last. Averages still divide by the full number of ranks, joined ones included. Other
collectives (allgather, broadcast, alltoall, reducescatter, barrier) issued while a rank is
joined raise RuntimeError on the ranks that issued them.

How. Operations of the Horovod API are negotiated by name (``gradsync/pipeline/negotiation.py``), so
a joined rank does not need to know what the others will issue: ``join()`` announces the
operation ``join`` to the global set's controller, and from then on the controller treats an
operation as ready once every rank that has *not* joined announced it, and runs a zero
allreduce in this rank's place. DistributedOptimizer's gradient buckets go through the same
controller, so any number of optimizer steps, with any ``backward_passes_per_step``, work
while a rank is joined. ``join`` completes when every rank has announced it; the last of them
in the agreed order is the rank returned.
"""

from __future__ import annotations

from . import process_sets as _psets
from .optimizer import live_optimizers

__all__ = ["join"]


def join(device: int = -1) -> int:
    """Marks this rank as out of data; returns the last rank to join, once every rank has.

    Until every rank has joined, this rank contributes zeros to the others' allreduces
    (DistributedOptimizer's included). Its own model is not updated meanwhile: broadcast the
    parameters from the returned rank afterwards
    (``broadcast_parameters(model.state_dict(), root_rank=last)``).

    Args:
        device: Horovod's device for the zero tensors (-1: CPU). gradsync's tensors are all on
            the CPU, so any device id is accepted and the zeros are CPU arrays, as in a Horovod
            build without GPU support (scripts pass ``hvd.local_rank()`` here).

    Raises:
        TypeError: ``device`` is not an integer.
        RuntimeError: called between backward() and step().
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) takes an integer device id, got {device!r}")
    for optimizer in live_optimizers():
        optimizer._gs_require_idle("join")
    return _psets.controller(_psets.global_process_set).announce_join().wait()
