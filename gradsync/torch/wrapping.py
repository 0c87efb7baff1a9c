"""How a DistributedOptimizer is made from the user's optimizer; shared by both kinds.

As in Horovod, ``DistributedOptimizer(opt)`` returns an object whose class is built on the
fly from a mixin and the user's own class, ``(Mixin, type(opt))``, so that ``isinstance(...,
torch.optim.SGD)`` still holds and ``step()`` is the mixin's, which synchronizes and then
calls the user's class. The new object takes the user's optimizer's instance dictionary,
so the two share ``param_groups`` and ``state``. gradsync has two mixins,
``optimizer._DistributedOptimizer`` (gradients averaged in fixed buckets) and
``adasum_optimizer.AdasumOptimizer`` (updates combined by Adasum); both are made here.

Each mixin learns that a gradient is ready from a hook on its parameter (torch's
``register_post_accumulate_grad_hook``). The hook holds the optimizer through a weak
reference: a parameter must not keep a discarded optimizer (and its buffers) alive, and a
finalizer removes the hooks once the optimizer is collected.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

import torch

__all__ = ["rebase", "grad_hook", "remove_hooks"]

_CLASSES: dict[tuple[type, type], type] = {}

Mixin = TypeVar("Mixin")


def rebase(optimizer: torch.optim.Optimizer, mixin: type[Mixin]) -> Mixin:
    """A new object of class ``(mixin, type(optimizer))`` over ``optimizer``'s attributes.

    The caller then sets the mixin up (its ``_gs_setup``). An instance attribute of
    ``optimizer`` that shadows one of the mixin's methods (an LR scheduler wraps
    ``optimizer.step`` on the instance) stays behind: it would bypass the synchronization.
    """
    base = type(optimizer)
    cls: Any = _CLASSES.get((mixin, base))  # a class made at run time
    if cls is None:
        cls = _CLASSES[mixin, base] = type(base.__name__, (mixin, base),
                                           {"__module__": mixin.__module__})
    own = _names(mixin)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update((k, v) for k, v in vars(optimizer).items() if k not in own)
    return wrapped


def grad_hook(owner, slot: int) -> Callable[[torch.Tensor], None]:
    """The hook that tells ``owner._gs_grad_ready(slot, param)`` that ``param``'s gradient
    has been accumulated, for as long as ``owner`` lives (a weak reference)."""
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._gs_grad_ready(slot, param)

    return hook


def remove_hooks(handles: list) -> None:
    """Removes the hooks of ``handles`` (``RemovableHandle``s) and empties the list."""
    for handle in handles:
        handle.remove()
    handles.clear()


def _names(mixin: type) -> frozenset:
    return frozenset(n for n in vars(mixin) if not n.startswith("__"))
