"""Turns one Horovod-API call into a ``negotiation.Request`` and hands it to its set's controller.

Names. As in Horovod, an operation's name is its kind and the caller's name
(``allreduce.grad.fc1``); a call without a name gets ``<kind>.noname.<n>``, counted per kind
and process set (``naming.py``).

Ranks. Roots (broadcast) are global ranks, as in Horovod, translated here to the set's rank;
``splits`` (alltoall) have one entry per rank of the set. Arguments are checked before the
request is announced, so no rank fails locally in the middle of a collective; the checks and
the in-place result step are ``gradsync/pipeline/arguments.py``'s, the same as the NumPy API's.
"""

from __future__ import annotations

import torch

from ..collectives.ops import ReduceOp
from ..compress import WorldComm
from ..pipeline import arguments
from ..pipeline import operations as ops
from ..pipeline.negotiation import Request
from ..pipeline.tensors import wrap
from . import naming
from . import process_sets as psets

__all__ = ["allreduce", "compressed_allreduce", "allgather", "broadcast", "reducescatter",
           "alltoall", "barrier", "broadcast_object", "allgather_object", "reset_names",
           "skip_name"]

reset_names = naming.reset  # kept importable from here, where they were
skip_name = naming.skip


def _name(kind: str, name: str | None, process_set) -> str:
    return naming.name(kind, name, process_set.process_set_id)


def _issue(process_set, request: Request, asynchronous: bool):
    handle = psets.controller(process_set).submit(request)
    return handle if asynchronous else handle.wait()


def _set_rank(process_set, root: int, ctl) -> int:
    return arguments.root_index(root, ctl.ranks, str(process_set))


def allreduce(tensor, name, op: ReduceOp, prescale: float, postscale: float, process_set,
              *, inplace: bool = False, asynchronous: bool = False, counts=None):
    """Allreduce (fusable with the other ready allreduces of its dtype, op and scale).

    ``counts`` (Adasum): the sizes of the tensors packed into ``tensor``, each of which gets
    its own dot products."""
    world = psets.controller(process_set).world
    buf = wrap(tensor, writable=inplace)
    arguments.reduce_op(op, buf.dtype)
    target = arguments.target(buf, inplace)
    # In place in a shared buffer (a DistributedOptimizer bucket), it is reduced where it is.
    shared = inplace and world.is_shared(target)

    def finish():
        return arguments.result(buf, target, tensor, inplace)

    request = Request(_name("allreduce", name, process_set), "allreduce", buf.dtype_name,
                      buf.shape, op=op.name, scale=(prescale, postscale), flat=target,
                      dtype_tag=buf.dtype, finish=finish, counts=counts, shared=shared)
    return _issue(process_set, request, asynchronous)


def compressed_allreduce(tensor, shapes: list, name, op: ReduceOp, prescale: float,
                         postscale: float, process_set, compressor, key: str | None, *,
                         inplace: bool = False, asynchronous: bool = False):
    """An allreduce that ``compressor`` (``gradsync/compress/``) runs: one operation of the
    set, matched by name like the others but never fused (the compressor issues its own
    collectives on the set's World, on the controller's thread, in an order fixed by
    ``shapes``). ``tensor`` holds the tensors of ``shapes`` back to back; ``key`` names its
    error-feedback state (None: none kept). The compressor's name and settings are part of
    the signature, so ranks that compress differently fail with a mismatch, not garbage."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"{compressor.describe()} reduces with op=Sum or op=Average, got "
                         f"{op.name}")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{compressor.describe()} compresses floating-point tensors; "
                        f"'{name}' is {tensor.dtype}")
    full = _name("allreduce", name, process_set)
    source = tensor.detach().reshape(-1)

    def run(world):
        x = source if prescale == 1.0 else source * prescale
        out = compressor.reduce(x, shapes, WorldComm(world, full), key,
                                average=op is ReduceOp.AVERAGE)
        if postscale != 1.0:
            out *= postscale
        return out

    def finish(out):
        if not inplace:
            return out.to(tensor.dtype).view(tensor.shape)
        _write(tensor, out)
        return tensor

    request = Request(full, "compressed_allreduce", str(tensor.dtype).removeprefix("torch."),
                      tuple(tensor.shape), op=f"{op.name} {compressor.describe()}",
                      scale=(prescale, postscale), run=run, finish=finish)
    return _issue(process_set, request, asynchronous)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """Writes ``value`` into ``target`` through NumPy, as the allreduce does: the version
    counter does not move, so ``DistributedOptimizer`` still sees any in-place change made to
    a gradient while its bucket was in flight."""
    value = value.to(target.dtype).reshape(-1)
    if not target.is_contiguous():
        with torch.no_grad():
            target.copy_(value.view(target.shape))
        return
    if target.dtype == torch.bfloat16:  # NumPy has no bfloat16: move its bits
        target, value = target.view(torch.int16), value.view(torch.int16)
    target.detach().numpy().reshape(-1)[:] = value.numpy()


def allgather(tensor, name, process_set, *, asynchronous: bool = False):
    """Concatenates the set's tensors along dimension 0 (which may differ between ranks)."""
    psets.controller(process_set)
    buf = wrap(tensor)
    arguments.rows(buf, "allgather")

    def run(world):
        out, rows = ops.allgather(world, buf.flat, buf.dtype, name=request.name, shape=buf.shape)
        return arguments.row_result(buf, out, sum(rows))

    request = Request(_name("allgather", name, process_set), "allgather", buf.dtype_name,
                      buf.shape, run=run)
    return _issue(process_set, request, asynchronous)


