"""Tensor fusion: ready allreduces packed into one buffer and reduced by one collective.

A small allreduce costs its latency, whatever its size: forty gradients of a few kilobytes
reduced one by one pay forty times the messages of one allreduce of their concatenation.
Horovod's answer, kept here, is *fusion*: allreduces that are ready together and would reduce
alike are copied into one *fusion buffer*, reduced by one collective, and copied back out.

Vocabulary. The stage is handed the operations ready in one turn of their policy (a negotiation
cycle), in the order every rank runs them (the Horovod API's agreed order, ``negotiation.py``).
It cuts them into *batches*: each batch runs as one collective. Allreduces *fuse* when they
have the same *key*, (dtype, reduce op, prescale, postscale), since one collective applies one
of each; a batch grows, in order, while its bytes stay within the *threshold*
(``fusion_threshold``, Horovod's ``HOROVOD_FUSION_THRESHOLD``), and the next allreduce of its
key that does not fit opens the next batch of that key. Every other operation, and an allreduce
of the host's shared buffer (reduced where it is, ``Signature.shared``), is a batch of its own.
A batch keeps the order of its members, and the batches run in the order of their first
members.

An example in numbers, with a threshold of 64 bytes and ready, in order: ``a`` float32[4]
(16 bytes), ``b`` float32[8] (32), ``c`` int64[2] (16), ``d`` float32[8] (32), ``e``
float32[20] (80), all Sum. ``a`` opens a float32 batch, ``b`` joins it (48 bytes), ``c`` opens
an int64 one, ``d`` would take the float32 batch to 80 bytes so it opens another, and ``e``,
larger than the threshold itself, opens a third and runs alone: the batches are ``[a, b]``,
``[c]``, ``[d]``, ``[e]``. ``[a, b]`` is packed into 12 elements of the float32 buffer, ``a``
at offset 0 and ``b`` at 4, reduced once under the name ``a+1`` (the head's name and how many
others ride with it, in the description every rank's collective carries), and unpacked from
the same offsets.

Every rank cuts the same batches: they are made from the same operations in the same order,
and the ranks agreed on the signatures first (a mismatched operation never reaches the stage),
so each batch's layout, and so its collective, is the same on every rank.

The buffers (Gloo's "set up once, run many"). One fusion buffer per dtype, made at the first
batch of several tensors, grown only when a batch needs more (at least 1,024 elements), then
reused: a steady training step makes none. A batch of one tensor is reduced in its own memory,
with no copy; a batch of several costs one copy in and one out per member, the price of one
collective instead of several. The reduce op's Adasum reduces each member with its own dot
products (``counts``: every member's sizes, an Adasum bucket's several of its own), as if alone.

The timeline (``gradsync/timeline.py``) shows, on each member's row, Horovod's phases:
``MEMCPY_IN_FUSION_BUFFER``, then ``ALLREDUCE`` (``ADASUM``) with the batch's size in tensors
and bytes, then ``MEMCPY_OUT_FUSION_BUFFER``; a batch of one has only the middle one. The stats
(the owner's counter) count ``fused_batches`` (batches of several) and ``fused_tensors``
(their members).

How a batch runs. Its one collective is ``operations.allreduce``, the function an ``Engine``
runs for the NumPy API's allreduce, called on the thread that runs the policy's turn (the
negotiation's progress thread, which holds its executor, a ``Serial``, as an operation of the
engine holds the engine). It does not go through ``Engine.run``: what that sequence adds around
the call belongs to a policy, and the negotiation has its own of each. The claim orders one
executor's operations by issue, and the Horovod API's World (a sub-world of its own) has its
executor, the controller, whose order is agreed by name; the flight recorder's record is one
per operation, where a batch holds several, each recorded by the policy that issued it (started
as the batch starts, done or failed as it ends); and the failure path (fail the World, raise)
is the controller's too: a collective that raises a ``GradsyncError`` fails the World and every
request in flight (any other error fails only the batch's requests). Nor is it a ``Prepared``
call (``operations.prepare_allreduce``): a prepared call is one distinct call set up once, but
which operations are ready together depends on when the callers issued them, so a batch's
members and size are not a call's to set up once. What preparing saves,
``operations.allreduce`` keeps per distinct call anyway (the plan by size in ``World.plans``,
the description and its signature in ``World.descriptions``), and the buffer is set up once
above.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from ..collectives.ops import ReduceOp
from . import operations as ops
from .agreement import Signature

__all__ = ["Fusable", "Fusion"]

_OPS = {op.name: op for op in ReduceOp}


class Fusable(Protocol):
    """What the stage reads of an operation (a negotiation's ``Request`` has it all)."""

    name: str
    kind: str
    sig: Signature
    flat: Any  # an allreduce's flat array, reduced in place
    dtype_tag: Any  # its dtype as the collectives take it (``BFLOAT16`` for bfloat16's bits)
    counts: list[int] | None  # an Adasum allreduce of several tensors packed in flat: their sizes


F = TypeVar("F", bound=Fusable)


class Fusion:
    """Cuts ready operations into batches and runs an allreduce batch as one collective (see
    the module docstring).

    Args:
        world: the World the batches run on.
        threshold: the most bytes of allreduces in one batch (``fusion_threshold``).
        stats: where ``fused_batches`` and ``fused_tensors`` are counted (the owner's).
    """

    def __init__(self, world, threshold: int, stats: collections.Counter[str]):
        self.world, self.threshold, self.stats = world, threshold, stats
        self._buffers: dict[np.dtype, np.ndarray] = {}

    def batches(self, ready: Iterable[F]) -> list[list[F]]:
        """``ready`` (in the order every rank runs them) cut into batches, in the order of
        their first members."""
        batches: list[list[F]] = []
        open_: dict[tuple, tuple[list[F], int]] = {}  # by key: its open batch and its bytes
        for q in ready:
            sig = q.sig
            if q.kind != "allreduce" or sig.shared:  # a shared buffer is reduced where it is
                batches.append([q])
                continue
            key = (sig.dtype, sig.op, sig.prescale, sig.postscale)
            nbytes = q.flat.nbytes
            group = open_.get(key)
            if group is not None and group[1] + nbytes <= self.threshold:
                group[0].append(q)
                open_[key] = (group[0], group[1] + nbytes)
            else:
                batch: list[F] = [q]
                batches.append(batch)
                open_[key] = (batch, nbytes)
        return batches

    def run(self, batch: Sequence[Fusable], timeline) -> None:
        """Reduces every member of an allreduce batch (``batches``) in place, by one
        collective; ``timeline`` (a ``gradsync.timeline.Timeline`` or None) gets the phases.
        Raises what the collective raises (a ``GradsyncError``: the World is broken)."""
        tl = timeline
        head = batch[0]
        sig = head.sig
        assert sig.op is not None  # an allreduce always names its reduce op
        op, pre, post = _OPS[sig.op], sig.prescale, sig.postscale
        if len(batch) == 1:
            flat = head.flat
        else:
            self.stats["fused_batches"] += 1
            self.stats["fused_tensors"] += len(batch)
            total = sum(q.flat.size for q in batch)
            flat = self._buffer(head.flat.dtype, total)
            offset = 0
            for q in batch:
                if tl is not None:
                    tl.begin(q.name, "MEMCPY_IN_FUSION_BUFFER")
                flat[offset:offset + q.flat.size] = q.flat
                offset += q.flat.size
                if tl is not None:
                    tl.end(q.name, "MEMCPY_IN_FUSION_BUFFER")
        phase = "ADASUM" if op is ReduceOp.ADASUM else "ALLREDUCE"
        if tl is not None:
            for q in batch:
                tl.begin(q.name, phase, {"fused": len(batch), "bytes": int(flat.nbytes)})
        try:
            name = head.name if len(batch) == 1 else f"{head.name}+{len(batch) - 1}"
            counts = None
            if op is ReduceOp.ADASUM:  # each tensor gets its own dot products
                counts = [c for q in batch for c in (q.counts or [q.flat.size])]
            ops.allreduce(self.world, flat, head.dtype_tag, op, name=name, shape=flat.shape,
                          prescale=pre, postscale=post, counts=counts, trunc=True)
        finally:
            if tl is not None:
                for q in batch:
                    tl.end(q.name, phase)
        if len(batch) > 1:
            offset = 0
            for q in batch:
                if tl is not None:
                    tl.begin(q.name, "MEMCPY_OUT_FUSION_BUFFER")
                q.flat[...] = flat[offset:offset + q.flat.size]
                offset += q.flat.size
                if tl is not None:
                    tl.end(q.name, "MEMCPY_OUT_FUSION_BUFFER")

    def _buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` elements of the fusion buffer of ``dtype``, grown if needed."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.size < count:
            buf = self._buffers[dtype] = np.empty(max(count, 1024), dtype=dtype)
        return buf[:count]
