"""Horovod's collective API on torch tensors (``horovod/torch/mpi_ops.py``), run by gradsync.

Every function keeps the signature of its ``horovod.torch`` namesake. Operations are matched
across ranks by name, as in Horovod: each call becomes a request (``requests.py``) that the
controller of its process set (``process_sets.py``, ``gradsync/pipeline/negotiation.py``) runs once
every rank of the set has issued it, in an order all ranks agree on, fused with other ready
allreduces. So ranks may issue operations in different orders; mismatched shapes, dtypes, ops
or roots raise ``CollectiveMismatchError`` (a RuntimeError) on every rank and the next
operation works; a second async operation with the name of one in flight raises ValueError.
This module only translates arguments:

- ``op`` defaults to Average. ``average=True/False``, Horovod's deprecated spelling, maps to
  Average/Sum with a DeprecationWarning; giving both is a ValueError.
- Arguments gradsync cannot honour raise instead of being ignored: a tensor that is not a
  dense CPU tensor raises TypeError, a process set this rank is not a member of (or one not
  registered) raises ValueError.
- ``op=Adasum`` runs ``collectives/adasum.py`` (allreduce and grouped_allreduce forms only;
  reducescatter raises, as in Horovod); a grouped Adasum passes each fused buffer's tensor
  sizes along, so every tensor gets its own dot products (and so does the controller when it
  fuses Adasum allreduces).
- ``grouped_allreduce`` fuses its tensors into one flat buffer per dtype, in order of first
  appearance, and issues one allreduce per buffer.
- The synchronous out-of-place forms are autograd functions with Horovod's gradients:
  allreduce's gradient is the allreduce of the output gradient (same op and scale factors;
  Sum and Average only), allgather's is the *average* over ranks of the output gradient, cut
  to this rank's rows, broadcast's is that average on the root and zero elsewhere, alltoall's
  sends the gradient rows back, and reducescatter's is the allgather of the output gradient,
  multiplied by the number of ranks for Sum. (Horovod's convention: for allgather and
  broadcast that is 1/size of the derivative of the sum of all ranks' losses.) Gradients run
  in the forward operation's process set.

Results are torch tensors of the input's dtype and shape (or, for allgather, alltoall and
reducescatter, the input's dtype with the gathered or scattered first dimension).
"""

from __future__ import annotations

import atexit
import sys
import warnings
from typing import Callable, Sequence

import torch

from .. import api as gs
from .. import job
from ..collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..errors import GradsyncError, PeerLostError
from ..pipeline.engine import Handle
from . import naming as _naming
from . import process_sets as _psets
from . import requests as _requests
from .compression import Compression, Compressor, reducing
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "synchronize", "poll",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "GroupedHandle", "start_timeline", "stop_timeline", "HorovodInternalError",
]

is_initialized = gs.is_initialized
rank, size, local_rank, local_size = gs.rank, gs.size, gs.local_rank, gs.local_size
cross_rank, cross_size = gs.cross_rank, gs.cross_size


HorovodInternalError = GradsyncError
"""Horovod's error for a failed collective: here the root of gradsync's distributed errors
(a RuntimeError, as Horovod's is), so ``except hvd.HorovodInternalError`` catches them."""


def init(comm=None, process_sets=None, **settings) -> None:
    """Joins the job (``gradsync.init``) and starts the negotiation of the Horovod API.

    Idempotent. Connects the global process set's World and those of ``process_sets``.

    Args:
        comm: Horovod's MPI communicator; not supported (must be None).
        process_sets: ProcessSets (or lists of ranks) to register now, as ``add_process_set``
            would; ``"dynamic"`` (Horovod's spelling for "added later") is accepted.
        **settings: any ``gradsync.Config`` field, e.g. ``fusion_threshold=32 << 20`` or
            ``timeline="/tmp/timeline.json"``.
    """
    if comm is not None:
        raise NotImplementedError(
            "init(comm=...): gradsync does not run on an MPI communicator; it takes its ranks "
            "from `gradsync run`, torchrun, srun or mpirun (call init() without comm)")
    if process_sets == "dynamic":
        process_sets = None
    gs.init(**settings)
    if _psets.all_controllers():
        return
    _naming.reset()
    _psets.start(process_sets)
    config = job.world().config
    if config.timeline:
        start_timeline(config.timeline, config.timeline_mark_cycles)
    atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """``shutdown`` when the interpreter exits. A script ended by an unhandled exception
    (Python keeps it in ``sys.last_value``) leaves while the other ranks go on: they would
    never ask to stop, so its process sets are abandoned, and the other members get a
    ``PeerLostError`` naming this rank (in elastic mode, a lost worker)."""
    error = getattr(sys, "last_value", None)
    if error is not None and not isinstance(error, (SystemExit, KeyboardInterrupt)) \
            and gs.is_initialized():
        me = gs.rank()
        _psets.stop(abandon=PeerLostError(
            f"rank {me} left the job on an unhandled {type(error).__name__}", peer=me))
    shutdown()


