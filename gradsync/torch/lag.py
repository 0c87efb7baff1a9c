"""Gradient lag: step t's gradients are exchanged while step t + 1 computes, applied one late.

Kurth et al. (SC18, "Exascale deep learning for climate analytics", 27,360 GPUs) hide the
whole gradient exchange behind compute this way: the allreduce of step t's gradients is
started at the end of step t's backward and waited for only at step t + 1's ``step()``, so
it overlaps step t + 1's forward and backward. The update of step t + 1 uses the average of
step t's gradients: SGD with a delay of one step, which they (and the asynchronous-SGD
literature before them) found to converge as the synchronous one at the same learning rate,
at a small cost in stability early on.

``DistributedOptimizer(..., gradient_lag=1)``, round by round on every rank (round r is
one backward and one ``step()``):

    backward r      each bucket, when complete, is copied into one of its two *lag
                    buffers* (round r uses buffer r % 2) and its allreduce starts on that
                    copy, named after the bucket and the buffer, so rounds r - 1 and r can
                    both be in flight;
    step() r        the allreduce of round r - 1 is waited for (it has had all of round
                    r's forward and backward to finish), its result becomes ``p.grad``, and
                    the wrapped optimizer steps on it. Round r's allreduce stays in flight.

First step. At round 0 there is no earlier round: ``synchronize()`` leaves every gradient
that it would have replaced zero and ``step()`` does *not* call the wrapped optimizer (a
step on zero gradients would still move the parameters through momentum and weight decay).
So the wrapped optimizer's step count (and a scheduler stepping with it) runs one behind
the number of ``step()`` calls, and the last round's gradients are never applied.
``load_state_dict`` waits for the rounds in flight and drops them: the next step is a first
step again. In a one-rank job (nothing is exchanged), there is no lag.

Cost: two more copies of the gradients (the lag buffers); the bucket itself is never
reduced in place, so backward of round r + 1 can accumulate into it while round r travels.
Composes with compression: a cast travels and is undone per round; a compressor that owns
its reduction (``Compression.int8`` ...) keeps one error-feedback state per bucket, under
the bucket's name, whichever buffer the round used (the rounds run in order on the set's
controller, so its state is never touched by two at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..pipeline.engine import Handle

__all__ = ["BucketLag"]


class BucketLag:
    """One bucket's lag buffers and the rounds in flight (at most two: r - 1 and r)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffers = (torch.empty_like(buffer), torch.empty_like(buffer))
        self.launched = 0
        # (handle, result) per round in flight, oldest first; ``result()`` is the reduced
        # gradients once the handle is waited for.
        self.flights: list[tuple[Handle, Callable[[], torch.Tensor]]] = []

    def source(self, bucket_buffer: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This round's copy of the bucket's gradients and its buffer number (0 or 1)."""
        which = self.launched % 2
        buffer = self.buffers[which]
        buffer.copy_(bucket_buffer)
        self.launched += 1
        return buffer, which

    def started(self, handle: Handle, result: Callable[[], torch.Tensor]) -> None:
        self.flights.append((handle, result))

    def land(self) -> torch.Tensor | None:
        """The previous round's reduced gradients (waited for now), or None in the first
        round (nothing before it)."""
        if len(self.flights) < 2:
            return None
        handle, result = self.flights.pop(0)
        handle.wait()
        return result()

    def drop(self) -> None:
        """Waits for every round in flight and forgets them (``load_state_dict``)."""
        for handle, _ in self.flights:
            handle.wait()
        self.flights.clear()
