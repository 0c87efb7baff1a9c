"""A DDP communication hook that runs any compressor here, over any torch.distributed backend.

    from gradsync.compress import HookState, Int8, compressed_hook
    model = DistributedDataParallel(net)
    model.register_comm_hook(HookState(Int8()), compressed_hook)

DDP calls the hook once per gradient bucket, in bucket order (its reducer launches bucket k
only after buckets 0..k-1), with the bucket's flat buffer of summed local gradients; the
hook returns a future of the averaged result, which DDP copies back into the gradients.

Same order on every rank. torch's PowerSGD hook issues its second allreduce from a future's
callback, whose timing differs between ranks; with two buckets, one rank could issue bucket
1's first allreduce before bucket 0's second while another did the opposite, and gloo, which
matches collectives by the order they are issued, then fails (issue 38). This hook runs the
whole compressed reduction of a bucket inside the hook call, so every rank issues bucket 0's
collectives, then bucket 1's, in the order DDP calls the hook, which is the bucket order on
every rank. The price: the bucket's communication is not overlapped with the rest of
backward (the returned future is already complete).

Tiers. When the group spans several hosts and some host has several ranks, the hook's
reduction is tiered (``tiers.py``): float32 inside each host, the compressor only between
hosts, once per host (the compressor's ``tiers="all"`` compresses every rank's gradient).
The hosts are the members' host names (``GRADSYNC_HOSTNAME``, else the system's), gathered
at the first bucket; ``HookState(topology=...)`` names them instead, with groups of hosts.
The sub-groups are made then too, by every rank of the job (``TorchComm``): a group smaller
than the job gets the flat schedule.

State. The compressor's state (``HookState.compressor.state_dict()``) is keyed by bucket:
``ddp.<index>.<layout digest>``. When DDP rebuilds its buckets after the first step (it
re-orders parameters by the order their gradients arrived), a bucket's layout changes, so
its residual starts again from zero rather than being added to the wrong parameters.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks the hook's
# return annotation against the object torch.futures.Future[torch.Tensor], not a string.
import zlib

import torch

from .base import ReducingCompressor
from .comm import TorchComm

__all__ = ["HookState", "compressed_hook"]


class HookState:
    """What ``compressed_hook`` needs: the compressor and the group (None: the default one).

    Args:
        compressor: a ``ReducingCompressor`` (``Int8()``, ``FP8()``, ``PowerSGD(rank=4)``,
            ``RandomK(0.01)``), or ``"auto"`` / ``Auto(...)`` (``auto.py``: per bucket,
            chosen from the measured link; ``state.compressor.decision`` is its choice);
            its state holds the error feedback of every bucket. ``Auto(local_sgd=H)`` may
            choose local SGD once given the parameters (``attach``) and called after each
            optimizer step (``after_step``): docs/slow-links.md.
        process_group: the DDP model's group, if it is not the default group.
        topology: where the group's ranks are (``gradsync.cluster.topology.Topology``, rank i of
            the group its rank i); None: from the members' host names.
    """

    def __init__(self, compressor: ReducingCompressor, process_group=None, topology=None):
        if isinstance(compressor, str) and compressor == "auto":
            from .auto import Auto

            compressor = Auto()
        if not getattr(compressor, "owns_reduction", False):
            raise TypeError(f"HookState takes a gradsync.compress compressor (Int8, FP8, "
                            f"PowerSGD, RandomK), got {compressor!r}")
        self.compressor, self.process_group = compressor, process_group
        self.topology = topology
        self._comm: TorchComm | None = None

    def comm(self) -> TorchComm:
        if self._comm is None:  # made at the first bucket: the group exists by then
            self._comm = TorchComm(self.process_group, self.topology)
        return self._comm

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)

    def elastic_handler(self, bcast_object=None):
        """Its compressor's handler (``elastic.py``): a HookState can be given to an elastic
        ``State`` as a value."""
        return self.compressor.elastic_handler(bcast_object)


def compressed_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The hook (``model.register_comm_hook(state, compressed_hook)``): averages the bucket's
    gradients through ``state.compressor``."""
    flat = bucket.buffer()
    shapes = [tuple(g.shape) for g in bucket.gradients()]
    layout = zlib.crc32(repr(shapes).encode())
    key = f"ddp.{bucket.index()}.{layout:08x}"
    result = state.compressor.reduce(flat, shapes, state.comm(), key, average=True)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(result.to(flat.dtype))
    return future