def shutdown() -> None:
    """Stops the negotiation threads, closes every process set and leaves the job."""
    _psets.stop()
    gs.shutdown()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording a Chrome-trace timeline of the Horovod API's operations.

    Rank 0 writes ``file_path``, rank r ``<file_path>.r`` (see docs/torch.md, "Timeline").
    A timeline already recording is closed first.

    Args:
        file_path: the trace file.
        mark_cycles: also mark each negotiation cycle that did something (``CYCLE_START``).
    """
    from ..timeline import Timeline

    _psets.set_timeline(Timeline(file_path, mark_cycles=mark_cycles, rank=gs.rank()))


def stop_timeline() -> None:
    """Stops recording the timeline and closes its file (complete JSON)."""
    _psets.set_timeline(None)


# ----------------------------------------------------------------------------- validation
def _check_process_set(process_set: ProcessSet) -> None:
    """Raises unless this rank may issue ``process_set``'s operations."""
    _psets.controller(process_set)


def _resolve_op(op, average: bool | None) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("give op or average, not both (average is Horovod's deprecated "
                             "spelling of op=Average / op=Sum)")
        warnings.warn("average= is deprecated (as in Horovod): use op=Average or op=Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be Average, Sum, Min, Max, Product or Adasum; got {op!r}")
    return op


