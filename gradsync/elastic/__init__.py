"""Elastic training: survive lost workers, admit new ones (``gradsync run --min-np``).

Framework-neutral parts: the generations protocol between launcher and workers
(``membership``), a worker's join and in-place re-formation (``worker``), ``State`` and
``ObjectState`` (``state``) and the training loop (``run``). ``gradsync.torch.elastic`` adds
``TorchState`` and ``ElasticSampler``; docs/elastic.md explains the whole mode.
"""

from .membership import ElasticJobFailed, ExcludedError
from .run import run_fn
from .state import HostsUpdatedInterrupt, ObjectState, State
from .worker import reset

__all__ = ["run", "State", "ObjectState", "HostsUpdatedInterrupt", "ElasticJobFailed",
           "ExcludedError", "run_fn", "reset"]


def run(func):
    """Decorates a training function ``func(state, ...)`` with the elastic loop
    (``run.run_fn``)."""
    return run_fn(func, reset)
