"""How the backend hands torch tensors to gradsync's operations, which work on flat NumPy arrays.

Data movement (broadcast, gathers, all-to-all, point-to-point) only copies bytes, so it takes
every dtype torch has, float8 and complex included, as a flat ``uint8`` view. Reductions need
to know what the bytes mean: the dtypes gradsync's reducers know (floating point, bfloat16,
integers, bool) go to them directly; complex numbers are summed as pairs of reals; what no
reducer covers (bitwise ops, a complex product) is gathered and folded locally with torch's
own kernels (``fold``), which is exact and, for these rare ops, cheap enough.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from ...collectives.ops import BFLOAT16, ReduceOp

__all__ = ["contiguous", "as_bytes", "typed", "Reduction", "reduction_of", "fold"]

# The members are read through ReduceOp (ReduceOp.SUM is RedOpType.SUM): torch's stubs
# declare them on ReduceOp and give RedOpType none.
RedOpType = dist.ReduceOp.RedOpType

_DIRECT = {dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVERAGE,
           dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT, dist.ReduceOp.MIN: ReduceOp.MIN,
           dist.ReduceOp.MAX: ReduceOp.MAX, dist.ReduceOp.PREMUL_SUM: ReduceOp.SUM}
_BITWISE = {dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
            dist.ReduceOp.BXOR: torch.bitwise_xor}
_FLOAT8 = {getattr(torch, name) for name in dir(torch) if name.startswith("float8_")}


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy (to be copied back into ``t``)."""
    if not t.is_cpu:  # (not ``t.device.type``: a device object made per call, 0.8 us)
        raise ValueError(f"the gradsync backend takes CPU tensors; got one on {t.device}")
    return t if t.is_contiguous() else t.contiguous()


class _Memory:
    """Exposes a contiguous tensor's memory to NumPy and keeps the tensor alive meanwhile.

    ``Tensor.numpy()`` would also share the memory, but it marks the tensor's storage as not
    resizable for good, and FSDP frees its unsharded parameters by resizing their storage to
    zero after the all-gather that filled them.
    """

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, t: torch.Tensor, typestr: str, count: int):
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (count,),
                                    "typestr": typestr, "version": 3}


def _view(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError("internal: a NumPy view needs a contiguous tensor")
    count = t.numel() * t.element_size() // dtype.itemsize
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.asarray(_Memory(t, dtype.str, count))


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 NumPy view of contiguous ``t`` (any dtype), sharing its memory."""
    return _view(t, np.dtype(np.uint8))


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.bfloat16: np.int16, torch.bool: np.bool_, torch.int8: np.int8,
          torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
          torch.uint8: np.uint8, torch.uint16: np.uint16, torch.uint32: np.uint32,
          torch.uint64: np.uint64}


class Reduction:
    """How one reduction runs: through gradsync's reducers or by gathering and folding.

    Attributes:
        op: gradsync's ReduceOp, or None when the reduction must be folded locally.
        prescale: PREMUL_SUM's factor (1.0 otherwise).
        fold_fn: for folded reductions, ``fn(stacked) -> reduced`` over dimension 0.
        name: torch's name of the op, for messages.
    """

    def __init__(self, op, prescale, fold_fn, name):
        self.op, self.prescale, self.fold_fn, self.name = op, prescale, fold_fn, name

    def flat(self, t: torch.Tensor):
        """``(flat, dtype)`` of contiguous ``t`` for gradsync's reducers (complex as reals)."""
        if t.is_complex():
            t = torch.view_as_real(t)
        flat = _view(t, np.dtype(_NUMPY[t.dtype]))
        return flat, (BFLOAT16 if t.dtype == torch.bfloat16 else flat.dtype)


_cache: dict = {}
_PREMUL_SUM = dist.ReduceOp.PREMUL_SUM.value  # ``reduction_of``'s key is the op's number


def reduction_of(opts_op, dtype: torch.dtype) -> Reduction:
    """The Reduction for a torch ``ReduceOp`` on ``dtype`` (cached; see ``_reduction_of``).

    Keyed by the op's number: comparing and hashing torch's op objects (pybind11 enums) took
    most of the 2.5 us this cost on every collective."""
    kind = opts_op if isinstance(opts_op, RedOpType) else opts_op.op
    code = kind.value
    if code == _PREMUL_SUM:  # carries its factor: not cached
        return _reduction_of(opts_op, dtype)
    key = (code, dtype)
    red = _cache.get(key)
    if red is None:
        red = _cache[key] = _reduction_of(opts_op, dtype)
    return red


def _reduction_of(opts_op, dtype: torch.dtype) -> Reduction:
    """The Reduction for a torch ``ReduceOp`` (or its ``RedOpType``) on ``dtype``.

    Raises:
        ValueError: an op that does not apply to ``dtype`` (bitwise ops on floating point,
            MIN/MAX on complex), or any reduction of a float8 dtype (torch has no CPU
            arithmetic for them).
    """
    kind = opts_op if isinstance(opts_op, RedOpType) else opts_op.op
    name = str(kind).split(".")[-1]
    if dtype in _FLOAT8:
        raise ValueError(f"the gradsync backend cannot reduce {dtype} tensors (no CPU "
                         f"arithmetic for them); broadcasts, gathers and all-to-all work")
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise ValueError(f"ReduceOp.{name} needs an integer or bool tensor, got {dtype}")
        return Reduction(None, 1.0, functools.partial(_fold_bitwise, _BITWISE[kind]), name)
    if kind not in _DIRECT:
        raise ValueError(f"the gradsync backend does not know ReduceOp {opts_op!r}")
    prescale = 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(opts_op, "factor", None)
        if factor is None:
            raise ValueError("ReduceOp.PREMUL_SUM needs its factor: build the op with "
                             "torch.distributed._make_nccl_premul_sum(factor)")
        prescale = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    if dtype.is_complex and kind in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        raise ValueError(f"ReduceOp.{name} is not defined on complex tensors ({dtype})")
    if dtype.is_complex and kind == dist.ReduceOp.PRODUCT:
        return Reduction(None, 1.0, lambda stacked: torch.prod(stacked, dim=0), name)
    return Reduction(_DIRECT[kind], prescale, None, name)


def _fold_bitwise(fn, stacked: torch.Tensor) -> torch.Tensor:
    return functools.reduce(fn, stacked.unbind(0))


def fold(reduction: Reduction, gathered: np.ndarray, t: torch.Tensor, size: int) -> torch.Tensor:
    """Reduces every rank's copy of ``t`` (``gathered``: their bytes, rank after rank)."""
    return reduction.fold_fn(typed(gathered, t.dtype).reshape(size, *t.shape))


def typed(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``data`` (1-D uint8) as a 1-D tensor of ``dtype``, sharing memory."""
    if data.size == 0:  # torch cannot reinterpret an empty array (its stride is 0)
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(data).view(dtype)
