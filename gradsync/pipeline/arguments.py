"""A collective's arguments checked, and its result handed back: once, for both APIs.

gradsync has two front doors to the same collectives: the NumPy API (``api.py``, operations
in issue order on the job's World) and the Horovod API (``torch/requests.py``, operations
matched by name on a process set's World). Both take a caller's tensor and arguments, check
them before anything is exchanged, and turn the flat result back into the caller's tensor.
Those steps live here, below both, so the two doors accept and reject the same calls with the
same errors: a call is checked before it is announced, so no rank fails on its own in the
middle of a collective.

Vocabulary: ``buf`` is the caller's tensor wrapped (``tensors.wrap``): a flat NumPy view
``buf.flat`` and what is needed to hand a result back; ``target`` is the flat array a
collective writes its result into (``buf.flat`` itself in place, a copy otherwise).
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np

from ..collectives.ops import BFLOAT16, ReduceOp
from .tensors import Buffer, is_torch

__all__ = ["adasum_dtype", "reduce_op", "rows", "send_counts", "root_index", "target",
           "result", "row_result", "received_splits"]


def adasum_dtype(dtype) -> bool:
    """True for the dtypes (as ``wrap`` reports them) that Adasum combines: the floats."""
    return dtype == BFLOAT16 if isinstance(dtype, str) else np.dtype(dtype).kind == "f"


def reduce_op(op, dtype=None) -> ReduceOp:
    """Validates ``op``; ``dtype`` is given for allreduce, the one collective Adasum runs.

    Raises:
        TypeError: ``op`` is not a ReduceOp, or Adasum on a tensor that is not floating point.
        ValueError: Adasum for a collective other than allreduce.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be one of gradsync.Sum, Average, Min, Max, Product, Adasum; "
                        f"got {op!r}")
    if op is ReduceOp.ADASUM:
        if dtype is None:
            raise ValueError("op=Adasum is supported by allreduce only (as in Horovod)")
        if not adasum_dtype(dtype):
            raise TypeError(f"op=Adasum needs a floating-point tensor (float16, bfloat16, "
                            f"float32, float64), got {dtype}")
    return op


def rows(buf: Buffer, kind: str) -> int:
    """The size of dimension 0, which allgather, reducescatter and alltoall split or join.

    Raises:
        ValueError: the tensor is a scalar.
    """
    if not buf.shape:
        raise ValueError(f"{kind} needs a tensor of at least one dimension")
    return buf.shape[0]


def send_counts(splits, rows: int, n: int) -> list[int]:
    """The rows an alltoall sends to each of the ``n`` ranks.

    Args:
        splits: None (``rows`` divided equally), or one integer per rank: a sequence, a NumPy
            array or a torch tensor. Every entry must be an integer (``operator.index``): a
            float entry, even a whole one, is a mistake and is not rounded.
        rows: the size of the tensor's dimension 0.
        n: the number of ranks taking part.

    Raises:
        ValueError: the rows do not divide equally, or ``splits`` holds a non-integer, has
            the wrong length, a negative entry or a sum other than ``rows``.
    """
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs dimension 0 ({rows}) divisible by "
                             f"the number of ranks ({n})")
        return [rows // n] * n
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    try:
        send = [operator.index(s) for s in values]
    except TypeError:
        got = splits.dtype if hasattr(splits, "dtype") else repr(splits)
        raise ValueError(f"splits must hold integers, got {got}") from None
    if len(send) != n or min(send) < 0 or sum(send) != rows:
        raise ValueError(f"splits {send} must have one non-negative entry per rank "
                         f"({n}) summing to dimension 0 ({rows})")
    return send


def root_index(root_rank, ranks: Sequence[int], members: str | None = None) -> int:
    """The position in ``ranks`` of global rank ``root_rank`` (a broadcast's root).

    Args:
        root_rank: a global rank, as in Horovod.
        ranks: the global ranks taking part (``range(size)`` for the whole job).
        members: names the process set in the error; None for the whole job.

    Raises:
        ValueError: ``root_rank`` is not one of ``ranks``.
    """
    if root_rank not in ranks:
        if members is None:
            raise ValueError(f"root_rank {root_rank} is outside 0..{len(ranks) - 1}")
        raise ValueError(f"root_rank {root_rank} is not a rank of {members} "
                         f"(ranks {list(ranks)})")
    return ranks.index(root_rank)


def target(buf: Buffer, inplace: bool) -> np.ndarray:
    """The flat array the collective writes into: the caller's own memory in place, else a
    copy (the input stays untouched)."""
    return buf.flat if inplace else buf.flat.copy()


def result(buf: Buffer, target: np.ndarray, tensor, inplace: bool):
    """What an allreduce or broadcast returns once ``target`` holds the result.

    In place, ``tensor`` itself, after ``write_back`` (a no-op unless ``wrap`` had to work
    on a contiguous copy); otherwise a new tensor of the caller's kind and shape.
    """
    if inplace:
        buf.write_back()
        return tensor
    return buf.to_user(target, buf.shape)


def row_result(buf: Buffer, flat: np.ndarray, rows: int):
    """What an allgather, reducescatter or alltoall returns: a new tensor of the caller's
    kind holding ``flat`` as ``rows`` rows shaped like the input's."""
    return buf.to_user(flat, (rows,) + tuple(buf.shape[1:]))


def received_splits(received: list[int], like):
    """An alltoall's received row counts, as int32 of the kind of ``like`` (NumPy or torch)."""
    counts = np.asarray(received, dtype=np.int32)
    if is_torch(like):
        import torch

        return torch.from_numpy(counts)
    return counts
