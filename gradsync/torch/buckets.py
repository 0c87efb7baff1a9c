"""Gradient buckets: which gradients share one fused allreduce, decided once, up front.

Why fixed up front. Collectives must be issued in the same order, with the same shapes, on
every rank (``gradsync/pipeline/engine.py``). Gradient hooks fire in whatever order autograd reaches
the parameters, and that order can differ between ranks: a data-dependent branch, a parameter that
one rank does not use this step. So a bucket cannot be "whatever happens to be ready". Every
rank instead derives the same assignment from the same parameter list before training, and
launches bucket k only once buckets 0..k-1 are launched (DDP's rule): the launch order is the
bucket order, whatever the order of the hooks.

How parameters are assigned. A *bucket* holds parameters of one dtype. Parameters are taken in
reverse registration order (the optimizer's param_groups, reversed), which approximates the
order in which backward produces their gradients, last layer first. Per dtype, each parameter
joins the open bucket unless that would take it past ``fusion_threshold`` bytes, in which case
it opens a new one; a parameter larger than the threshold gets a bucket of its own. Explicit
``groups`` replace this packing: one bucket per group and dtype. Either way buckets are then
ordered by when they should be complete, i.e. by their last-produced member, so that the
first bucket fills early and its allreduce overlaps the rest of backward.

Worked example, threshold 1 KiB, float32, registration order w1 (2 KiB), b1 (64 B),
w2 (768 B), b2 (16 B): reversed, b2 opens bucket 0 (16 B), w2 joins it (784 B), b1 takes it to
848 B; w1 would pass 1 KiB, so it opens bucket 1 alone.

The buffer. A bucket owns one flat tensor, allocated once, and a view of it per parameter.
On one host, a buffer larger than the shared-memory group's one-step road is a *shared
buffer* (``ShmGroup.shared_buffer``) that the other local ranks map, and the allreduce folds
and writes the ranks' buffers where they are, without staging copies (at most ``SHARED_MAX``
buffers of an optimizer, its largest: ``choose_shared``).
The allreduce runs in place on the buffer, and afterwards each ``param.grad`` *is* its view.
``DistributedOptimizer.zero_grad()`` keeps it so (zeroing the buffer in place), so backward
accumulates straight into the bucket and nothing is copied (DDP's ``gradient_as_bucket_view``).
Only a gradient that is not its view (after ``zero_grad(set_to_none=True)``, or one that a
script assigned) is copied into its view when it is ready.

A rank that has called ``join()`` takes part in the buckets' allreduces with zeros: its set's
controller stands in for it (``gradsync/pipeline/negotiation.py``), so buckets need nothing for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .. import api as gs
from .. import job
from ..errors import CollectiveMismatchError

if TYPE_CHECKING:
    from ..connect.world import World
    from ..pipeline.engine import Handle

__all__ = ["Bucket", "assign_buckets", "check_layout", "choose_shared", "plan_buckets",
           "split_evenly", "fusion_threshold"]


# Buckets of more bytes than this are shared buffers (on one host); None: more than the shm
# group's one-step road takes (smaller ones are faster on that road). Tests set 0.
SHARED_ABOVE: "int | None" = None
# At most this many of an optimizer's buckets are shared buffers, its largest: each holds
# descriptors here and a mapping in every other local rank, which keeps a bounded number of
# them (``transport/segment_shared.py``, ``_MAPPED_KEPT``); a model cut into hundreds of buckets (a
# fusion threshold near 0) would otherwise have them mapped again at every step.
SHARED_MAX = 16


def choose_shared(nbytes: Sequence[int], above: int, most: int = SHARED_MAX) -> set[int]:
    """Which buckets are shared buffers: the ``most`` largest of those of more than ``above``
    bytes (the lower index first among equals), the same on every rank."""
    eligible = sorted((i for i, n in enumerate(nbytes) if n > above), key=lambda i: (-nbytes[i], i))
    return set(eligible[:most])


def fusion_threshold() -> int:
    """The job's ``fusion_threshold`` setting (``GRADSYNC_FUSION_THRESHOLD``), in bytes."""
    return job.world().config.fusion_threshold


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[object], cap: int) -> list[list[int]]:
    """Packs items, in the given order, into per-dtype buckets of at most ``cap`` bytes.

    Args:
        nbytes: the size of each item.
        dtypes: the dtype of each item; a bucket holds one dtype.
        cap: the most bytes a bucket may hold, unless it holds a single item.

    Returns:
        Buckets as lists of item indices, in order of their first item.
    """
    buckets: list[list[int]] = []
    filled: list[int] = []
    open_bucket: dict[object, int] = {}
    for i, (n, dtype) in enumerate(zip(nbytes, dtypes)):
        b = open_bucket.get(dtype)
        if b is None or filled[b] + n > cap:
            b = open_bucket[dtype] = len(buckets)
            buckets.append([])
            filled.append(0)
        buckets[b].append(i)
        filled[b] += n
    return buckets


def split_evenly(items: list, parts: int) -> list[list]:
    """Splits ``items`` into ``parts`` contiguous runs whose lengths differ by at most one."""
    base, extra = divmod(len(items), parts)
    bounds = [p * base + min(p, extra) for p in range(parts + 1)]
    return [items[bounds[p]:bounds[p + 1]] for p in range(parts) if bounds[p] < bounds[p + 1]]


