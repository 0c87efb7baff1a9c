"""The data side of elastic mode: a Loader's position commits, rolls back and goes on.

    loader = gradsync.data.Loader(dataset, batch_size=32, transform=augment, seed=0)
    hvd.init()
    ...
    state = hvd.elastic.TorchState(model, optimizer, loader=loader, epoch=0)

    @hvd.elastic.run
    def train(state):
        while loader.epoch < epochs:
            for x, y in loader:
                ...  # one optimizer step per batch
                state.commit()            # every few steps

A Loader given to an elastic state (``TorchState``, ``ObjectState``) is not deep-copied: its
``elastic_handler()`` is a ``LoaderState``, which the state calls at each of its steps
(``gradsync/elastic/state.py``):

- ``save()`` (a commit, on every worker at the same step) keeps ``loader.state_dict()``: the
  epoch and the samples delivered in it, gathered from every worker. The state's first save,
  at its construction, is ``loader.local_state()`` (no message: a new worker builds its state
  while the others train).
- ``sync()`` (the job's start, or a roll-back: every member of the new generation) takes rank
  0's kept dict and ``loader.reset(rank, size, kept, generation)``: every sample not delivered
  at that commit, a lost worker's share and the survivors' batches taken since included, goes
  to exactly one worker of the new generation, a new worker's share included.
- ``sync_from(root)`` (a recovery *without* roll-back, ``gradsync/elastic/recovery.py``: every
  survivor was inside a step's gradient exchange) goes on from where training stood, not
  from the commit: ``live_state`` below, then ``reset`` as above.
- ``restore()`` (survivors, before a roll-back's ``sync()``) does nothing: the ``sync()`` that
  follows it resets every worker's Loader.

**The live state** (``live_state``). A batch is *trained* once an optimizer update that used
its gradient has been applied. Synchronous data-parallel training takes one batch per worker
per update, in step: update k of an epoch sums the gradients of every worker's k-th batch of
it. At a recovery without roll-back, every survivor reports its ``position()``: the batches it
delivered in its epoch (``acked``: it asked for the next one, so their step was applied on
it) and the one in hand. Survivors differ by at most one update (recovery.py): the furthest,
``n`` batches into epoch ``e``, applied update ``n``, which holds every worker's ``n``-th
batch, the lost worker's included. So the job has trained, of epoch ``e``: what was done when
the epoch (or this generation's part of it) started; each survivor's delivered batches, and
its batch in hand if it is behind the furthest (its update was applied there); and each lost
worker's first ``n`` batches of the plan (``plan.worker_batches``), the plan every member of
the old generation computed. Every other sample of the epoch is served again, to exactly one
worker of the new generation. Every member computes this from the same gathered reports, so
the result is the same without a broadcast.

The rule counts a lost worker's batches in plan order. A worker that does not use a data
server in an epoch (lost, or not taken back yet) takes that server's batches at the end of the
epoch (``Loader._adopt``), out of plan order, so a survivor that does not use one says its
state is no resume point (``LoaderState.resumable``) and the job rolls back to the last commit
instead. The lost worker may have found a data server dead while the survivors still read the
batches that server had published: so at a failure every survivor first looks at its data
servers (``Loader.look_at_servers``: a process gone, a connection closed) and finds any dead
one lost too. A lost worker that had given up a *silent* data server (stopped, or cut off from
it alone), which no survivor can find silent, wrote so in the store first (``Loader._lose``),
and the look finds that record.

That reasoning needs every worker of an epoch to use the same data servers: a data server
started again (``run/data_servers.py``) is taken back by every worker at one epoch boundary,
agreed in the collectives above (a commit's ``state_dict``, ``sync``, ``sync_from``; see
``returns.py``).
"""

from __future__ import annotations

import numpy as np

from .plan import STATE_VERSION, pack_mask, plan, unpack_mask, worker_batches

__all__ = ["LoaderState", "live_state"]


