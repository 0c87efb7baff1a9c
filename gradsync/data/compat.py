"""The data servers where a ``torch.utils.data.DataLoader`` is expected (DDP, Lightning).

    loader = gradsync.data.Loader(dataset, batch_size=32, transform=augment, seed=0)
    train = gradsync.data.as_dataloader(loader)      # a real DataLoader instance

Code written for torch's ``DataLoader`` reaches into it: Lightning's ``train_dataloader()``
may return any iterable, but with DDP it replaces the sampler of a ``DataLoader`` over a
map-style dataset by a ``DistributedSampler`` (re-creating the loader), sizes the epoch with
``len()``, and some code checks ``isinstance(x, DataLoader)``. ``as_dataloader`` gives all of
them a ``DataLoader`` over an ``IterableDataset`` whose ``__iter__`` is the next epoch of the
``Loader``: with ``batch_size=None`` the batches pass through as the data servers made them,
and an iterable dataset is one that Lightning leaves alone (no sampler to replace). Loading
stays on the data servers, so the ``DataLoader`` has no loading processes of its own
(``num_workers`` 0: a forked copy of the ``Loader`` would share its connections).

Even epochs. A worker's share of an epoch differs from another's by at most one batch
(``plan.py``). Horovod's API has ``join`` for that; DDP does not: a worker with one batch more
would wait forever in its backward's allreduce for workers that have finished. ``even=True``
(the default) makes every worker yield the same number of batches, the least any worker has
in the epoch: each worker computes every worker's count from the plan, without a message. The
at most one batch more on a worker is taken from its data server and not yielded (as
``drop_last`` drops a ``DataLoader``'s last short batch): at most W - 1 batches of an epoch are
not trained on, and ``state_dict()`` counts them as delivered.
"""

from __future__ import annotations

import torch.utils.data

from .loader import Loader

__all__ = ["LoaderDataset", "as_dataloader"]


class LoaderDataset(torch.utils.data.IterableDataset):
    """A ``Loader`` as a torch ``IterableDataset`` of batches: each ``iter()`` is an epoch.

    Args:
        loader: the worker's ``Loader``.
        even: yield the same number of batches on every worker (see the module docstring).
    """

    def __init__(self, loader: Loader, even: bool = True):
        super().__init__()
        self.loader, self.even = loader, even
        self._taken = 0  # batches of the current epoch taken from the Loader
        self._limit = 0  # the batches the current epoch yields

    def __len__(self) -> int:
        """Batches this worker yields in the next (or current) epoch."""
        return min(self.loader.lengths()) if self.even else len(self.loader)

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("a gradsync.data.Loader cannot run in a DataLoader's loading "
                               "process (its data servers do the loading): use num_workers=0, "
                               "as as_dataloader does")
        if self._taken and self._taken >= self._limit:
            # The last epoch's loop stopped after len() batches without asking for more (as
            # Lightning does): its batches past the even count are taken now, so that this
            # iter() starts the next epoch rather than going on with that one.
            for _ in self.loader:
                pass
            self._taken = 0
        limit = self._limit = len(self)
        # A loop left early goes on with its epoch at the next iter() (as the Loader does),
        # so the count of batches taken lives here, not in this generator.
        for batch in self.loader:
            self._taken += 1
            # Past the even count the batch is still taken (so that the epoch ends), but the
            # training loop does not see it: see "Even epochs" above.
            if self._taken <= limit:
                yield batch
        self._taken = 0


def as_dataloader(loader: Loader, even: bool = True, pin_memory: bool = False
                  ) -> torch.utils.data.DataLoader:
    """A ``torch.utils.data.DataLoader`` that yields ``loader``'s batches, one epoch per
    ``iter()``.

    Args:
        loader: the worker's ``Loader``.
        even: every worker yields the same number of batches an epoch (what DDP and
            Lightning need); the at most one more batch of a worker is dropped.
        pin_memory: passed to the ``DataLoader`` (page-locked copies for a GPU).
    """
    return torch.utils.data.DataLoader(LoaderDataset(loader, even), batch_size=None,
                                       num_workers=0, pin_memory=pin_memory)
