"""Parameter and optimizer-state broadcast, and the object collectives, as in Horovod.

Broadcasts of many tensors are fused: per dtype, in the order given, tensors are packed into
flat buffers of at most ``fusion_threshold`` bytes (a tensor alone in its buffer is broadcast in
place, without a copy). A model with hundreds of small parameters then costs a few broadcasts,
not hundreds. The packing depends only on shapes and dtypes, which every rank must share, so it
is the same everywhere.

``broadcast_optimizer_state`` sends the root's ``state_dict()`` in two parts: its structure,
with each tensor replaced by its shape and dtype (one small pickled object), then the tensors,
fused as above, into tensors the other ranks allocate from that structure before
``load_state_dict``. So it also works when only the root has state (a checkpoint loaded on rank
0 before the first step) without the zero-gradient step Horovod takes to create state, and for
any optimizer, LBFGS included. As in Horovod, an optimizer without state leaves with zero
gradients on its trainable parameters that had none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from .. import api as gs
from ..pipeline import arguments
from .buckets import fusion_threshold, plan_buckets
from . import requests as _requests
from .mpi_ops import ProcessSet, _check_process_set, _cpu, global_process_set

if TYPE_CHECKING:
    from ..pipeline.engine import Handle

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params: dict[str, torch.Tensor] | Iterable, root_rank: int) -> None:
    """Copies root_rank's tensors into every rank's tensors, in place.

    Args:
        params: a dict of tensors (``model.state_dict()``; broadcast in sorted key order) or an
            iterable of tensors or ``(name, tensor)`` pairs (``model.parameters()``,
            ``model.named_parameters()``), the same on every rank.
        root_rank: the rank whose values everyone gets.
    """
    items = sorted(params.items()) if isinstance(params, dict) else [
        p if isinstance(p, tuple) else (None, p) for p in params]
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {name!r} is a {type(t).__name__}, "
                            "not a tensor")
        _cpu(t, "broadcast_parameters")
    _broadcast_fused([t for _, t in items], root_rank, "broadcast_parameters")


@dataclass(frozen=True)
class _TensorSpec:
    """Stands for a tensor in the structure of a state dict sent ahead of the tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Makes every rank's optimizer state (and hyperparameters) a copy of root_rank's.

    Args:
        optimizer: a torch optimizer or a DistributedOptimizer, over the same parameters on
            every rank.
        root_rank: the rank whose state everyone gets.
    """
    if not optimizer.state:
        # As in Horovod, a new optimizer's trainable parameters get zero gradients (Horovod
        # then steps on them to create state; gradsync sends the root's state as it is).
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    is_root = gs.rank() == root_rank
    tensors: list[torch.Tensor] = []
    structure = _strip(optimizer.state_dict(), tensors) if is_root else None
    structure = gs.broadcast_object(structure, root_rank, name="broadcast_optimizer_state")
    if not is_root:
        tensors = []
        state_dict = _rebuild(structure, tensors)
    _broadcast_fused(tensors, root_rank, "broadcast_optimizer_state")
    if not is_root:
        # load_state_dict replaces param_groups and state with new objects; put the contents
        # back into the old ones, which a wrapped optimizer and any LR scheduler built on it
        # still hold (otherwise a scheduler would change an lr that nothing reads any more,
        # and ranks would drift apart without an error).
        groups, state = optimizer.param_groups, optimizer.state
        optimizer.load_state_dict(state_dict)
        for old, new in zip(groups, optimizer.param_groups):
            old.clear()
            old.update(new)
        state.clear()
        state.update(optimizer.state)
        optimizer.param_groups, optimizer.state = groups, state


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns root_rank's ``obj`` (any picklable object) on every rank."""
    if process_set is global_process_set:
        _check_process_set(process_set)
        return gs.broadcast_object(obj, root_rank, name=name)
    return _requests.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Returns the list of every rank's ``obj`` (any picklable object), in rank order."""
    if process_set is global_process_set:
        _check_process_set(process_set)
        return gs.allgather_object(obj, name=name)
    return _requests.allgather_object(obj, name, process_set)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a _TensorSpec; the tensors go to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(_cpu(obj, "broadcast_optimizer_state"))
        return _TensorSpec(tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Undoes ``_strip`` with new, uninitialised tensors, appended to ``tensors`` in order."""
    if isinstance(obj, _TensorSpec):
        tensors.append(torch.empty(obj.shape, dtype=obj.dtype))
        return tensors[-1]
    if isinstance(obj, dict):
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, tensors) for v in obj)
    return obj


def _broadcast_fused(tensors: list[torch.Tensor], root_rank: int, name: str) -> None:
    """Broadcasts ``tensors`` in place, packed per dtype into buffers of fusion_threshold."""
    arguments.root_index(root_rank, range(gs.size()))
    is_root = gs.rank() == root_rank
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.detach())
    # (handle, the flat buffer of several tensors or None for one, the tensors it holds)
    in_flight: list[tuple[Handle, torch.Tensor | None, list[torch.Tensor]]] = []
    for dtype, group in by_dtype.items():
        sizes = [t.numel() * t.element_size() for t in group]
        for k, members in enumerate(plan_buckets(sizes, [dtype] * len(group), fusion_threshold())):
            part = [group[i] for i in members]
            label = f"{name}.{str(dtype).removeprefix('torch.')}.{k}"
            if len(part) == 1:
                in_flight.append((gs.broadcast_async_(part[0], root_rank, name=label), None, []))
                continue
            flat = (torch.cat([t.reshape(-1) for t in part]) if is_root else
                    torch.empty(sum(t.numel() for t in part), dtype=dtype))
            in_flight.append((gs.broadcast_async_(flat, root_rank, name=label), flat, part))
    for handle, buffer, part in in_flight:
        handle.wait()
        if buffer is not None and not is_root:
            for t, piece in zip(part, buffer.split([t.numel() for t in part])):
                t.copy_(piece.view(t.shape))
