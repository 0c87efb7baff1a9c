"""ElasticSampler: every sample of an epoch seen once, whatever the job's size does.

The sampler thinks of an epoch as one permutation ``P`` of the dataset (seeded by
``seed + epoch``, so the same on every rank) consumed from the front. ``processed`` counts the
samples of ``P`` the *job* has consumed this epoch; it is the same number on every rank, so
rank 0's copy is the truth that ``sync()`` broadcasts. A pass (one ``iter()``) splits what is
left, ``P[processed:]``, into *steps* of ``size × batch_size`` samples; in each step rank r
takes the r-th run of ``batch_size``. After ``k`` recorded batches the job has consumed exactly
the first ``k × size × batch_size`` samples of what was left, so a resize (a new pass with the
new size over the new ``P[processed:]``) neither skips nor repeats any sample.

Example, 10 samples, batch 2, 2 ranks, ``P = [7 3 0 9 4 1 8 2 6 5]``: rank 0 gets 7 3 | 4 1 | 6,
rank 1 gets 0 9 | 8 2 | 5. After one recorded batch ``processed = 4``; a worker dies, one rank
is left: it takes ``4 1 8 2 6 5`` in batches of 2. Samples 7, 3, 0, 9 are not seen again.

The last step of a pass may hold fewer than ``size × batch_size`` samples; it is split as
evenly as possible and, so that every rank runs the same number of batches, ranks left one
short take one sample from the start of ``P`` again (at most ``size - 1`` repeats per pass, as
``torch.utils.data.DistributedSampler`` pads).

Record progress with ``record_batch(batch_idx, batch_size)`` after each batch (or before each
``commit()``); ``set_epoch(epoch)`` starts the next epoch.
"""

from __future__ import annotations

import math

import torch

from ... import api as gs

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Sampler for elastic jobs (see the module docstring).

    Args:
        dataset: anything with ``len()``.
        shuffle: permute the samples every epoch (else ``P`` is ``0 .. n-1``).
        seed: base of the permutation's seed (``seed + epoch``).
        batch_size: samples per batch on each rank: the ``batch_size`` of the DataLoader
            built over this sampler.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, batch_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.batch_size = batch_size
        self.epoch = 0
        self.processed = 0
        self._pass_start = 0
        self._size = 1

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: a new permutation, nothing processed."""
        self.epoch, self.processed, self._pass_start = epoch, 0, 0

    def record_batch(self, batch_idx: int, batch_size: int | None = None) -> None:
        """Records that batches ``0 .. batch_idx`` of the current pass are done on every rank."""
        step = (batch_size or self.batch_size) * self._size
        left = len(self.dataset) - self._pass_start
        self.processed = self._pass_start + min(left, (batch_idx + 1) * step)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed, self.seed = state["epoch"], state["processed"], state["seed"]
        self._pass_start = self.processed

    def remaining(self) -> tuple[list[int], list[int]]:
        """``(P[processed:], P)``: what the job has not consumed this epoch, and ``P``."""
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        return order[self.processed:], order

    def _mine(self) -> list[int]:
        rank, size = (gs.rank(), gs.size()) if gs.is_initialized() else (0, 1)
        self._size, self._pass_start = size, self.processed
        left, order = self.remaining()
        b, step = self.batch_size, self.batch_size * size
        full = len(left) // step
        mine = [i for k in range(full) for i in left[k * step + rank * b:k * step + (rank + 1) * b]]
        tail = left[full * step:]
        if tail:
            per = math.ceil(len(tail) / size)
            q, extra = divmod(len(tail), size)
            start = rank * q + min(rank, extra)
            share = tail[start:start + q + (1 if rank < extra else 0)]
            mine += share + order[:per - len(share)]  # pad from the front of P
        return mine

    def __iter__(self):
        return iter(self._mine())

    def __len__(self) -> int:
        size = gs.size() if gs.is_initialized() else 1
        left = len(self.dataset) - self.processed
        step = self.batch_size * size
        full = left // step
        return full * self.batch_size + math.ceil((left - full * step) / size)
