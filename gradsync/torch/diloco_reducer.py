"""DiLoCo's outer syncs over the Horovod API (``DiLoCo(..., comm="horovod")``).

``gradsync.compress.DiLoCo`` reduces each fragment's outer gradient through a *reducer*. Over
a torch group or any ``Comm`` it runs them on a thread of its own; over the Horovod API it
issues them as the API's asynchronous collectives on a process set, named so that every rank
agrees on them, compressed (``compressor=Int8()``) through the same bucket path as
``DistributedOptimizer``. This module is that reducer; ``gradsync.torch`` registers it under
"horovod" when imported, so the compress package below it imports no front door.
"""

from __future__ import annotations

from ..collectives.ops import ReduceOp
from ..compress.diloco import register_reducer
from . import mpi_ops, requests


class HorovodReducer:
    """Runs reductions as asynchronous collectives of the Horovod API (a process set)."""

    def __init__(self, compressor, process_set=None):
        if process_set is None:
            process_set = mpi_ops.global_process_set
        self.compressor, self.process_set = compressor, process_set

    def start(self, flat, shapes, key):
        if self.compressor is None:
            return mpi_ops.allreduce_async(flat, name=key, op=mpi_ops.Average,
                                           process_set=self.process_set)
        return requests.compressed_allreduce(
            flat, shapes, key, ReduceOp.AVERAGE, 1.0, 1.0, self.process_set, self.compressor,
            key, asynchronous=True)

    def wait(self, handle):
        return mpi_ops.synchronize(handle)


register_reducer("horovod", HorovodReducer)