def assign_buckets(params: list[torch.Tensor],
                   groups: int | list[list[torch.Tensor]] | None) -> list[list[int]]:
    """Assigns parameters to buckets, identically on every rank.

    Args:
        params: the trainable parameters in registration order.
        groups: None (pack up to ``fusion_threshold``), an int (that many groups of consecutive
            parameters) or lists of parameters (one group each; unlisted ones alone).

    Returns:
        The buckets as lists of indices into ``params``, in launch order.
    """
    if groups is None:
        backward = list(range(len(params) - 1, -1, -1))  # roughly the order gradients arrive
        packed = plan_buckets([params[i].numel() * params[i].element_size() for i in backward],
                              [params[i].dtype for i in backward], fusion_threshold())
        buckets = [[backward[j] for j in bucket] for bucket in packed]
    else:
        if isinstance(groups, int):
            explicit = split_evenly(list(range(len(params))), groups)
        else:
            index = {id(p): i for i, p in enumerate(params)}  # frozen ones are left out
            explicit = [[index[id(p)] for p in group if id(p) in index] for group in groups]
            listed = {i for group in explicit for i in group}
            explicit = [g for g in explicit if g] + [[i] for i in range(len(params))
                                                     if i not in listed]
        buckets = []
        for group in explicit:  # one bucket per dtype of the group
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in group:
                by_dtype.setdefault(params[i].dtype, []).append(i)
            buckets.extend(by_dtype.values())
    # A bucket is complete when its earliest-registered member's gradient arrives: backward
    # produces gradients roughly last layer first, so launch those buckets first.
    buckets.sort(key=lambda bucket: -min(bucket))
    return buckets


def check_layout(buckets: "list[Bucket]", allgather_object=None) -> None:
    """Raises CollectiveMismatchError on every rank if the ranks planned different buckets
    (a different model, optimizer or fusion threshold): their allreduces would not match.

    ``allgather_object(obj, name)`` gathers over the optimizer's ranks (default: the job)."""
    mine = [(b.index, *entry) for b in buckets for entry in b.describe()]
    gather = allgather_object or (lambda obj, name: gs.allgather_object(obj, name=name))
    layouts = gather(mine, "DistributedOptimizer.layout")
    reference = layouts[0]
    for r, theirs in enumerate(layouts):
        if theirs == reference:
            continue
        i = next((i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b),
                 min(len(reference), len(theirs)))

        def entry(layout: list) -> str:
            if i >= len(layout):
                return "nothing"
            bucket, name, shape, dtype = layout[i]
            return f"'{name}' {dtype}{list(shape)} in bucket {bucket}"

        raise CollectiveMismatchError(
            f"DistributedOptimizer: ranks differ in their trainable parameters: rank 0 has "
            f"{len(reference)} and rank {r} has {len(theirs)}; parameter #{i} is "
            f"{entry(reference)} on rank 0 but {entry(theirs)} on rank {r}. Every rank must "
            "build the same model and optimizer (and use the same GRADSYNC_FUSION_THRESHOLD)")


class Bucket:
    """One fused allreduce: its parameters, its flat buffer, and a view per parameter.

    Attributes:
        index: launch position; bucket k is launched only after buckets 0..k-1.
        slots: the optimizer's slot number of each member (indexes its per-slot state).
        names: each member's name (from ``named_parameters``).
        pairs: ``(param, view)`` for each member; ``view`` has the parameter's shape.
        buffer: the gradients, back to back (a shared buffer on one host; see above).
        name: the collective's name, the same on every rank.
        pending: members whose gradient is not in the buffer yet this round.
        handle, wire, ctx: the allreduce in flight and the compressed tensor it works on.
        version: the buffer's version counter when the allreduce was launched.
    """

    def __init__(self, index: int, slots: list[int], params: list[torch.Tensor],
                 names: list[str], host: "World | None" = None):
        self.index, self.slots, self.names = index, slots, names
        numels = [p.numel() for p in params]
        total = sum(numels)
        dtype = params[0].dtype
        nbytes = total * params[0].element_size()
        # With a ``host`` (``choose_shared``), the buffer is shared with the host's other ranks
        # (``World.shared_buffer``): the allreduce then reads and writes it in place.
        raw = host.shared_buffer(nbytes) if host is not None and nbytes else None
        if host is None or raw is None:
            self.buffer = torch.zeros(total, dtype=dtype)
        else:
            self.buffer = torch.frombuffer(raw, dtype=dtype)  # zeros, as memfd pages start
            host.release_shared_with(self.buffer, raw.ctypes.data)
        pieces = self.buffer.split(numels)
        self.pairs = [(p, piece.view(p.shape)) for p, piece in zip(params, pieces)]
        first = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        self.name = f"gradients[{index}] {first} ({len(names)} tensors, {self.buffer.dtype})"
        self.pending = len(slots)
        # This round's allreduce (optimizer._gs_launch): its handle, the tensor on the wire and
        # the compressor's context for it.
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None
        self.ctx: object = None
        self.version = 0

    def describe(self) -> list[tuple[str, tuple[int, ...], str]]:
        """What must agree between ranks: each member's name, shape and dtype."""
        return [(n, tuple(p.shape), str(p.dtype)) for n, (p, _) in zip(self.names, self.pairs)]
