"""The interface of a compressor that owns its reduction.

``reduce(flat, shapes, comm, key, average)``: ``flat`` is this rank's gradients back to back
(the tensors of ``shapes``, in order), ``comm`` reaches the other ranks, ``key`` names the
bucket (the same on every rank; ``None``: no error feedback, nothing remembered). It returns
a new float32 tensor of ``flat``'s size: the sum over ranks of what each rank *sent* (divided
by the number of ranks with ``average``), identical on every rank. What a rank did not send
stays in its residual (``state``) and is added to its next gradient of the same key, so that
over steps the sum of what was sent follows the sum of the gradients (error feedback: Seide
et al. 2014, Karimireddy et al. 2019).

Tiers. On a Comm that knows its ranks' hosts (``comm.placement()``: the Horovod API's World,
a DDP hook's group), the reduction is tiered (``tiers.py``): float32 inside each host, the
compressor only across hosts (the slowest tier), once per host; ``tiers="all"`` compresses
every rank's gradient on every tier, as on one host.

Every rank must call ``reduce`` for the same keys, with the same shapes, in the same order:
the collectives inside are issued in a fixed order that depends only on those (never on
values, never on timing), which is what lets several buckets share one group.
"""

from __future__ import annotations

import zlib

import torch

from . import tiers as _tiers
from .state import CompressorState

__all__ = ["ReducingCompressor", "seed_for"]


def seed_for(seed: int, key: str, step: int = 0) -> int:
    """A generator seed from the compressor's seed, a bucket key and a step, the same in every
    process (``hash(str)`` is salted per process, so it cannot be used)."""
    return (seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + step) % (1 << 63)


class ReducingCompressor:
    """Base class: holds the state; subclasses implement ``_reduce`` and ``describe``."""

    owns_reduction = True
    """Marks a compressor that replaces the allreduce (the front doors look for it)."""

    shardable = True
    """Element-wise: any slice of the flat tensor can be reduced on its own (``tiers.py``
    gives each rank of a host a block); PowerSGD, which needs whole matrices, is not."""

    def __init__(self, seed: int = 0, tiers: str = "slowest"):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if tiers not in _tiers.TIERS:
            raise ValueError(f"tiers must be one of {', '.join(_tiers.TIERS)}, got {tiers!r}")
        self.seed, self.tiers = seed, tiers
        self.state = CompressorState()

    def describe(self) -> str:
        """The compressor and its settings: what must agree between ranks (``tiers`` too,
        when it is not the default)."""
        return self._describe() + (f"[tiers={self.tiers}]" if self.tiers != "slowest" else "")

    def _describe(self) -> str:
        raise NotImplementedError

    def reduce(self, flat: torch.Tensor, shapes: list, comm, key: str | None,
               average: bool) -> torch.Tensor:
        """See the module docstring."""
        if flat.dim() != 1:
            raise ValueError(f"{self.describe()}: reduce takes a flat tensor, got shape "
                             f"{tuple(flat.shape)}")
        if not flat.dtype.is_floating_point:
            raise TypeError(f"{self.describe()} compresses floating-point gradients, got "
                            f"{flat.dtype}")
        total = sum(_numel(s) for s in shapes)
        if total != flat.numel():
            raise ValueError(f"{self.describe()}: shapes {list(map(tuple, shapes))} hold "
                             f"{total} elements but the flat tensor has {flat.numel()}")
        x = flat.detach().to(torch.float32, copy=True)
        shapes = [tuple(s) for s in shapes]
        tiered = _tiers.reduce(self, x, shapes, comm, key, average)
        return tiered if tiered is not None else self._reduce(x, shapes, comm, key, average)

    def _reduce(self, x: torch.Tensor, shapes: list[tuple], comm, key: str | None,
                average: bool) -> torch.Tensor:
        raise NotImplementedError

    def _residual(self, key: str | None, name: str, numel: int) -> torch.Tensor:
        if key is None:
            return torch.zeros(numel, dtype=torch.float32)
        return self.state.tensor(key, name, (numel,))

    def state_dict(self) -> dict:
        """The compressor's settings and state (copies): ``load_state_dict`` restores it."""
        return {"compressor": self.describe(), "seed": self.seed,
                "state": self.state.state_dict()}

    def snapshot(self) -> dict:
        """``state_dict()`` without the copies (``state.py``: held tensors never change):
        what an elastic state takes after every optimizer update. A subclass that keeps more
        than ``self.state`` (its own ``state_dict``: ``Auto``) gets a copy."""
        if type(self).state_dict is not ReducingCompressor.state_dict:
            return self.state_dict()
        return {"compressor": self.describe(), "seed": self.seed,
                "state": self.state.snapshot()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("compressor") != self.describe() or state.get("seed") != self.seed:
            raise ValueError(f"a state of {state.get('compressor')!r} (seed "
                             f"{state.get('seed')}) cannot be loaded into {self.describe()} "
                             f"(seed {self.seed})")
        self.state.load_state_dict(state["state"])

    def elastic_handler(self, bcast_object=None):
        """The handler an elastic ``State`` uses for this value: its state commits, rolls
        back and is sent to new workers with the model (``elastic.py``)."""
        from .elastic import StateDictHandler

        return StateDictHandler(self, bcast_object, name=f"compressor {self.describe()}")

    def __repr__(self) -> str:
        return self.describe()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
