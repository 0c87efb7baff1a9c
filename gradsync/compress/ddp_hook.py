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
matches collectives by the order they are issued, then fails (issue 38). Here every bucket's
whole compressed reduction is one task, and the tasks run one after another on one thread,
in the order DDP calls the hook: every rank issues bucket 0's collectives, then bucket 1's.

Behind backward (``overlap=True``, the default). The hook hands the bucket's reduction to
that thread and returns its future at once, so backward goes on computing the next buckets'
gradients while this one crosses the link; DDP waits for every bucket's future at the end of
backward, before the optimizer step. The reductions run on a group of their own: a copy of
the model's group (the same ranks, the same backend, made at the first bucket by each of its
ranks), because DDP itself may issue a collective during backward (with
``find_unused_parameters=True``, its map of used parameters after the last bucket) and two
threads' collectives on one group could be issued in different orders on different ranks.
``overlap=False`` runs the reduction inside the hook call on the model's group, the
returned future already complete (the earlier behaviour: nothing hidden, no second group).

What was not hidden. A compressor that wants to know how long training waited on its
exchange (``Auto``, whose model counts only that wait against the step: its ``blocked``)
is told, once per backward: at the first bucket the hook queues a callback at the end of
the backward pass (autograd's final callbacks, which run before the one DDP queues after
the last bucket), and there, on the training thread, it waits for the last reduction handed
over and reports that wait. With ``overlap=False`` the whole exchange is the wait, which
such a compressor assumes when nothing is reported.

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
import concurrent.futures
import time
import weakref
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
        overlap: run each bucket's reduction on a background thread, over a copy of the
            group, behind the rest of backward (the module docstring); False: inside the
            hook call, on ``process_group``.
    """

    def __init__(self, compressor: ReducingCompressor, process_group=None, topology=None,
                 overlap: bool = True):
        if isinstance(compressor, str) and compressor == "auto":
            from .auto import Auto

            compressor = Auto()
        if not getattr(compressor, "owns_reduction", False):
            raise TypeError(f"HookState takes a gradsync.compress compressor (Int8, FP8, "
                            f"PowerSGD, RandomK), got {compressor!r}")
        self.compressor, self.process_group = compressor, process_group
        self.topology, self.overlap = topology, bool(overlap)
        self._comm: TorchComm | None = None
        self._lane: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future | None = None  # the last reduction handed over
        self._waits_queued = False  # this backward's end-of-backward callback is queued

    def comm(self) -> TorchComm:
        """The Comm the reductions run on, made at the first bucket (the group exists by
        then): on ``process_group``, or with ``overlap`` on a copy of it, which every rank of
        the group makes here, at its first bucket."""
        if self._comm is None:
            group = _copy_of(self.process_group) if self.overlap else self.process_group
            self._comm = TorchComm(group, self.topology)
        return self._comm

    def lane(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that runs the reductions, in the order they were handed over;
        shut down when this state is collected."""
        if self._lane is None:
            self._lane = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="gradsync-ddp-hook")
            weakref.finalize(self, self._lane.shutdown, wait=False)
        return self._lane

    def _hand_over(self, task) -> concurrent.futures.Future:
        report = getattr(self.compressor, "blocked", None)
        if report is not None and not self._waits_queued:
            from torch.autograd import Variable

            self._waits_queued = True
            Variable._execution_engine.queue_callback(lambda: self._report_wait(report))
        self._last = self.lane().submit(task)
        return self._last

    def _report_wait(self, report) -> None:
        """At the end of backward: waits for the last reduction, tells the compressor how
        long (its failure, if any, reaches DDP through the bucket's future)."""
        self._waits_queued = False
        began = time.monotonic()
        if self._last is not None:
            concurrent.futures.wait([self._last])
        report(time.monotonic() - began)

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
    comm = state.comm()

    def reduce() -> torch.Tensor:
        return state.compressor.reduce(flat, shapes, comm, key, average=True).to(flat.dtype)

    if not state.overlap:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(reduce())
        return future
    # The outcome reaches DDP through a callback that returns the result or raises the error,
    # so torch keeps a C++ copy of the error: ``Future.set_exception`` would store the Python
    # exception itself, which DDP's reducer then fails to read as a Tensor (``Unable to cast
    # ...``) or, rethrowing it without the GIL, crashes on (the backend's ``Work.get_future``
    # does the same, torch/backend/work.py).
    source: torch.futures.Future[None] = torch.futures.Future()
    task = state._hand_over(reduce)
    task.add_done_callback(lambda _: source.set_result(None))
    return source.then(lambda _: task.result())


def _copy_of(group):
    """A new group of ``group``'s ranks (None: the default group's), in its order, on its
    backend. Made by each of those ranks only: with ``use_local_synchronization`` a rank
    outside them need not call it (a DDP model over part of the job)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend=dist.get_backend(group), sort_ranks=False,
                          use_local_synchronization=len(ranks) != dist.get_world_size())
