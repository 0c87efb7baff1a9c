"""The ``torch.distributed`` backend "gradsync": DDP, FSDP, Lightning and Ray Train on
gradsync's transports and algorithms.

    import gradsync                                   # registers the backend
    torch.distributed.init_process_group(backend="gradsync")
    model = torch.nn.parallel.DistributedDataParallel(model)

``import gradsync`` registers the backend as soon as ``torch.distributed`` is imported (before
or after gradsync), through ``gradsync/_torch_hook.py``; ``register()`` does it by hand.
docs/distributed.md lists what the backend supports and what it raises.

Modules: ``group`` (the ProcessGroup: every collective), ``p2p`` (send and receive),
``work`` (Works and the progress lanes), ``backward`` (DDP's wait inside torch's reducer, for
the pace meter), ``tensors`` (dtypes and reduce ops), ``errors``.
"""

from __future__ import annotations

from ..._torch_hook import NAME, register
from .errors import (BackendError, MismatchBackendError, PeerLostBackendError,
                     TimeoutBackendError)
from .group import ProcessGroupGradsync

__all__ = ["register", "ProcessGroupGradsync", "BackendError", "PeerLostBackendError",
           "MismatchBackendError", "TimeoutBackendError", "NAME"]
