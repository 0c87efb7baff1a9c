"""LARS and LARC: layer-wise adaptive rate scaling around any torch optimizer.

Many workers mean a large global batch, and a large batch wants a large learning rate,
which some layers cannot take: where a layer's gradient is large next to its weights, one
step at the global rate overshoots, while elsewhere the same rate barely moves the weights.
LARS (You, Gitman and Ginsburg, 2017) gives each layer (each parameter tensor) its own
*local* rate, from the ratio of its weights' norm to its gradient's norm:

    local = trust * ||w|| / (||g|| + weight_decay * ||w|| + eps)
    g    <- local * (g + weight_decay * w)       (then the wrapped optimizer's step at lr)

so that every layer's step is about ``lr * trust`` of its weights, whatever its gradient's
scale. LARC (as Kurth et al. used it at 27,360 GPUs) *clips* instead of scaling: the rate a
layer gets is the smaller of the global one and its trust-based one,

    local = min(trust * ||w|| / (||g|| + weight_decay * ||w|| + eps) / lr, 1)

so a layer is only ever slowed down, never sped up past ``lr``. A tensor whose weights or
gradient are all zeros (a fresh bias, an unused embedding) keeps local = 1.

Weight decay is folded into the gradient before the scaling (L2, as ``torch.optim.SGD``
does it) and the wrapped optimizer steps with its groups' ``weight_decay`` at zero for that
call, so it is applied once. Excluded tensors (by default every tensor of one dimension:
biases and the norms' weights, as You et al. and Goyal et al. exclude them) keep local = 1
and their group's weight decay; put them in a group with ``weight_decay=0`` to exclude them
from decay as well.

Order with the gradient exchange: ``DistributedOptimizer(LARS(SGD(...)))``, so the norms
are those of the averaged gradients, identical on every rank. (``LARS`` around a
``DistributedOptimizer`` synchronizes it first, for the same reason.)

Example, with the linear scaling and warm-up of Goyal et al. (torch's schedulers, nothing
of ours)::

    base = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9,
                           weight_decay=5e-4)
    opt = hvd.DistributedOptimizer(LARS(base, trust=0.001, clip=True),
                                   named_parameters=model.named_parameters())
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / hvd.size(),
                                               total_iters=5 * steps_per_epoch)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["LARS"]


def _one_dimensional(param: torch.Tensor) -> bool:
    return param.dim() <= 1


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rates around ``optimizer`` (module docstring).

    Shares the wrapped optimizer's ``param_groups``, ``state`` and ``defaults``, so its
    ``state_dict`` and an LR scheduler on it are the wrapped optimizer's.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (usually SGD with momentum).
        trust: the trust coefficient (You et al.'s eta; 0.001 in their ImageNet runs).
        clip: False: LARS (scale the rate); True: LARC (clip it at the group's ``lr``).
        eps: added to the denominator.
        exclude: ``exclude(param)`` True keeps the group's plain rate for that tensor
            (default: tensors of one dimension, biases and norms); None: exclude nothing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust: float = 0.001,
                 clip: bool = False, eps: float = 1e-8,
                 exclude: Callable[[torch.Tensor], bool] | None = _one_dimensional):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARS wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not trust > 0:
            raise ValueError(f"trust must be positive, got {trust!r}")
        if not eps >= 0:
            raise ValueError(f"eps must not be negative, got {eps!r}")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # The very same objects: a scheduler, a checkpoint or add_param_group on either
        # one is seen by both.
        self.param_groups, self.state = optimizer.param_groups, optimizer.state
        self.optimizer = optimizer
        self.trust, self.clip, self.eps = float(trust), bool(clip), float(eps)
        self.exclude = exclude

    def __repr__(self) -> str:
        kind = "LARC" if self.clip else "LARS"
        return f"{kind}(trust={self.trust}, {self.optimizer!r})"

    @torch.no_grad()
    def local_rates(self) -> dict[torch.Tensor, float]:
        """The factor each adapted tensor's gradient is multiplied by at the next step
        (after its weight decay is folded in); excluded tensors and those without a
        gradient are absent."""
        rates = {}
        for group in self.param_groups:
            decay = group.get("weight_decay", 0.0)
            for p in group["params"]:
                if p.grad is None or (self.exclude is not None and self.exclude(p)):
                    continue
                w, g = float(p.norm()), float(p.grad.norm())
                local = 1.0
                if w > 0 and g > 0:
                    local = self.trust * w / (g + decay * w + self.eps)
                    if self.clip:
                        local = min(local / group["lr"], 1.0)
                rates[p] = local
        return rates

    def load_state_dict(self, state_dict: dict) -> None:
        """The wrapped optimizer's ``load_state_dict`` (which replaces its groups and state:
        they are taken again, so that the two keep sharing them)."""
        self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None):  # torch's types
        """Evaluates ``closure`` (if any), scales the gradients, then the wrapped step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
        synchronize = getattr(inner, "synchronize", None)  # LARS(DistributedOptimizer(...))
        if synchronize is not None:
            synchronize()
        rates = {id(p): r for p, r in self.local_rates().items()}
        decays = []
        with torch.no_grad():
            for group in self.param_groups:
                decay = group.get("weight_decay", 0.0)
                decays.append(decay)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if decay:
                        p.grad.add_(p, alpha=decay)
                    if id(p) in rates:
                        p.grad.mul_(rates[id(p)])
        try:
            for group, decay in zip(self.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = 0.0  # folded in above: applied once
            skip = getattr(inner, "skip_synchronize", None)
            with skip() if synchronize is not None and skip else contextlib.nullcontext():
                inner.step()
        finally:
            for group, decay in zip(self.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = decay
        return loss
