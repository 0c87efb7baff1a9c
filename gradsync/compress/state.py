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

    def tensor(self, key: str, name: str, shape: tuple[int, ...],
               init: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor ``name`` of bucket ``key``, made by ``init`` (zeros by default) when it
        is missing or has another shape (the bucket's layout changed: DDP rebuilt its
        buckets, a parameter group was added; an old residual would not fit, so it starts
        again)."""
        held = self.tensors.setdefault(key, {})
        t = held.get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            t = init() if init is not None else torch.zeros(shape, dtype=torch.float32)
            held[name] = t
        return t

    def put(self, key: str, name: str, value: torch.Tensor) -> None:
        self.tensors.setdefault(key, {})[name] = value

    def next_step(self, key: str) -> int:
        """This bucket's step number (0 first), counted up."""
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        return step

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