class LoaderState:
    """A Loader's handler in an elastic state (see the module docstring).

    Args:
        loader: a worker's ``gradsync.data.Loader``, not yet iterating.

    Attributes:
        kept: the state dict of the last save (a commit, or a recovery's agreed state).
    """

    def __init__(self, loader):
        self.loader = loader
        self.kept = loader.local_state()
        # Whether this process's Loader holds a position of the job's: not a new worker's
        # before its first sync (its position() would report nothing it trained).
        self._joined = False

    def save(self) -> None:
        """A commit: a collective (``state_dict``) on every worker at the same step."""
        self.kept = self.loader.state_dict()

    def restore(self) -> None:
        """Nothing: the roll-back's ``sync()`` resets the Loader to rank 0's kept state."""

    def resumable(self) -> bool:
        """Whether ``live_state`` may credit the workers (asked at a failure, with the
        state's own answer): not once this worker lost a data server, whose batches it then
        takes out of plan order (the module docstring), so the job rolls back instead.

        It looks at the data servers first (``Loader.look_at_servers``): the lost worker
        may have found a data server dead (and taken batches out of plan order since) while
        this one still read what that server had published; every survivor finds a dead
        server here, so none credits the lost worker its plan's batches."""
        self.loader.look_at_servers()
        return not self.loader.lost

    def sync(self) -> None:
        """Takes rank 0's kept state (the job's start, a roll-back), and its table of data
        servers back (``returns.py``): a new return serves from the epoch after the kept
        one, which every member starts afresh."""
        from .. import api, job

        mine = (self.kept, self.loader.server_report()) if job.world().rank == 0 else None
        self.kept, report = api.broadcast_object(mine, root_rank=0, name="gradsync.data.kept")
        self.loader.agree_on_servers([report], self.kept["epoch"] + 1)
        self._reset(self.kept)

    def sync_from(self, root_rank: int) -> None:
        """Goes on from where training stood (a recovery without roll-back): every member
        gathers the survivors' positions and computes the same ``live_state``. ``root_rank``
        is not needed: every survivor's report counts."""
        from .. import api

        loader = self.loader
        mine = loader.position() if self._joined else None
        gathered = api.allgather_object((mine, loader.server_report()),
                                        name="gradsync.data.positions")
        views = [view for view, _ in gathered]
        state = live_state(loader.samples, loader.batch_size, loader.seed, loader.servers,
                           views, loader.order)
        # The table of data servers back, agreed in the same gather (``returns.py``): a new
        # return serves from the epoch after the furthest any member may have started.
        furthest = max([v["epoch"] for v in views if v is not None] + [state["epoch"]])
        loader.agree_on_servers([report for _, report in gathered], furthest + 1)
        self._reset(state)

    def _reset(self, state: dict) -> None:
        from .. import job
        from ..elastic import worker

        world = job.world()
        generation = worker.generation() if worker.is_elastic() else self.loader.generation
        self.loader.reset(world.rank, world.size, state, generation)
        self._joined = True


def live_state(samples: int, batch_size: int, seed: int, servers: int,
               views: list[dict | None], order: str = "servers") -> dict:
    """The data state a recovery without roll-back goes on from (the module docstring).

    Args:
        samples, batch_size, seed, servers, order: the Loader's.
        views: every member's ``Loader.position()``; None for a member that holds no position
            of the job's (a new worker).

    Returns:
        A state dict as ``Loader.state_dict()`` makes it.
    """
    survivors = [v for v in views if v is not None]
    if not survivors:
        raise ValueError("live_state: no member reported a position (no survivor)")
    best = max(survivors, key=lambda v: (v["epoch"], v["acked"]))
    epoch, n, workers = best["epoch"], best["acked"], best["workers"]
    start = unpack_mask(best["start"], samples) if best["start"] else \
        np.zeros(samples, dtype=bool)
    done = start.copy()
    here = {v["place"]: v for v in survivors if v["epoch"] == epoch}
    batches = None
    for place in range(workers):
        view = here.get(place)
        if view is not None:
            done |= unpack_mask(view["delivered"], samples)
            if view["hand"] is not None and view["acked"] < n:
                done[view["hand"]] = True  # its update was applied on the furthest survivor
            continue
        if batches is None:
            batches = plan(samples, batch_size, seed, epoch, servers, workers, start, order)
        for b in worker_batches(batches, place)[:n]:  # a lost worker: its first n batches
            done[b.ids] = True
    if done.all():
        epoch, done[:] = epoch + 1, False
    return {"version": STATE_VERSION, "samples": samples, "batch_size": batch_size,
            "seed": seed, "epoch": epoch, "done": pack_mask(done) if done.any() else None}
