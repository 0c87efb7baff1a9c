"""DistributedOptimizer(op=Adasum): Adasum applied to each parameter's update, as in Horovod.

Adasum (``collectives/adasum.py``) is meant for the step an optimizer takes, not for raw
gradients: with momentum or Adam the step is not proportional to the gradient, and Adasum
should see the step each rank would really take. So, per parameter ``p`` and per round:

1. in the gradient hook (after ``backward_passes_per_step`` passes), the wrapped optimizer
   steps on ``p`` alone (the other parameters are hidden from its ``param_groups`` for that
   call): ``start = p``, local step, ``delta = p - start``, and ``p`` is put back to ``start``.
   The optimizer's state (momentum, Adam's moments) thus evolves from local gradients only.
2. ``delta`` is Adasum-allreduced (``allreduce_async_``, op=Adasum, under the parameter's name)
   while backward goes on;
3. ``step()`` waits and sets ``p = start + reduced delta``.

Horovod writes the delta into ``p`` itself and reduces it there, so until ``step()`` the
parameter holds its update, not its value. Here ``p`` keeps its value until ``step()`` (one
extra copy per parameter): a weight that backward still needs, or that the caller reads
between backward and step, is not silently replaced by its update.

Order. The deltas are reduced in one fixed order, reverse registration order (roughly the order
backward produces the gradients), the same on every rank: a hook that fires early only marks
its delta ready, and the ready prefix of that order is launched. ``step()`` takes the local
step for parameters whose hook did not fire (no gradient this round: the optimizer skips them
and their delta is zero, as Horovod contributes zeros) and launches the rest, in order. So the
ranks issue the same allreduces in the same order whatever order their hooks fire in.

Not provided (as in Horovod): ``skip_synchronize()`` (raises) and a separate ``synchronize()``
(it does nothing: the update is applied by ``step()``). ``groups`` and ``sparse_as_dense`` are
ignored with a warning; ``join()`` does not follow this optimizer.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING

import torch

from ..collectives.ops import Adasum
from ..liveness.pace import meter
from ..pipeline.engine import Handle
from . import requests as _requests
from .compression import Compressor
from .process_sets import global_process_set
from .wrapping import grad_hook, rebase, remove_hooks

__all__ = ["AdasumOptimizer", "wrap"]


if TYPE_CHECKING:
    # As optimizer.py's mixin: the checker sees it as a subclass of the wrapped optimizer's
    # class, which rebase makes it.
    _Optimizer = torch.optim.Optimizer
else:
    _Optimizer = object


class AdasumOptimizer(_Optimizer):
    """Reduces each parameter's local update with Adasum (module docstring)."""

    backward_passes_per_step: int

    def _gs_setup(self, names: dict[int, str], compression: type[Compressor],
                  backward_passes_per_step: int) -> None:
        self._gs_names, self._gs_compression = names, compression
        self._parameter_names = {p: names[id(p)] for g in self.param_groups  # Horovod's
                                 for p in g["params"] if id(p) in names}
        self.backward_passes_per_step = backward_passes_per_step
        self._gs_hooks: list = []
        weakref.finalize(self, remove_hooks, self._gs_hooks)
        self._gs_build()

    def _gs_build(self) -> None:
        remove_hooks(self._gs_hooks)
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._gs_params = params[::-1]  # the launch order: reverse registration order
        self._gs_slot = {id(p): k for k, p in enumerate(self._gs_params)}
        self._gs_start = [torch.empty_like(p, requires_grad=False) for p in self._gs_params]
        self._gs_delta = [torch.empty_like(p, requires_grad=False) for p in self._gs_params]
        self._gs_reset_round()
        for k, p in enumerate(self._gs_params):
            self._gs_hooks.append(p.register_post_accumulate_grad_hook(grad_hook(self, k)))

    def _gs_reset_round(self) -> None:
        n = len(self._gs_params)
        self._gs_passes = [0] * n
        self._gs_ready = [False] * n
        self._gs_inflight: list[tuple[Handle, object] | None] = [None] * n
        self._gs_next = 0  # the first slot not launched yet

    # ------------------------------------------------------------------ one round
    def _gs_grad_ready(self, k: int, param: torch.Tensor) -> None:
        if self._gs_ready[k]:
            raise RuntimeError(
                f"the gradient of '{self._gs_name(k)}' was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "step(); increase backward_passes_per_step to accumulate gradients locally")
        self._gs_passes[k] += 1
        if self._gs_passes[k] == self.backward_passes_per_step:
            self._gs_local_step(k)
            self._gs_launch_ready()

    def _gs_local_step(self, k: int) -> None:
        """The wrapped optimizer's step on parameter k alone; its change goes to the delta."""
        p, start, delta = self._gs_params[k], self._gs_start[k], self._gs_delta[k]
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            with torch.no_grad():
                start.copy_(p)
                super(AdasumOptimizer, self).step()  # the wrapped optimizer's step
                torch.sub(p, start, out=delta)
                p.copy_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        self._gs_ready[k] = True

    def _gs_launch_ready(self) -> None:
        while self._gs_next < len(self._gs_params) and self._gs_ready[self._gs_next]:
            k = self._gs_next
            wire, ctx = self._gs_compression.compress(self._gs_delta[k])
            handle = _requests.allreduce(wire, self._gs_name(k), Adasum, 1.0, 1.0,
                                         global_process_set, inplace=True, asynchronous=True)
            handle.release()  # the name is free once done (see optimizer._gs_launch)
            self._gs_inflight[k] = (handle, ctx)
            self._gs_next += 1

    def _gs_name(self, k: int) -> str:
        return self._gs_names.get(id(self._gs_params[k]), f"allreduce.noname.{k}")

    # ------------------------------------------------------------------ the optimizer API
    def step(self, closure=None):
        """Takes the remaining local steps, waits for the reductions, applies them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for k in range(len(self._gs_params)):
            if not self._gs_ready[k]:
                self._gs_local_step(k)
        self._gs_launch_ready()
        try:
            with torch.no_grad():
                for k, p in enumerate(self._gs_params):
                    flight = self._gs_inflight[k]
                    assert flight is not None  # every parameter was stepped and launched above
                    handle, ctx = flight
                    reduced = self._gs_compression.decompress(handle.wait(), ctx)
                    p.add_(reduced.to(p.dtype))
        finally:
            self._gs_reset_round()
        meter.mark_step()  # a training step ends: stragglers are judged by steps (pace.py)
        return loss

    def synchronize(self) -> None:
        """Does nothing, as in Horovod: ``step()`` applies the reduced updates."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise RuntimeError("skip_synchronize() is not supported with op=Adasum (as in "
                           "Horovod): the reduced quantity is the update, applied by step()")
        yield  # pragma: no cover

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gs_next or any(self._gs_ready):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but "
                               "before optimizer.step(): the local updates of this round are "
                               "already being reduced")
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_gs_hooks"):  # not during the wrapped optimizer's __init__
            self._gs_build()


def wrap(optimizer: torch.optim.Optimizer, names: dict[int, str],
         compression: type[Compressor], backward_passes_per_step: int, groups,
         sparse_as_dense: bool) -> torch.optim.Optimizer:
    """Returns ``optimizer`` as an Adasum DistributedOptimizer (arguments already checked)."""
    if groups is not None or sparse_as_dense:
        warnings.warn("DistributedOptimizer(op=Adasum) reduces each parameter's update on its "
                      "own: groups and sparse_as_dense are ignored", stacklevel=3)
    wrapped = rebase(optimizer, AdasumOptimizer)
    wrapped._gs_setup(names, compression, backward_passes_per_step)
    return wrapped
