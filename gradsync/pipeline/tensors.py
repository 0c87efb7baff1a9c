"""Adapters between user tensors (NumPy arrays, torch CPU tensors) and the flat byte-level
arrays the collectives work on.

A ``Buffer`` is a 1-D contiguous NumPy view of the user's data (no copy when the input is
contiguous) plus what is needed to hand a result back in the user's type. bfloat16, which
NumPy lacks, is viewed as int16 and tagged ``BFLOAT16`` so that reducers know what the bits
mean.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..collectives.ops import BFLOAT16

if TYPE_CHECKING:
    import torch

__all__ = ["Buffer", "wrap", "is_torch", "kernel_view"]


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


@dataclass(slots=True)
class Buffer:
    """A flat view of a user tensor.

    Attributes:
        flat: 1-D contiguous NumPy array sharing memory with ``source`` where possible.
        dtype: the NumPy dtype, or ``BFLOAT16``.
        shape: the user's shape.
        source: the user's object.
        copied: True if ``flat`` is a copy (non-contiguous input), so in-place results must be
            written back with ``write_back``.
    """

    flat: np.ndarray
    dtype: np.dtype | str
    shape: tuple
    source: np.ndarray | torch.Tensor
    copied: bool

    @property
    def dtype_name(self) -> str:
        return BFLOAT16 if self.dtype == BFLOAT16 else np.dtype(self.dtype).name

    def describe(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}"

    def write_back(self) -> None:
        """Copies ``flat`` into a non-contiguous source after an in-place operation."""
        if not self.copied:
            return
        source = self.source
        if isinstance(source, np.ndarray):
            source[...] = self.flat.reshape(self.shape)
        else:  # a torch tensor (``wrap`` takes no other source)
            source.copy_(self.to_user(self.flat, self.shape))

    def to_user(self, flat: np.ndarray, shape: tuple):
        """Wraps a result array in the user's type (torch tensor or NumPy array), no copy."""
        if not is_torch(self.source):
            return flat.reshape(shape)
        import torch

        tensor = torch.from_numpy(flat).reshape(shape)
        return tensor.view(torch.bfloat16) if self.dtype == BFLOAT16 else tensor


def wrap(x, *, writable: bool = False) -> Buffer:
    """Returns a Buffer over ``x`` (a NumPy array or a torch CPU tensor).

    Raises:
        TypeError: for other types, GPU tensors (not supported by the CPU transports yet) or
            complex/object dtypes.
    """
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case, kept short
        if writable and not x.flags.writeable:
            raise ValueError("in-place collective on a read-only array")
        if x.dtype.kind not in "biuf":
            raise TypeError(f"collectives take boolean, integer or floating-point data, got "
                            f"{x.dtype}")
        return Buffer(x if x.ndim == 1 else x.reshape(-1), x.dtype, x.shape, x, False)
    if is_torch(x):
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise TypeError(f"gradsync's collectives take CPU tensors; got one on {x.device}")
        t = x.detach()
        copied = not t.is_contiguous()
        if copied:
            t = t.contiguous()
        dtype: np.dtype | str
        if t.dtype == torch.bfloat16:
            flat, dtype = t.view(torch.int16).numpy().reshape(-1), BFLOAT16
        else:
            flat = t.numpy().reshape(-1)
            dtype = flat.dtype
        return _checked(Buffer(flat, dtype, tuple(x.shape), x, copied))
    if isinstance(x, np.ndarray):
        copied = not x.flags.c_contiguous
        if writable and not copied and not x.flags.writeable:
            raise ValueError("in-place collective on a read-only array")
        flat = np.ascontiguousarray(x).reshape(-1)
        return _checked(Buffer(flat, flat.dtype, x.shape, x, copied))
    raise TypeError(f"expected a numpy.ndarray or torch.Tensor, got {type(x).__name__}")


def _checked(buf: Buffer) -> Buffer:
    if buf.dtype != BFLOAT16 and buf.flat.dtype.kind not in "biuf":
        raise TypeError(f"collectives take boolean, integer or floating-point data, got "
                        f"{buf.flat.dtype}")
    return buf


def kernel_view(x) -> "np.ndarray | None":
    """The NumPy view of ``x`` when it is a torch CPU tensor that a prepared allreduce
    (``operations.Prepared``) can take in place: strided, C-contiguous, of the compiled
    kernels' dtypes (float32, float64, int32, int64); None for anything else. Never imports
    torch: a process that has not loaded it has no torch tensor."""
    global _kernel_dtypes
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if _kernel_dtypes is None:
        _kernel_dtypes = frozenset((torch.float32, torch.float64, torch.int32, torch.int64))
    # is_cpu, not device.type: the device object costs ~0.4 µs to make, on every call.
    if (x.dtype not in _kernel_dtypes or not x.is_cpu or x.layout is not torch.strided
            or not x.is_contiguous()):
        return None
    return (x.detach() if x.requires_grad else x).numpy()


_kernel_dtypes: "frozenset | None" = None  # the dtypes of _shmfast.c, as torch names them
