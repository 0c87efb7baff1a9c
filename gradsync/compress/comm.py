"""The three collectives a compressor needs, on a gradsync World or a torch.distributed group.

A compressor sees only this narrow interface (as the collectives see only a transport's
pairs), so the Horovod API, a DDP hook and the tests' in-memory group are interchangeable:

- ``allreduce_sum_(t)``: float32 ``t`` becomes the sum over ranks, in place, the same bytes
  on every rank (PowerSGD's factors, random-k's values, uncompressed small tensors);
- ``alltoall(send)``: ``send`` is ``size`` equal blocks of bytes (uint8), block j for rank j;
  returns ``size`` blocks, block s from rank s (int8's reduce-scatter);
- ``allgather(mine)``: every rank's equal-sized uint8 block, in rank order (int8's
  all-gather).

Each call is one collective issued in program order; a compressor issues them in an order
fixed by its arguments alone, so every rank issues the same sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import operations as ops
from ..collectives import alltoall as _alltoall
from ..collectives import ring
from ..collectives.ops import ReduceOp

__all__ = ["Comm", "WorldComm", "TorchComm"]


class Comm:
    """Interface (see the module docstring)."""

    rank: int
    size: int

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class WorldComm(Comm):
    """On a gradsync World, from the thread that runs the World's collectives (the process
    set's controller runs a compressed allreduce as one operation, ``torch/requests.py``).

    ``name`` prefixes the sub-collectives' descriptions, so ranks that disagree fail at the
    first frame with both names in the report."""

    def __init__(self, world, name: str):
        self.world, self.name = world, name
        self.rank, self.size = world.rank, world.size
        self._calls = 0

    def _next(self, what: str) -> str:
        self._calls += 1
        return f"{self.name} #{self._calls} {what}"

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        flat = t.numpy().reshape(-1)
        ops.allreduce(self.world, flat, flat.dtype, ReduceOp.SUM,
                      name=self._next("allreduce"), shape=flat.shape)

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        n = self.size
        block = send.numel() // n
        out = np.empty(send.numel(), dtype=np.uint8)
        world = self.world
        world.comm.begin(f"compressed alltoall '{self._next('alltoall')}' uint8[{n}x{block}]",
                         world.config.check_collectives)
        if n == 1:
            out[:] = send.numpy()
        else:
            _alltoall.alltoall(world.comm, send.numpy(), [block] * n, out, [block] * n)
        return torch.from_numpy(out)

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        n, block = self.size, mine.numel()
        out = np.empty(n * block, dtype=np.uint8)
        out[self.rank * block:(self.rank + 1) * block] = mine.numpy()
        world = self.world
        world.comm.begin(f"compressed allgather '{self._next('allgather')}' uint8[{n}x{block}]",
                         world.config.check_collectives)
        if n > 1 and block:
            ring.allgather(world.comm, out, [block] * n, world.config.chunk_bytes)
        return torch.from_numpy(out)


class TorchComm(Comm):
    """On a ``torch.distributed`` process group (``None``: the default group), any backend
    that has all_reduce, all_to_all_single and all_gather_into_tensor for CPU tensors (gloo,
    gradsync)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        self.dist.all_reduce(t, group=self.group)

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(send)
        self.dist.all_to_all_single(out, send, group=self.group)
        return out

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.size * mine.numel(), dtype=mine.dtype)
        self.dist.all_gather_into_tensor(out, mine, group=self.group)
        return out
