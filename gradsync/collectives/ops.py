"""Reduction operators and the element-wise kernels the algorithms call.

Algorithms move raw bytes; the only place that knows what the bytes mean is a ``Reducer``:
``reducer(dst, src)`` folds ``src`` into ``dst`` in place, both NumPy arrays of the same
length. NumPy has no bfloat16, so bfloat16 data travels as ``uint16`` arrays and its reducer
reinterprets them as torch bfloat16 tensors (zero-copy) for the arithmetic.

The arithmetic after a reduction lives here too: ``scale`` (an Average's division, a
pre- or postscale factor) and ``finisher``, the callable an algorithm applies to each block
it has finished reducing, so that an algorithm that scales while the block is in cache calls
nothing above its own floor.
"""

from __future__ import annotations

import enum
from typing import Callable

import numpy as np
import numpy.typing as npt

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "Reducer",
           "make_reducer", "reducer", "scale", "finisher", "BFLOAT16"]

BFLOAT16 = "bfloat16"
"""Dtype tag of bfloat16 data, which NumPy carries as uint16."""


class ReduceOp(enum.Enum):
    """How allreduce combines the ranks' values. ``Average`` is ``Sum`` then divide by size.

    ``ADASUM`` (allreduce of floating-point tensors only) is not element-wise: it has no
    reducer, and ``operations.allreduce`` hands it to ``adasum.allreduce``.
    """

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    def __repr__(self) -> str:
        return f"gradsync.{self.name.capitalize()}"


Sum, Average, Min, Max, Product = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)
Adasum = ReduceOp.ADASUM

Reducer = Callable[[np.ndarray, np.ndarray], None]

_NUMPY_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,  # the division happens once, after the reduction
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def _in_place(ufunc: np.ufunc) -> Reducer:
    """The reducer that applies the binary ``ufunc`` with ``dst`` as its output."""
    def reduce(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    return reduce


def _bool_kernel(op: ReduceOp) -> Reducer:
    # On booleans SUM/AVERAGE/MAX are "any" and PRODUCT/MIN are "all", as in torch.distributed.
    ufunc = np.logical_or if op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX) else np.logical_and
    return _in_place(ufunc)


def _torch_kernel(op: ReduceOp, dtype) -> Reducer:
    import torch

    kernels: dict[ReduceOp, Callable[..., torch.Tensor]] = {
        ReduceOp.SUM: torch.add, ReduceOp.AVERAGE: torch.add, ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum, ReduceOp.PRODUCT: torch.mul,
    }
    fn = kernels[op]

    def reduce(dst: np.ndarray, src: np.ndarray) -> None:
        d = torch.from_numpy(dst).view(dtype)
        fn(d, torch.from_numpy(src).view(dtype), out=d)

    return reduce


def make_reducer(op: ReduceOp, dtype: npt.DTypeLike) -> Reducer:
    """Returns the in-place kernel ``reducer(dst, src)`` for ``op`` on ``dtype``.

    ``dtype`` is a NumPy dtype or ``BFLOAT16``. Float16 goes through torch, whose CPU kernels
    are vectorised, where NumPy's emulate half precision one element at a time.
    """
    if op is ReduceOp.ADASUM:
        raise ValueError("Adasum is not an element-wise reduction: it has no reducer "
                         "(allreduce runs it through collectives/adasum.py)")
    if dtype == BFLOAT16:
        import torch
        return _torch_kernel(op, torch.bfloat16)
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        import torch
        return _torch_kernel(op, torch.float16)
    if dtype == np.bool_:
        return _bool_kernel(op)
    return _in_place(_NUMPY_UFUNCS[op])


_reducers: dict[tuple[ReduceOp, object], Reducer] = {}


def reducer(op: ReduceOp, dtype) -> Reducer:
    """``make_reducer``, made once per (op, dtype) and kept."""
    found = _reducers.get((op, dtype))
    if found is None:
        found = _reducers[op, dtype] = make_reducer(op, dtype)
    return found


def scale(flat: np.ndarray, dtype, factor: float, divide: bool = False,
          trunc: bool = False) -> None:
    """Multiplies (or divides) ``flat`` by ``factor`` in place, in its own dtype.

    An integer division rounds toward minus infinity (``floor_divide``, as ``torch.distributed``
    does), or toward zero with ``trunc`` (as Horovod's C++ does: -75 / 2 is -37, not -38)."""
    if dtype == BFLOAT16 or flat.dtype == np.float16:
        import torch

        t = torch.from_numpy(flat)
        if dtype == BFLOAT16:
            t = t.view(torch.bfloat16)
        t.div_(factor) if divide else t.mul_(factor)
    elif flat.dtype.kind == "f":
        np.divide(flat, factor, out=flat) if divide else np.multiply(flat, factor, out=flat)
    elif divide:
        divisor = flat.dtype.type(factor)
        inexact = np.remainder(flat, divisor) != 0 if trunc else None
        np.floor_divide(flat, divisor, out=flat)
        if inexact is not None:  # trunc: a negative quotient that was rounded down moves up by one
            flat += inexact & (flat < 0)
    else:
        np.multiply(flat, factor, out=flat, casting="unsafe")


def finisher(dtype, divisor: int, trunc: bool = False,
             postscale: float = 1.0) -> "Callable[[np.ndarray], None] | None":
    """What an allreduce does to each reduced block: divide by ``divisor`` (an Average over
    that many ranks; 0: no division, rounding as ``trunc`` says), then multiply by
    ``postscale``. None when there is nothing to do."""
    if not divisor and postscale == 1.0:
        return None

    def finish(part: np.ndarray) -> None:
        if divisor:
            scale(part, dtype, divisor, divide=True, trunc=trunc)
        if postscale != 1.0:
            scale(part, dtype, postscale)

    return finish
