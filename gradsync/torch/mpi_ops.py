"""Horovod's collective API on torch tensors (``horovod/torch/mpi_ops.py``), run by gradsync.

Every function keeps the signature of its ``horovod.torch`` namesake and hands the work to
gradsync's engine through ``gradsync.api``; this module only translates arguments:

- ``op`` defaults to Average. ``average=True/False``, Horovod's deprecated spelling, maps to
  Average/Sum with a DeprecationWarning; giving both is a ValueError.
- Arguments gradsync cannot honour raise instead of being ignored: a process set other than
  the global one raises NotImplementedError, a tensor that is not a dense CPU tensor raises
  TypeError.
- ``op=Adasum`` runs ``collectives/adasum.py`` (allreduce and grouped_allreduce forms only;
  reducescatter raises, as in Horovod); a grouped Adasum passes each fused buffer's tensor
  sizes along, so every tensor gets its own dot products.
- ``grouped_allreduce`` fuses its tensors into one flat buffer per dtype, in order of first
  appearance, so the fusion is identical on every rank without any negotiation, and runs one
  allreduce per buffer.
- The synchronous out-of-place forms are autograd functions with Horovod's gradients:
  allreduce's gradient is the allreduce of the output gradient (same op and scale factors;
  Sum and Average only), allgather's is the *average* over ranks of the output gradient, cut
  to this rank's rows, broadcast's is that average on the root and zero elsewhere, alltoall's
  sends the gradient rows back, and reducescatter's is the allgather of the output gradient,
  multiplied by the number of ranks for Sum. (Horovod's convention: for allgather and
  broadcast that is 1/size of the derivative of the sum of all ranks' losses.)

Results are torch tensors of the input's dtype and shape (or, for allgather, alltoall and
reducescatter, the input's dtype with the gathered or scattered first dimension).
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from .. import api as gs
from ..collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..engine import Handle
from ..errors import GradsyncError
from .compression import Compression, Compressor

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "synchronize", "poll",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "ProcessSet", "global_process_set", "add_process_set", "GroupedHandle",
    "HorovodInternalError",
]

is_initialized, shutdown = gs.is_initialized, gs.shutdown
rank, size, local_rank, local_size = gs.rank, gs.size, gs.local_rank, gs.local_size
cross_rank, cross_size = gs.cross_rank, gs.cross_size


HorovodInternalError = GradsyncError
"""Horovod's error for a failed collective: here the root of gradsync's distributed errors
(a RuntimeError, as Horovod's is), so ``except hvd.HorovodInternalError`` catches them."""


class ProcessSet:
    """A set of ranks that runs collectives, as in Horovod.

    gradsync runs every collective on all ranks, so only the global set (``ranks=None``, or
    every rank listed) can be used; collectives given another set raise NotImplementedError.
    """

    def __init__(self, ranks: Sequence[int] | None = None):
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})

    def is_global(self) -> bool:
        return self.ranks is None or self.ranks == list(range(gs.size()))

    def size(self) -> int:
        return gs.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        if not self.included():
            raise ValueError(f"rank {gs.rank()} is not in {self!r}")
        return gs.rank() if self.ranks is None else self.ranks.index(gs.rank())

    def included(self) -> bool:
        return self.ranks is None or gs.rank() in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's dynamic process sets; not supported (gradsync collectives span every rank)."""
    raise NotImplementedError(
        f"add_process_set({process_set!r}): gradsync runs every collective on all ranks and "
        "has no process sets other than the global one")


def init(comm=None, process_sets=None, **settings) -> None:
    """Joins the job (``gradsync.init``). Idempotent.

    Args:
        comm: Horovod's MPI communicator; not supported (must be None).
        process_sets: Horovod's process sets; not supported (must be None).
        **settings: any ``gradsync.Config`` field, e.g. ``fusion_threshold=32 << 20``.
    """
    if comm is not None:
        raise NotImplementedError(
            "init(comm=...): gradsync does not run on an MPI communicator; it takes its ranks "
            "from `gradsync run`, torchrun, srun or mpirun (call init() without comm)")
    if process_sets is not None:
        raise NotImplementedError("init(process_sets=...): gradsync has no process sets other "
                                  "than the global one")
    gs.init(**settings)


