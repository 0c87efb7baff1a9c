"""gradsync.torch: a drop-in for ``horovod.torch``.

Change ``import horovod.torch as hvd`` to ``import gradsync.torch as hvd`` and start the script
with ``gradsync run -np N python train.py``::

    import gradsync.torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Modules: ``mpi_ops`` (the collectives, with Horovod's signatures), ``grouped`` (grouped
allgather and reducescatter, sparse allreduce), ``build`` (``mpi_built()`` and the other build
queries), ``optimizer`` (DistributedOptimizer) over ``buckets`` (the fixed fusion buckets),
``adasum_optimizer`` (``DistributedOptimizer(op=Adasum)``), ``lag`` (its ``gradient_lag``),
``lars`` (LARS and LARC around any optimizer), ``functions``
(parameter, optimizer-state and object broadcast), ``compression``, ``sync_batch_norm``,
``join``. docs/torch.md lists what is accepted and what raises.
"""

from . import elastic
from .build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                    mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from .compression import Compression
from . import diloco_reducer  # noqa: F401  (registers DiLoCo(comm="horovod"))
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .grouped import (grouped_allgather, grouped_allgather_async, grouped_reducescatter,
                      grouped_reducescatter_async, sparse_allreduce_async)
from .join import join
from .lars import LARS
from .mpi_ops import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                      add_process_set,
                      allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, cross_rank, cross_size,
                      global_process_set, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, init, is_initialized,
                      local_rank, local_size, poll, rank, reducescatter, reducescatter_async,
                      remove_process_set, shutdown, size, start_timeline, stop_timeline,
                      synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "synchronize", "poll",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "Compression", "SyncBatchNorm", "DistributedOptimizer", "LARS",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "elastic",
    "start_timeline", "stop_timeline",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async", "HorovodInternalError",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built",
]
