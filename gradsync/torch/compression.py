"""Gradient compression: a tiny strategy applied around an allreduce, or one that replaces it.

Two kinds, one argument (``compression=`` of ``DistributedOptimizer``, ``allreduce`` and
``grouped_allreduce``):

- *around* the allreduce (Horovod's interface): ``compress(tensor)`` returns the tensor to
  put on the wire and a context; after the allreduce, ``decompress(wire_tensor, context)``
  turns the result back into the caller's dtype. The built-in ones are casts (fp16, bf16),
  so they are element-wise: compressing a fused gradient bucket is the same as compressing
  each gradient in it. A user-defined compressor only has to keep the same two static (or
  class) methods, as in Horovod.
- *instead of* the allreduce (``gradsync/compress/``: ``int8``, ``int4``, ``fp8``, ``powersgd``,
  ``randomk``): an int8 sum would overflow, PowerSGD orthogonalises between two reductions,
  random-k must pick the same positions on every rank; so these own their reduction
  (``reduce``, marked ``owns_reduction``) and keep error-feedback state between steps. Pass
  the class for the defaults (``Compression.int8``) or an instance for settings, and keep
  the instance to save its state: ``c = Compression.powersgd(rank=4)``, then
  ``c.state_dict()``. docs/slow-links.md says what each sends.
- ``"auto"`` (or ``Compression.auto``, an instance for settings): per bucket, none, bf16,
  int8, int4 or PowerSGD, chosen from the measured link and step
  (``gradsync/compress/auto.py``); it owns its reduction too. The collectives (``allreduce``) need an instance kept across
  calls: a new one per call never gets past its calibration (none). ``Compression.auto(
  local_sgd=H)`` (or ``DistributedOptimizer(..., local_sgd=H)``) lets it choose local SGD
  too, which ``DistributedOptimizer`` runs (``gradsync/compress/auto_local.py``).

What a cast costs and buys: half the bytes on every link, one extra pass over the data on each
side, and the reduction itself in 16 bits (each rank's contribution is rounded before the
sum). bf16 keeps float32's range (no overflow of large gradients) with 8 bits of mantissa;
fp16 has 11 bits of mantissa but overflows above 65504.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compress import FP8, Auto, Int4, Int8, PowerSGD, RandomK, ReducingCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
           "reducing"]


class Compressor:
    """Interface: ``compress`` returns ``(wire_tensor, ctx)``; ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The default: the tensor goes on the wire unchanged (no copy)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype``; other dtypes travel unchanged."""

    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The built-in compressors, by Horovod's names: ``none``, ``fp16``; plus ``bf16``, and
    those that replace the allreduce: ``int8``, ``int4``, ``fp8``, ``powersgd``, ``randomk``, and
    ``auto`` (the choice among none, bf16 with error feedback, int8 and PowerSGD)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = Int8
    int4 = Int4
    fp8 = FP8
    powersgd = PowerSGD
    randomk = RandomK
    auto = Auto


def reducing(compression) -> ReducingCompressor | None:
    """The compressor instance if ``compression`` owns its reduction (a class is
    instantiated with its defaults, the string ``"auto"`` is ``Auto()``), else None (a
    Horovod-style compress/decompress pair)."""
    if isinstance(compression, str):
        if compression != "auto":
            raise ValueError(f"compression={compression!r}: the only name taken is 'auto'; "
                             "pass a compressor (hvd.Compression.int8, ...) otherwise")
        return Auto()
    if isinstance(compression, type) and issubclass(compression, ReducingCompressor):
        return compression()
    if getattr(compression, "owns_reduction", False):
        return compression
    return None