def broadcast(tensor, root_rank: int, name, process_set, *, inplace: bool = False,
              asynchronous: bool = False):
    """Copies the tensor of global rank ``root_rank`` to every rank of the set."""
    ctl = psets.controller(process_set)
    root = _set_rank(process_set, root_rank, ctl)
    buf = wrap(tensor, writable=inplace)
    target = arguments.target(buf, inplace)

    def run(world):
        ops.broadcast(world, target, buf.dtype, root, name=request.name, shape=buf.shape)
        return arguments.result(buf, target, tensor, inplace)

    request = Request(_name("broadcast", name, process_set), "broadcast", buf.dtype_name,
                      buf.shape, root=root, run=run)
    return _issue(process_set, request, asynchronous)


def reducescatter(tensor, name, op: ReduceOp, prescale: float, postscale: float, process_set,
                  *, asynchronous: bool = False):
    """Reduces over the set and returns this rank's block of rows."""
    psets.controller(process_set)
    buf = wrap(tensor)
    arguments.rows(buf, "reducescatter")
    work = arguments.target(buf, False)

    def run(world):
        mine = ops.reducescatter(world, work, buf.dtype, op, name=request.name, shape=buf.shape,
                                 prescale=prescale, postscale=postscale, trunc=True)
        rows = ops.split_rows(buf.shape[0], world.size)[world.rank]
        return arguments.row_result(buf, mine, rows)

    request = Request(_name("reducescatter", name, process_set), "reducescatter",
                      buf.dtype_name, buf.shape, op=op.name, scale=(prescale, postscale),
                      run=run)
    return _issue(process_set, request, asynchronous)


def alltoall(tensor, splits, name, process_set, *, asynchronous: bool = False,
             with_received: bool = False):
    """Sends ``splits[j]`` rows to the set's rank j; returns what ``hvd.alltoall`` returns
    (with ``with_received``, the pair ``(rows, received_splits)`` even without ``splits``: the
    gradient of an equal split sends back unequal counts when ranks' rows differ)."""
    ctl = psets.controller(process_set)
    buf = wrap(tensor)
    send = arguments.send_counts(splits, arguments.rows(buf, "alltoall"), len(ctl.ranks))

    def run(world):
        out, received = ops.alltoall(world, buf.flat, buf.dtype, send, name=request.name,
                                     shape=buf.shape)
        result = arguments.row_result(buf, out, sum(received))
        if splits is None and not with_received:
            return result
        return result, arguments.received_splits(received, tensor)

    request = Request(_name("alltoall", name, process_set), "alltoall", buf.dtype_name,
                      buf.shape, run=run)
    return _issue(process_set, request, asynchronous)


def barrier(process_set) -> None:
    """Returns once every rank of the set has reached its barrier."""
    request = Request(_name("barrier", None, process_set), "barrier", "none", (),
                      run=ops.barrier)
    _issue(process_set, request, False)


def broadcast_object(obj, root_rank: int, name, process_set):
    """Global rank ``root_rank``'s picklable ``obj`` on every rank of the set."""
    ctl = psets.controller(process_set)
    root = _set_rank(process_set, root_rank, ctl)
    full = _name("broadcast_object", name, process_set)
    request = Request(full, "broadcast_object", "object", (), root=root,
                      run=lambda world: ops.broadcast_object(world, obj, root, name=full))
    return _issue(process_set, request, False)


def allgather_object(obj, name, process_set) -> list:
    """The list of every set rank's picklable ``obj``, in set-rank order."""
    full = _name("allgather_object", name, process_set)
    request = Request(full, "allgather_object", "object", (),
                      run=lambda world: ops.allgather_object(world, obj, name=full))
    return _issue(process_set, request, False)

