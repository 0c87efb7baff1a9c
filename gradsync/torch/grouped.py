"""Horovod's grouped allgather and reducescatter, and its sparse allreduce, on gradsync.

``grouped_allgather(tensors)`` and ``grouped_reducescatter(tensors)`` are the per-tensor
operations issued together: one collective per tensor, in list order (the same on every rank),
all in flight at once, finished by one ``synchronize``. Names: with ``name`` given, tensor ``i``
travels as ``<name>.<i>``. The synchronous forms are differentiable with the gradients of their
single-tensor namesakes (``mpi_ops``): allgather's is the average over ranks of the output
gradient, cut to this rank's rows; reducescatter's is the allgather of the output gradient
(times the number of ranks for Sum, times the scale factors).

``sparse_allreduce_async(tensor, name, op)`` reduces a sparse COO tensor as Horovod does:
allgather the indices and the values, and build the sum as a sparse tensor whose duplicate
indices add up when it is coalesced (divided by the number of ranks for Average). It returns a
function; calling it waits and returns the reduced sparse tensor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..collectives.ops import Average, ReduceOp, Sum
from . import process_sets as _psets
from . import requests as _requests
from .compression import Compression, Compressor
from .mpi_ops import (GroupedHandle, ProcessSet, _check_process_set, _cpu, _grad_name,
                      _grouped, _reducescatter_op, _scattered_rows, allgather_async,
                      global_process_set)

__all__ = ["grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "sparse_allreduce_async"]


def _member(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def _each(tensors: Sequence[torch.Tensor], function: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{function} takes a list of tensors, got a single tensor")
    return [_cpu(t, function) for t in tensors]


# ----------------------------------------------------------------------------- allgather
def _start_allgathers(tensors: list[torch.Tensor], name: str | None,
                      process_set: ProcessSet) -> GroupedHandle:
    handles = [_requests.allgather(t, _member(name, i), process_set, asynchronous=True)
               for i, t in enumerate(tensors)]
    return GroupedHandle(handles, lambda: [h.wait() for h in handles])


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.name, ctx.process_set = name, process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(_start_allgathers(list(tensors), name, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = _grouped([g.contiguous() for g in grads], Average, _grad_name(ctx.name), 1.0,
                           1.0, ps, inplace=False).wait()
        # Every rank's row count of every tensor: one allgather of this rank's counts.
        rows = _requests.allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                                   _grad_name(None if ctx.name is None else ctx.name + ".rows"),
                                   ps)
        before = rows[:_psets.controller(ps).world.rank].sum(dim=0).tolist()
        return (None, None, *[r.narrow(0, start, n)
                        for r, start, n in zip(reduced, before, ctx.rows)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgathers each tensor of ``tensors`` (along dimension 0; differentiable).

    Args:
        tensors: CPU tensors; tensor ``i`` must have the same dtype and trailing dimensions on
            every rank, its first dimension may differ.
        name: the base name of the group (tensor ``i`` is ``<name>.<i>``).
        process_set: the ranks that take part (default: all); this rank must be one.
    """
    tensors = _each(tensors, "grouped_allgather")
    _check_process_set(process_set)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return _start_allgathers(tensors, name, process_set).wait()


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupedHandle:
    """Starts a ``grouped_allgather``; ``synchronize(handle)`` returns the list of results."""
    tensors = _each(tensors, "grouped_allgather_async")
    _check_process_set(process_set)
    return _start_allgathers(tensors, name, process_set)


# ----------------------------------------------------------------------------- reducescatter
def _start_reducescatters(tensors: list[torch.Tensor], name: str | None, op: ReduceOp,
                          prescale: float, postscale: float,
                          process_set: ProcessSet) -> GroupedHandle:
    handles = [_requests.reducescatter(t, _member(name, i), op, prescale, postscale, process_set,
                                       asynchronous=True)
               for i, t in enumerate(tensors)]
    return GroupedHandle(handles, lambda: [h.wait() for h in handles])


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors):
        ctx.spec = spec
        return tuple(_start_reducescatters(list(tensors), *spec).wait())

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set = ctx.spec
        if op not in (Sum, Average):
            raise RuntimeError(f"the gradient of grouped_reducescatter with op={op!r} is not "
                               "defined; only Sum and Average are differentiable")
        ranks = len(_psets.controller(process_set).ranks)
        factor = prescale * postscale * (ranks if op is Sum else 1)
        gathered = _start_allgathers([g.contiguous() for g in grads], _grad_name(name),
                                     process_set).wait()
        return (None, *[g * factor if factor != 1 else g for g in gathered])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatters each tensor of ``tensors`` (differentiable); see ``reducescatter``.

    Args:
        tensors: CPU tensors of at least one dimension, each the same shape on every rank.
        name: the base name of the group (tensor ``i`` is ``<name>.<i>``).
        compression: applied to each tensor before its reducescatter and undone after it.
        op: Average (default), Sum, Min, Max or Product (Adasum raises).
        process_set: the ranks that take part (default: all); this rank must be one.
        prescale_factor: multiplies the inputs before the reduction.
        postscale_factor: multiplies the results after it.
    """
    tensors, op = _scatter_args(tensors, op, process_set, "grouped_reducescatter")
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    spec = (name, op, prescale_factor, postscale_factor, process_set)
    if torch.is_grad_enabled() and any(w.requires_grad for w in wires):
        scattered = _GroupedReducescatter.apply(spec, *wires)
    else:
        scattered = _start_reducescatters(list(wires), *spec).wait()
    return [compression.decompress(s, c) for s, c in zip(scattered, ctxs)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op=Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupedHandle:
    """Starts a ``grouped_reducescatter``; ``synchronize(handle)`` returns the list of blocks."""
    tensors, op = _scatter_args(tensors, op, process_set, "grouped_reducescatter_async")
    return _start_reducescatters(tensors, name, op, prescale_factor, postscale_factor,
                                 process_set)


def _scatter_args(tensors, op, process_set, function: str) -> tuple[list, ReduceOp]:
    op = _reducescatter_op(op, function)
    tensors = [_scattered_rows(t, function) for t in _each(tensors, function)]
    _check_process_set(process_set)
    return tensors, op


# ----------------------------------------------------------------------------- sparse
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Starts the allreduce of a sparse COO tensor; call the result to get the reduced tensor.

    Args:
        tensor: a sparse COO CPU tensor, the same size on every rank (any number of entries).
        name: the base name (``<name>.indices`` and ``<name>.values`` travel).
        op: Average or Sum.
        process_set: the ranks that take part (default: all); this rank must be one.

    Returns:
        A function that waits and returns the sum (or average) as an uncoalesced sparse
        tensor: an index present on several ranks appears once per rank.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async reduces with op=Average or op=Sum, got {op!r}")
    _check_process_set(process_set)
    if tensor.device.type != "cpu":
        raise TypeError(f"sparse_allreduce_async: gradsync.torch works on CPU tensors; this one "
                        f"is on {tensor.device}")
    # Allgather concatenates along dimension 0, so the (sparse_dims, nnz) indices travel
    # transposed, one row per entry.
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(tensor._values().contiguous(), name=f"{name}.values",
                             process_set=process_set)
    ranks = process_set.size()

    def handle() -> torch.Tensor:
        gathered_values = values.wait()
        gathered_indices = indices.wait()
        if op is Average:
            gathered_values = (gathered_values / ranks if gathered_values.is_floating_point()
                               else gathered_values.div(ranks, rounding_mode="trunc"))
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.size())

    return handle