# ----------------------------------------------------------------------------- validation
def _check_process_set(process_set: ProcessSet) -> None:
    if process_set is not global_process_set and not (
            isinstance(process_set, ProcessSet) and process_set.is_global()):
        raise NotImplementedError(
            f"process_set={process_set!r}: gradsync runs every collective on all ranks; only "
            "the global process set (the default) is supported")


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
    def forward(ctx, tensor, name, op, prescale, postscale):
        ctx.spec = (name, op, prescale, postscale)
        return gs.allreduce(tensor, op=op, name=name, prescale_factor=prescale,
                            postscale_factor=postscale)

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale = ctx.spec
        _require_linear(op, "allreduce")
        return (gs.allreduce(grad.contiguous(), op=op, name=_grad_name(name),
                             prescale_factor=prescale, postscale_factor=postscale),
                None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns the reduction of ``tensor`` over all ranks (differentiable).

    Args:
        tensor: a CPU tensor of the same shape and dtype on every rank.
        average: deprecated; True means op=Average, False op=Sum.
        name: identifies the collective in error reports; ranks must agree on it.
        compression: applied before the allreduce and undone after it.
        op: Average (default), Sum, Min, Max, Product or Adasum (floating point only).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it (and after averaging).
        process_set: only the global process set is supported.
    """
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    wire, ctx = compression.compress(_cpu(tensor, "allreduce"))
    reduced = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return gs.allreduce_async(_cpu(tensor, "allreduce_async"), op=op, name=name,
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place ``allreduce``: the result replaces ``tensor``, which is returned."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return gs.allreduce_(_cpu(tensor, "allreduce_"), op=op, name=name,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place ``allreduce``; don't touch ``tensor`` until it is synchronized."""
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    return gs.allreduce_async_(_cpu(tensor, "allreduce_async_"), op=op, name=name,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor)


# ----------------------------------------------------------------------------- grouped
class GroupedHandle:
    """A grouped allreduce in flight: one engine handle per fused buffer."""

    __slots__ = ("_handles", "_finish", "_result", "_done")

    def __init__(self, handles: list[Handle], finish: Callable[[], list[torch.Tensor]]):
        self._handles, self._finish = handles, finish
        self._result: list[torch.Tensor] | None = None
        self._done = False

    def poll(self) -> bool:
        return all(h.poll() for h in self._handles)

    def wait(self) -> list[torch.Tensor]:
        if not self._done:
            for h in self._handles:
                h.wait()
            self._result, self._done = self._finish(), True
        return self._result


def _grouped(tensors: list[torch.Tensor], op: ReduceOp, name: str | None, prescale: float,
             postscale: float, inplace: bool) -> GroupedHandle:
    """Fuses ``tensors`` into one buffer per dtype and starts one allreduce per buffer."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    groups = list(by_dtype.values())  # dicts keep insertion order: first appearance, every rank
    buffers = [torch.cat([tensors[i].detach().reshape(-1) for i in group]) for group in groups]
    handles = [_start_fused(buf, [tensors[i].numel() for i in group], op, prescale, postscale,
                            None if name is None else
                            f"{name}.{str(buf.dtype).removeprefix('torch.')}")
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


def _start_fused(buf: torch.Tensor, counts: list[int], op: ReduceOp, prescale: float,
                 postscale: float, name: str | None) -> Handle:
    """Starts the in-place allreduce of one fused buffer; Adasum learns where tensors end."""
    if op is Adasum:  # per-tensor dot products, as if each tensor were reduced alone
        return gs._allreduce(buf, op, name, prescale, postscale, "auto", True, True,
                             counts=counts)
    return gs.allreduce_async_(buf, op=op, prescale_factor=prescale, postscale_factor=postscale,
                               name=name)


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
        return tuple(t.clone() for t in _grouped(list(tensors), *spec, inplace=False).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, name, prescale, postscale = ctx.spec
        _require_linear(op, "grouped_allreduce")
        reduced = _grouped([g.contiguous() for g in grads], op, _grad_name(name), prescale,
                           postscale, inplace=False).wait()
        return (None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduces a list of tensors as one fused buffer per dtype (differentiable).

    Arguments as for ``allreduce``; ``name`` is the base name of the fused collectives.
    """
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce")
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    spec = (op, name, prescale_factor, postscale_factor)
    if torch.is_grad_enabled() and any(w.requires_grad for w in wires):
        reduced = _GroupedAllreduce.apply(spec, *wires)
    else:
        reduced = _grouped(list(wires), *spec, inplace=False).wait()
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupedHandle:
    """Starts a ``grouped_allreduce``; ``synchronize(handle)`` returns the list of results."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_async")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, inplace=False)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op=None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place ``grouped_allreduce``: the results replace ``tensors``, which are returned."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, inplace=True).wait()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupedHandle:
    """Starts an in-place ``grouped_allreduce``; don't touch the tensors until synchronized."""
    tensors, op = _grouped_args(tensors, average, op, process_set, "grouped_allreduce_async_")
    return _grouped(tensors, op, name, prescale_factor, postscale_factor, inplace=True)


# ----------------------------------------------------------------------------- allgather
class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows, ctx.name = tensor.shape[0] if tensor.dim() else 0, name
        return gs.allgather(tensor, name=name)

    @staticmethod
    def backward(ctx, grad):
        reduced = gs.allreduce(grad.contiguous(), op=Average, name=_grad_name(ctx.name))
        rows = gs.allgather(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[:gs.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dimension 0, whose size may differ."""
    _check_process_set(process_set)
    return _Allgather.apply(_cpu(tensor, "allgather"), name)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``allgather``; ``synchronize(handle)`` returns the gathered tensor."""
    _check_process_set(process_set)
    return gs.allgather_async(_cpu(tensor, "allgather_async"), name=name)


# ----------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root, ctx.name = root_rank, name
        return gs.broadcast(tensor, root_rank, name=name)

    @staticmethod
    def backward(ctx, grad):
        reduced = gs.allreduce(grad.contiguous(), op=Average, name=_grad_name(ctx.name))
        if gs.rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns root_rank's ``tensor`` on every rank (differentiable); ``tensor`` is untouched."""
    _check_process_set(process_set)
    return _Broadcast.apply(_cpu(tensor, "broadcast"), root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place ``broadcast``: root_rank's values replace ``tensor``, which is returned."""
    _check_process_set(process_set)
    return gs.broadcast_(_cpu(tensor, "broadcast_"), root_rank, name=name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts a ``broadcast``; ``synchronize(handle)`` returns the new tensor."""
    _check_process_set(process_set)
    return gs.broadcast_async(_cpu(tensor, "broadcast_async"), root_rank, name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place ``broadcast``."""
    _check_process_set(process_set)
    return gs.broadcast_async_(_cpu(tensor, "broadcast_async_"), root_rank, name=name)


# ----------------------------------------------------------------------------- alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        ctx.name = name
        result = gs.alltoall(tensor, splits=splits, name=name)
        if splits is None:
            ctx.received = None
            return result
        out, received = result
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        back = gs.alltoall(grad.contiguous(), splits=ctx.received, name=_grad_name(ctx.name))
        return (back if ctx.received is None else back[0]), None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Sends ``splits[j]`` rows of ``tensor`` to rank j (differentiable).

    Returns:
        The received rows; with ``splits`` given, the pair ``(received, received_splits)``.
    """
    _check_process_set(process_set)
    return _Alltoall.apply(_cpu(tensor, "alltoall"), splits, name)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an ``alltoall``; ``synchronize(handle)`` returns what ``alltoall`` would."""
    _check_process_set(process_set)
    return gs.alltoall_async(_cpu(tensor, "alltoall_async"), splits=splits, name=name)


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
    def forward(ctx, tensor, name, op, prescale, postscale):
        ctx.spec = (name, op, prescale * postscale)
        return gs.reducescatter(tensor, op=op, name=name, prescale_factor=prescale,
                                postscale_factor=postscale)

    @staticmethod
    def backward(ctx, grad):
        name, op, factor = ctx.spec
        _require_linear(op, "reducescatter")
        gathered = gs.allgather(grad.contiguous(), name=_grad_name(name))
        factor *= gs.size() if op is Sum else 1
        return (gathered * factor if factor != 1 else gathered), None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's block of rows (differentiable).

    Rows are split as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    op = _reducescatter_op(op, "reducescatter")
    _check_process_set(process_set)
    wire, ctx = compression.compress(_scattered_rows(_cpu(tensor, "reducescatter"),
                                                     "reducescatter"))
    mine = _Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor)
    return compression.decompress(mine, ctx)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op=Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a ``reducescatter``; ``synchronize(handle)`` returns this rank's block."""
    op = _reducescatter_op(op, "reducescatter_async")
    _check_process_set(process_set)
    tensor = _scattered_rows(_cpu(tensor, "reducescatter_async"), "reducescatter_async")
    return gs.reducescatter_async(tensor, op=op, name=name,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor)


# ----------------------------------------------------------------------------- the rest
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank has called ``barrier``."""
    _check_process_set(process_set)
    gs.barrier()


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
