"""TorchState: a model, an optimizer, a sampler and plain values, committed together.

Each value of a kind that needs more than a deep copy gets a *handler* (save, restore, sync,
reset); everything else is an ``ObjectState`` attribute:

- ``torch.nn.Module``: save copies every tensor of ``state_dict()`` (``clone``, no pickling),
  restore loads the copy back, sync broadcasts rank 0's parameters and buffers
  (``broadcast_parameters``, fused).
- ``torch.optim.Optimizer`` (a DistributedOptimizer too): save deep-copies ``state_dict()``,
  restore drops the gradient round the failure interrupted and loads the copy, sync is
  ``broadcast_optimizer_state`` (works when a new worker has no state yet). After a
  re-formation a DistributedOptimizer re-plans its buckets for the new world, as a new
  worker's DistributedOptimizer does when it is built, so both issue the same collectives.
- ``ElasticSampler``: its ``state_dict`` (epoch and samples consumed), synced from rank 0.

A TorchState with an optimizer counts the updates applied (a step post-hook on each
optimizer) and knows when a gradient round is in flight (backward has started reducing, or
``step()`` has not yet applied the update), which is what lets ``hvd.elastic.run`` go on after
a failure without rolling back (``gradsync/elastic/recovery.py``).
"""

from __future__ import annotations

import abc
import copy

import torch

from ...elastic.state import ObjectState
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import rank
from .sampler import ElasticSampler

__all__ = ["TorchState"]


class _Handler(abc.ABC):
    """Saves, restores and syncs one kind of value of a TorchState, its own way."""

    def __init__(self, value):
        self.value = value
        self.save()

    @abc.abstractmethod
    def save(self) -> None:
        """Keeps a copy of the value (a commit)."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Puts the copy back into the value (a rollback)."""

    @abc.abstractmethod
    def sync(self, root_rank: int = 0) -> None:
        """Makes every rank's value ``root_rank``'s."""

    def set_value(self, value) -> None:
        self.value = value
        self.save()

    def reset(self) -> None:
        pass


class _ModelHandler(_Handler):
    def save(self) -> None:
        self.saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self, root_rank: int = 0) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class _OptimizerHandler(_Handler):
    def __init__(self, value):
        self.updates = 0
        self.depth = 0  # steps entered and not finished (see _before)
        self._hooks = []
        self.on_update = None  # called after each update applied (TorchState's values)
        super().__init__(value)

    def save(self) -> None:
        self._hook()
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        _drop_round(self.value)
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, root_rank: int = 0) -> None:
        broadcast_optimizer_state(self.value, root_rank=root_rank)

    def reset(self) -> None:
        self.depth = 0  # a step that a failure ended never ran its post-hooks
        _drop_round(self.value)
        if hasattr(self.value, "_gs_build"):  # a DistributedOptimizer: buckets for the new world
            self.value._gs_build()
            self.value._gs_reset_round()

    def in_round(self) -> bool:
        """Whether a gradient round is in flight: a DistributedOptimizer's hooks have started
        reducing (its round is open), or ``step()`` began and has not applied the update."""
        return self.depth > 0 or bool(getattr(self.value, "_gs_round_open", False))

    def discard_gradients(self) -> None:
        """Drops the gradients of the round a failure cut short: an in-place allreduce may
        have left partial sums in them, and a redone step must not accumulate onto them."""
        self.value.zero_grad(set_to_none=True)
        self.depth = 0

    def _hook(self) -> None:
        """Counts this optimizer's updates, on the optimizer in hand (``set_value`` may give
        a new one: the old one's hooks go)."""
        if self._hooks and self._hooks[0][0] is self.value:
            return
        for _, handle in self._hooks:
            handle.remove()
        self._hooks = [(self.value, self.value.register_step_pre_hook(self._before)),
                       (self.value, self.value.register_step_post_hook(self._after))]

    # torch wraps ``step`` with the hooks once per class that has called
    # ``_patch_step_function`` (``Optimizer.__init__``, ``load_state_dict``), so a
    # DistributedOptimizer's step and the wrapped class's step inside it may both run them:
    # the depth counts one update per outermost step.
    def _before(self, optimizer, args, kwargs) -> None:
        self.depth += 1

    def _after(self, optimizer, args, kwargs) -> None:
        self.depth -= 1
        if self.depth == 0:  # the update is applied: the round is over and counts
            self.updates += 1
            if self.on_update is not None:
                self.on_update()


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self.saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self, root_rank: int = 0) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank,
                                                    name="elastic.sampler"))


def _drop_round(optimizer) -> None:
    """Forgets a DistributedOptimizer's gradient round that a failure cut short (its handles
    belong to a World that is gone)."""
    buckets = getattr(optimizer, "_gs_buckets", None)
    if buckets is None:
        return
    for bucket in buckets:
        bucket.handle = bucket.wire = bucket.ctx = None
    optimizer._gs_reset_round()
    optimizer._gs_synchronized, optimizer._gs_should_synchronize = False, True


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler)]


class TorchState(ObjectState):
    """Elastic state of a PyTorch training process (Horovod's ``hvd.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer`` or DistributedOptimizer (optional).
        **kwargs: more attributes: modules, optimizers and ElasticSamplers get their handler,
            any other value is saved by deep copy (``epoch=0, batch=0``).
    """

    _handlers: dict[str, _Handler]  # set in __init__ (object.__setattr__: see __setattr__)

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, object] = {}
        for name, value in kwargs.items():
            kind = next((h for k, h in _HANDLERS if isinstance(value, k)), None)
            if kind is not None:
                handlers[name] = kind(value)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        object.__setattr__(self, "_saved_updates", self.applied_updates())
        super().__init__(broadcast_object, rank, **plain)
        # A value whose handler must know where a redone step starts (a compressor's
        # residuals: gradsync/compress/elastic.py) is told after each update.
        for handler in self._optimizers():
            handler.on_update = self._values_at_update

    def __setattr__(self, name, value) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        object.__setattr__(self, "_saved_updates", self.applied_updates())
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        self.adopt_updates(self.saved_updates())
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    # ------------------------------------------------------------ recovery (recovery.py)
    def _optimizers(self) -> list[_OptimizerHandler]:
        return [h for h in self._handlers.values() if isinstance(h, _OptimizerHandler)]

    def applied_updates(self) -> int | None:
        """Updates applied by this state's optimizers (summed); None without an optimizer."""
        optimizers = self._optimizers()
        return sum(h.updates for h in optimizers) if optimizers else None

    def saved_updates(self) -> int | None:
        return self.__dict__.get("_saved_updates")

    def adopt_updates(self, updates: int | None) -> None:
        """Takes the update count of the state synced to (None: keeps its own)."""
        optimizers = self._optimizers()
        if updates is None or not optimizers:
            return
        # The count is the job's, not one optimizer's: keep it on the first one.
        for handler in optimizers:
            handler.updates = 0
        optimizers[0].updates = updates

    def resumable(self) -> bool:
        """True when one of the optimizers has a gradient round in flight: the failure came
        inside that round's exchange, before its update and after the script's bookkeeping
        of the previous step (``recovery.py``); and no value handler says otherwise (a data
        ``Loader`` that lost a data server)."""
        return any(h.in_round() for h in self._optimizers()) and self._values_resumable()

    def sync_from(self, root_rank: int) -> None:
        for handler in self._handlers.values():
            if isinstance(handler, _OptimizerHandler):
                handler.discard_gradients()
            handler.sync(root_rank)
        super().sync_from(root_rank)
