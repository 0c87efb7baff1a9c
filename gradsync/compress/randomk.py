"""Random-k sparsification with error feedback and a shared seed (Stich et al., 2018).

Each step, every rank draws the *same* k of the bucket's N positions from a generator seeded
by the compressor's seed, the bucket's key and the step: nothing about the positions travels.
The k values at those positions (gradient plus residual) go through one float32 allreduce of
k elements; everything else stays in the residual for the next step.

Why random-k and not top-k. Top-k picks each rank's own largest entries, so ranks choose
different positions: the indices must travel (an allgather of n * k index-value pairs, which
grows with the number of ranks and is summed sparsely), and the sum is denser than any one
rank's k. Random-k with a shared seed needs neither: a plain allreduce of k floats, the
same result on every rank. Its price: error feedback drains a random subset, not the largest
entries, so it needs a larger k than top-k for the same progress per step.

Bytes per element of the bucket: k/N * 4 * 2 (n-1)/n on a ring, with k = ceil(ratio * N).
"""

from __future__ import annotations

import math

import torch

from .base import ReducingCompressor, seed_for

__all__ = ["RandomK"]


class RandomK(ReducingCompressor):
    """Random-k with error feedback (module docstring).

    Args:
        ratio: the fraction of each bucket's elements sent per step, in (0, 1].
        seed: seeds the positions (the same on every rank).
        tiers: ``"slowest"`` (default) or ``"all"``, as for ``Int8``.
    """

    def __init__(self, ratio: float = 0.01, seed: int = 0, tiers: str = "slowest"):
        super().__init__(seed, tiers)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def _describe(self) -> str:
        return f"randomk(ratio={self.ratio})"

    def count(self, numel: int) -> int:
        """k for a bucket of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def _reduce(self, x, shapes, comm, key, average):
        numel = x.numel()
        if numel == 0:
            return x
        since = self.state.begin()
        step = self.state.step(key) if key is not None else 0
        g = torch.Generator().manual_seed(seed_for(self.seed, str(key), step))
        chosen = torch.randperm(numel, generator=g)[:self.count(numel)]
        x += self._residual(key, "residual", numel)
        values = x[chosen]
        residual = x.clone()
        residual[chosen] = 0.0  # what was sent leaves the residual
        comm.allreduce_sum_(values)
        if key is not None:  # the allreduce returned: the state moves (state.py)
            self.state.put(key, "residual", residual, since)
            self.state.set_step(key, step + 1, since)
        if average:
            values /= comm.size
        x.zero_()
        x[chosen] = values
        return x
