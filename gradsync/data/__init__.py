"""Data servers: ranks that load, cache and transform the data, and stream batches to workers.

    gradsync run -np 4 --data-servers 2 python train.py

Project Adam set machines apart to hold the training data, apply its transformations and
cache the results in memory, so that training machines only fetch ready batches. Here the last
D ranks of a job do that. Every rank runs the same script; the ``Loader`` call is where the
roles part::

    import gradsync.data
    loader = gradsync.data.Loader(dataset, batch_size=32, transform=augment, seed=0)
    # a data-server rank never gets here: the call above serves and ends the process
    for epoch in range(epochs):
        for x, y in loader:
            ...
        state = loader.state_dict()   # a collective; load_state_dict resumes mid-epoch

Within an epoch every sample goes to exactly one worker, in an order fixed by the seed
(``plan.py``); samples are decoded once and kept in the servers' memory (``cache.py``), the
transform runs afresh each epoch (``server.py``, by K producer processes or threads with
``--data-workers K``: ``producers.py``); batches move through one-sided memory regions
set up once (``transport/regions.py``), with ``prefetch`` batches of credit per worker
(``loader.py``); on one host a worker polls each stream's slot table instead of asking for a
batch, and acknowledges it with a store into shared memory (``slots.py``).
``as_dataloader(loader)`` is a torch ``DataLoader`` over it, for DDP and Lightning
(``compat.py``). In an elastic job (``gradsync run --min-np ... --data-servers D``) the Loader
goes into the elastic state, ``hvd.elastic.TorchState(model, optimizer, loader=loader)``, and
its position commits, rolls back and goes on with the model (``elastic.py``); a data server
that the launcher starts again serves every worker from an epoch they agree on
(``returns.py``). See docs/data.md, which also lists what is not done yet.
"""

from .collate import Collate, Pack, Pad
from .loader import Loader

__all__ = ["Loader", "Collate", "Pad", "Pack", "LoaderDataset", "as_dataloader"]


def __getattr__(name: str):
    # compat.py imports torch.utils.data: only code that asks for a DataLoader pays for it
    # (a data-server rank never does).
    if name in ("LoaderDataset", "as_dataloader"):
        from . import compat

        return getattr(compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
