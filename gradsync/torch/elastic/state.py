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
"""

from __future__ import annotations

import copy

import torch

from ...elastic.state import ObjectState
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import rank
from .sampler import ElasticSampler

__all__ = ["TorchState"]


class _Handler:
    def __init__(self, value):
        self.value = value
        self.save()

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

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        _drop_round(self.value)
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self) -> None:
        _drop_round(self.value)
        if hasattr(self.value, "_gs_build"):  # a DistributedOptimizer: buckets for the new world
            self.value._gs_build()
            self.value._gs_reset_round()


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self.saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0,
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


_HANDLERS = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (ElasticSampler, _SamplerHandler)]


class TorchState(ObjectState):
    """Elastic state of a PyTorch training process (Horovod's ``hvd.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer`` or DistributedOptimizer (optional).
        **kwargs: more attributes: modules, optimizers and ElasticSamplers get their handler,
            any other value is saved by deep copy (``epoch=0, batch=0``).
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = next((h for kind, h in _HANDLERS if isinstance(value, kind)), None)
            if handler is not None:
                handlers[name] = handler(value)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(broadcast_object, rank, **plain)

    def __setattr__(self, name, value) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
