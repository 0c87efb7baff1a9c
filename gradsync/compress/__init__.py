"""Gradient compressors that own their reduction, with error feedback, for CPU tensors.

A cast (``gradsync.torch.Compression.fp16``) can be applied around a plain allreduce; these
cannot: an int8 sum overflows, a low-rank factor must be orthogonalised between two
reductions, a random subset must be the same subset on every rank. So each compressor here
*is* a reduction: ``reduce(flat, shapes, comm, key, average)`` returns the sum (or average)
over ranks of what every rank sent, and keeps locally what it did not send (error feedback).

Layering (docs/slow-links.md; the design map's "bytes are the cost on slow links"): this
package sits above the collectives and below the front doors. It talks to the other ranks
only through ``comm.Comm`` (three collectives); ``comm.WorldComm`` runs them on a gradsync
World (the Horovod API: ``DistributedOptimizer(compression=...)`` and the collectives'
``compression=``), ``comm.TorchComm`` on a ``torch.distributed`` group (the DDP
communication hook, ``ddp_hook.py``: gloo, gradsync or any backend).

Modules: ``base`` (the interface), ``state`` (error-feedback residuals and the other state,
with ``state_dict``), ``quantized`` (int8, int4 and fp8), ``powersgd``, ``randomk``, ``comm``,
``ddp_hook``; ``tiers`` (on several hosts, full precision inside a host and the compressor
only across the slowest tier, once per host: the default of every compressor); ``diloco``
(local SGD, DiLoCo and streaming DiLoCo: an outer gradient every H steps, through the same
compressors and ``Comm``), ``elastic`` (their state and the compressors' in an elastic
``State``); ``auto`` and ``auto_model`` (``compression="auto"``: per bucket, none, bf16,
int8, int4 or PowerSGD, chosen from the measured link and step, agreed by every rank; where
the user allows it, local SGD's H, run by ``auto_local`` through ``diloco``).
"""

from .auto import Auto
from .base import ReducingCompressor
from .comm import Comm, TorchComm, WorldComm
from .ddp_hook import HookState, compressed_hook
from .diloco import DiLoCo
from .elastic import DiLoCoHandler, StateDictHandler
from .powersgd import PowerSGD
from .quantized import BF16, FP8, Int4, Int8
from .randomk import RandomK
from .state import CompressorState

__all__ = ["ReducingCompressor", "Int8", "Int4", "FP8", "BF16", "Auto", "PowerSGD", "RandomK",
           "CompressorState",
           "Comm", "WorldComm", "TorchComm", "HookState", "compressed_hook", "DiLoCo",
           "StateDictHandler", "DiLoCoHandler"]
