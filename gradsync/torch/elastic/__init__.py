"""``hvd.elastic``: Horovod's elastic API on gradsync (docs/elastic.md).

::

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: scale_lr(optimizer, hvd.size())])

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

    train(state)

Run it with ``gradsync run -np 4 --min-np 2 --max-np 8 --host-discovery-script hosts.sh``.
"""

from ...elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn
from ...elastic.membership import ElasticJobFailed, ExcludedError
from ...errors import PeerLostError
from .reform import reform
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt", "PeerLostError", "ElasticJobFailed", "ExcludedError"]


def run(func):
    """Horovod's ``hvd.elastic.run``: ``func(state, ...)`` in the elastic loop
    (``gradsync.elastic.run``), re-forming the Horovod API's process sets with the World: the
    global set goes on in the next generation; other sets must be added again (their ranks
    changed), as in Horovod."""
    return run_fn(func, reform)
