"""What a compressor remembers between steps, as a plain object that checkpoints can hold.

Error feedback keeps, per gradient bucket, the part of the gradient that was not sent (the
*residual*) and adds it to the next step's gradient; PowerSGD also keeps its Q factors (the
warm start); random-k counts steps (its index draw is seeded by the step). All of it lives
here, keyed by the bucket's *key* (a name the same on every rank: the Horovod collective's
name, ``bucket3``, ``ddp.1.<layout>``) and then by a tensor name. ``state_dict()`` returns
copies, ``load_state_dict()`` takes them back, so a run restored from a state dict continues
bit for bit as the uninterrupted run would (given the same seeds): nothing else is hidden in
the compressor (no global RNG is used; every draw comes from a generator seeded from the
compressor's seed, the key and the step).

**Copy on write, after the round.** A held tensor is never changed in place: a reduction
reads the tensors it needs, computes their successors, and ``put``s them only once its
collectives have all returned. Two things follow, both for elastic training
(``elastic.py``):

- a reduction that a lost peer cuts short leaves the state exactly as it found it (an int8
  residual updated before its alltoall failed would otherwise pay a step that was never
  applied into the redone one);
- ``snapshot()`` costs references, not copies: what it holds can never change under it, so
  an elastic state can take one after every optimizer update (the state a recovery goes on
  from) for free.

``begin()`` returns the number of loads so far; a ``put`` given that number is dropped when a
``load_state_dict`` came in between (a reduction orphaned by a fault that still finishes on
a background thread must not write into the state loaded after it).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CompressorState"]


class CompressorState:
    """Residuals, factors and step counters of one compressor, by bucket key."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        self.loads = 0

    def tensor(self, key: str, name: str, shape: tuple[int, ...],
               init: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor ``name`` of bucket ``key``, made by ``init`` (zeros by default) when it
        is missing or has another shape (the bucket's layout changed: DDP rebuilt its
        buckets, a parameter group was added; an old residual would not fit, so it starts
        again). Read it, never write into it (the module docstring): ``put`` its successor."""
        held = self.tensors.setdefault(key, {})
        t = held.get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            t = init() if init is not None else torch.zeros(shape, dtype=torch.float32)
            held[name] = t
        return t

    def begin(self) -> int:
        """Called by a reduction before it reads the state: the token its ``put``s give."""
        return self.loads

    def put(self, key: str, name: str, value: torch.Tensor, since: int | None = None) -> None:
        """Makes ``value`` the tensor ``name`` of bucket ``key``; dropped when the state was
        loaded after ``since`` (``begin()``)."""
        if since is None or since == self.loads:
            self.tensors.setdefault(key, {})[name] = value

    def step(self, key: str) -> int:
        """This bucket's step number (0 first)."""
        return self.steps.get(key, 0)

    def set_step(self, key: str, step: int, since: int | None = None) -> None:
        """Records this bucket's next step number; dropped as ``put`` is."""
        if since is None or since == self.loads:
            self.steps[key] = step

    def snapshot(self) -> dict:
        """A ``state_dict()`` that shares the tensors instead of copying them (they are never
        changed in place); ``load_state_dict`` copies them when it takes one."""
        return {"steps": dict(self.steps),
                "tensors": {k: dict(held) for k, held in self.tensors.items()}}

    def state_dict(self) -> dict:
        return {"steps": dict(self.steps),
                "tensors": {k: {n: t.clone() for n, t in held.items()}
                            for k, held in self.tensors.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"steps", "tensors"}:
            raise ValueError(f"not a compressor state: keys {sorted(state)}")
        self.steps = {str(k): int(v) for k, v in state["steps"].items()}
        self.tensors = {str(k): {str(n): t.clone() for n, t in held.items()}
                        for k, held in state["tensors"].items()}
        self.loads += 1