def _cpu(tensor, function: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{function} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(f"{function}: gradsync.torch works on CPU tensors; this one is on "
                        f"{tensor.device} (move it with .cpu())")
    if tensor.layout != torch.strided:
        raise TypeError(f"{function}: gradsync.torch takes dense tensors, got {tensor.layout}")
    return tensor


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def _require_linear(op: ReduceOp, function: str) -> None:
    if op not in (Sum, Average):
        raise RuntimeError(f"the gradient of {function} with op={op!r} is not defined; only "
                           "Sum and Average are differentiable")


# ----------------------------------------------------------------------------- allreduce
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.spec = (name, op, prescale, postscale, process_set)
        return _requests.allreduce(tensor, name, op, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set = ctx.spec
        _require_linear(op, "allreduce")
        return (_requests.allreduce(grad.contiguous(), _grad_name(name), op, prescale,
                                    postscale, process_set),
                None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the reduction of ``tensor`` over all ranks (differentiable).

    Args:
        tensor: a CPU tensor of the same shape and dtype on every rank.
        average: deprecated; True means op=Average, False op=Sum.
        name: identifies the collective in error reports; ranks must agree on it.
        compression: applied before the allreduce and undone after it; or one that replaces
            it (``Compression.int8``, ``.fp8``, ``.powersgd``, ``.randomk``: Sum or Average
            only, the result not differentiable; an instance keeps error feedback per
            ``name``, none without a name).
        op: Average (default), Sum, Min, Max, Product or Adasum (floating point only).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it (and after averaging).
        process_set: the ranks that reduce (default: all); this rank must be one of them.
    """
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    reducer = reducing(compression)
    if reducer is not None:
        tensor = _cpu(tensor, "allreduce")
        return _requests.compressed_allreduce(tensor, [tuple(tensor.shape)], name, op,
                                              prescale_factor, postscale_factor, process_set,
                                              reducer, name)
    wire, ctx = compression.compress(_cpu(tensor, "allreduce"))
    reduced = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return _requests.allreduce(_cpu(tensor, "allreduce_async"), name, op, prescale_factor,
                               postscale_factor, process_set, asynchronous=True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place ``allreduce``: the result replaces ``tensor``, which is returned."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return _requests.allreduce(_cpu(tensor, "allreduce_"), name, op, prescale_factor,
                               postscale_factor, process_set, inplace=True)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place ``allreduce``; don't touch ``tensor`` until it is synchronized."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return _requests.allreduce(_cpu(tensor, "allreduce_async_"), name, op, prescale_factor,
                               postscale_factor, process_set, inplace=True, asynchronous=True)


# ----------------------------------------------------------------------------- grouped
class GroupedHandle:
    """A grouped allreduce in flight: one engine handle per fused buffer."""

    __slots__ = ("_handles", "_finish", "_result")

    def __init__(self, handles: list[Handle], finish: Callable[[], list[torch.Tensor]]):
        self._handles, self._finish = handles, finish
        self._result: list[torch.Tensor] | None = None  # once finished

    def poll(self) -> bool:
        return all(h.poll() for h in self._handles)

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            for h in self._handles:
                h.wait()
            self._result = self._finish()
        return self._result


def _grouped(tensors: list[torch.Tensor], op: ReduceOp, name: str | None, prescale: float,
             postscale: float, process_set: ProcessSet, inplace: bool) -> GroupedHandle:
    """Fuses ``tensors`` into one buffer per dtype and starts one allreduce per buffer."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    groups = list(by_dtype.values())  # dicts keep insertion order: first appearance, every rank
    buffers = [torch.cat([tensors[i].detach().reshape(-1) for i in group]) for group in groups]
    handles = [_requests.allreduce(buf, None if name is None else
                                   f"{name}.{str(buf.dtype).removeprefix('torch.')}",
                                   op, prescale, postscale, process_set, inplace=True,
                                   asynchronous=True,
                                   counts=[tensors[i].numel() for i in group])
               for group, buf in zip(groups, buffers)]

    def finish() -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(tensors)
        for group, buf in zip(groups, buffers):
            pieces = buf.split([tensors[i].numel() for i in group])
            for i, piece in zip(group, pieces):
                out[i] = piece.view(tensors[i].shape)
        if not inplace:
            return out
        with torch.no_grad():
            for t, result in zip(tensors, out):
                t.copy_(result)
        return list(tensors)

    return GroupedHandle(handles, finish)


def _grouped_args(tensors, average, op, process_set, function: str) -> tuple[list, ReduceOp]:
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return [_cpu(t, function) for t in tensors], op


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors):
        ctx.spec = spec
        # Clones: outputs of a custom Function that are views of one buffer could not be
        # modified in place by the caller.
        op, name, prescale, postscale, process_set = spec
        return tuple(t.clone() for t in _grouped(list(tensors), op, name, prescale, postscale,
                                                  process_set, inplace=False).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, name, prescale, postscale, process_set = ctx.spec
        _require_linear(op, "grouped_allreduce")
        reduced = _grouped([g.contiguous() for g in grads], op, _grad_name(name), prescale,
                           postscale, process_set, inplace=False).wait()
        return (None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduces a list of tensors as one fused buffer per dtype (differentiable).

    Arguments as for ``allreduce``; ``name`` is the base name of the fused collectives.
    """
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce")
    reducer = reducing(compression)
    if reducer is not None:
        return _grouped_compressed(tensors, op, name, prescale_factor, postscale_factor,
                                   process_set, reducer)
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    spec = (op, name, prescale_factor, postscale_factor, process_set)
    if torch.is_grad_enabled() and any(w.requires_grad for w in wires):
        reduced = _GroupedAllreduce.apply(spec, *wires)
    else:
        reduced = _grouped(list(wires), *spec, inplace=False).wait()
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


def _grouped_compressed(tensors: list[torch.Tensor], op: ReduceOp, name: str | None,
                        prescale: float, postscale: float, process_set: ProcessSet,
                        reducer) -> list[torch.Tensor]:
    """A grouped allreduce through a compressor that owns its reduction: one fused buffer
    per dtype (as ``_grouped``), each reduced as a whole, its tensors' shapes known to the
    compressor (PowerSGD compresses each matrix of the buffer)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    handles = []
    for group in by_dtype.values():
        buf = torch.cat([tensors[i].detach().reshape(-1) for i in group])
        full = None if name is None else f"{name}.{str(buf.dtype).removeprefix('torch.')}"
        handles.append((group, _requests.compressed_allreduce(
            buf, [tuple(tensors[i].shape) for i in group], full, op, prescale, postscale,
            process_set, reducer, full, asynchronous=True)))
    out: list[torch.Tensor] = list(tensors)
    for group, handle in handles:
        pieces = handle.wait().split([tensors[i].numel() for i in group])
        for i, piece in zip(group, pieces):
            out[i] = piece.view(tensors[i].shape)
    return out


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupedHandle:
    """Starts a ``grouped_allreduce``; ``synchronize(handle)`` returns the list of results."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_async")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                    inplace=False)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op=None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place ``grouped_allreduce``: the results replace ``tensors``, which are returned."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                    inplace=True).wait()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupedHandle:
    """Starts an in-place ``grouped_allreduce``; don't touch the tensors until synchronized."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_async_")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                    inplace=True)


# ----------------------------------------------------------------------------- allgather
class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.name = tensor.shape[0] if tensor.dim() else 0, name
        ctx.process_set = process_set
        return _requests.allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        reduced = _requests.allreduce(grad.contiguous(), _grad_name(ctx.name), Average, 1.0,
                                      1.0, ps)
        rows = _requests.allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                                   _grad_name(None if ctx.name is None else ctx.name + ".rows"),
                                   ps)
        me = _psets.controller(ps).world.rank
        offset = int(rows[:me].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dimension 0, whose size may differ."""
    _check_process_set(process_set)
    return _Allgather.apply(_cpu(tensor, "allgather"), name, process_set)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``allgather``; ``synchronize(handle)`` returns the gathered tensor."""
    _check_process_set(process_set)
    return _requests.allgather(_cpu(tensor, "allgather_async"), name, process_set,
                               asynchronous=True)


# ----------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return _requests.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _requests.allreduce(grad.contiguous(), _grad_name(ctx.name), Average, 1.0,
                                      1.0, ctx.process_set)
        if gs.rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns root_rank's ``tensor`` on every rank (differentiable); ``tensor`` is untouched."""
    _check_process_set(process_set)
    return _Broadcast.apply(_cpu(tensor, "broadcast"), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place ``broadcast``: root_rank's values replace ``tensor``, which is returned."""
    _check_process_set(process_set)
    return _requests.broadcast(_cpu(tensor, "broadcast_"), root_rank, name, process_set,
                               inplace=True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts a ``broadcast``; ``synchronize(handle)`` returns the new tensor."""
    _check_process_set(process_set)
    return _requests.broadcast(_cpu(tensor, "broadcast_async"), root_rank, name, process_set,
                               asynchronous=True)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place ``broadcast``."""
    _check_process_set(process_set)
    return _requests.broadcast(_cpu(tensor, "broadcast_async_"), root_rank, name, process_set,
                               inplace=True, asynchronous=True)


# ----------------------------------------------------------------------------- alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.name, ctx.process_set = name, process_set
        out, received = _requests.alltoall(tensor, splits, name, process_set,
                                           with_received=True)
        ctx.received = received  # what each rank sent here: the gradient goes back in these
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        back, _received = _requests.alltoall(grad.contiguous(), ctx.received,
                                             _grad_name(ctx.name), ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Sends ``splits[j]`` rows of ``tensor`` to rank j (differentiable).

    Returns:
        The received rows; with ``splits`` given, the pair ``(received, received_splits)``.
    """
    _check_process_set(process_set)
    return _Alltoall.apply(_cpu(tensor, "alltoall"), splits, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``alltoall``; ``synchronize(handle)`` returns what ``alltoall`` would."""
    _check_process_set(process_set)
    return _requests.alltoall(_cpu(tensor, "alltoall_async"), splits, name, process_set,
                              asynchronous=True)


# ----------------------------------------------------------------------------- reducescatter
def _reducescatter_op(op, function: str) -> ReduceOp:
    op = _resolve_op(op, None)
    if op is Adasum:
        raise NotImplementedError(f"{function}: op=Adasum is not supported (as in Horovod); "
                                  "Adasum combines whole vectors, use allreduce")
    return op


def _scattered_rows(tensor: torch.Tensor, function: str) -> torch.Tensor:
    if tensor.dim() == 0:
        raise ValueError(f"{function} scatters the rows of its tensor, so it needs at least one "
                         "dimension; got a scalar (as in Horovod)")
    return tensor


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.spec = (name, op, prescale * postscale, process_set)
        return _requests.reducescatter(tensor, name, op, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx, grad):
        name, op, factor, process_set = ctx.spec
        _require_linear(op, "reducescatter")
        gathered = _requests.allgather(grad.contiguous(), _grad_name(name), process_set)
        factor *= len(_psets.controller(process_set).ranks) if op is Sum else 1
        return (gathered * factor if factor != 1 else gathered), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's block of rows (differentiable).

    Rows are split as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    op = _reducescatter_op(op, "reducescatter")
    _check_process_set(process_set)
    if reducing(compression) is not None:
        raise NotImplementedError(f"reducescatter(compression={compression!r}): the "
                                  "compressors that replace the allreduce reduce whole "
                                  "tensors; use allreduce, or fp16/bf16 here")
    wire, ctx = compression.compress(_scattered_rows(_cpu(tensor, "reducescatter"),
                                                     "reducescatter"))
    mine = _Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(mine, ctx)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op=Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a ``reducescatter``; ``synchronize(handle)`` returns this rank's block."""
    op = _reducescatter_op(op, "reducescatter_async")
    _check_process_set(process_set)
    tensor = _scattered_rows(_cpu(tensor, "reducescatter_async"), "reducescatter_async")
    return _requests.reducescatter(tensor, name, op, prescale_factor, postscale_factor,
                                   process_set, asynchronous=True)


# ----------------------------------------------------------------------------- the rest
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank has called ``barrier``."""
    _requests.barrier(process_set)


def synchronize(handle: Handle | GroupedHandle):
    """Waits for an ``*_async`` operation and returns its result (or raises its error)."""
    if not isinstance(handle, (Handle, GroupedHandle)):
        raise TypeError(f"synchronize takes the handle of an *_async call, got {handle!r}")
    return handle.wait()


def poll(handle: Handle | GroupedHandle) -> bool:
    """True once the ``*_async`` operation behind ``handle`` has finished."""
    if not isinstance(handle, (Handle, GroupedHandle)):
        raise TypeError(f"poll takes the handle of an *_async call, got {handle!r}")
    return handle.poll()
