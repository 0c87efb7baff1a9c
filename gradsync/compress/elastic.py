"""Compressor state and DiLoCo's outer state in an elastic ``State`` (issue 38, item 6).

    compressor = hvd.Compression.int8()
    outer = DiLoCo(model, inner, sync_every=16, compressor=Int8())
    state = hvd.elastic.TorchState(model, inner, compressor=compressor, diloco=outer)

A compressor, a ``HookState`` and a ``DiLoCo`` have an ``elastic_handler()``, so an elastic
state (``gradsync/elastic/state.py``) does not deep-copy them but calls their handler at
each of its steps, on every rank at the same point:

- ``save()`` (a commit): keeps ``state_dict()``. DiLoCo's first waits for the syncs in
  flight and keeps their results, to be applied at their landing steps, so a commit never
  holds a half-written residual;
- ``restore()`` (survivors, before a roll-back): the reductions in flight belong to the
  world that failed and are dropped; the kept state is loaded back. Whatever started after
  the commit (the fragment in flight) is redone: that is all a fault costs, never the
  window, whose inner steps up to the commit are in the model's saved parameters;
- ``sync()`` (the job's start or a roll-back): every member takes rank 0's kept state, so a
  new worker takes the outer state (anchors, momentum, residuals, the schedule's step and
  the syncs not yet landed) from a live peer;
- ``sync_from(root)`` (a recovery without roll-back): every member takes the root's state
  *at its last applied update*: the step in flight is redone, so the state it starts from
  must be the one that step first started from. A compressor's live state may be ahead of
  that: a failure in a round of several buckets can come after some of them were reduced
  (their residuals moved) and before the update was applied. So the elastic state tells the
  handler after each applied optimizer update (``at_update``), and the handler keeps a
  ``snapshot()`` then (references: held tensors never change in place, ``state.py``), which
  is what ``sync_from`` sends. Held by a state that never tells it (no optimizer), the
  handler sends the live state. DiLoCo is told nothing: its inner steps are no rounds, and a
  sync whose reduction the failure cut keeps its delta and is reduced again, in the new
  world, at the next step.

Residuals after a sync. Error feedback is per rank (what *this* rank's quantization lost),
but an elastic state is one state, rank 0's, on every rank after ``sync()``: the survivors
then hold equal residuals (rank 0's), which the next outer gradient pays back once per rank
instead of each rank's own once. The bias is one residual, a quantization error's size,
once per fault; the states being equal on every rank is what lets any member be the root
of the next recovery and a run be reproduced.
"""

from __future__ import annotations

__all__ = ["StateDictHandler", "DiLoCoHandler"]


class StateDictHandler:
    """The handler of any value with ``state_dict``/``load_state_dict`` that needs no more
    (a compressor, a ``HookState``).

    Args:
        value: the object.
        bcast_object: ``bcast_object(obj, root_rank, name=...)``; when not given, the elastic
            state that holds the value binds its own (``bind_broadcast``), so this package
            needs no front door of its own.
        name: names the broadcasts.
    """

    def __init__(self, value, bcast_object=None, name: str = "compressor"):
        self.value, self.name = value, name
        self._bcast = bcast_object
        self.kept = value.state_dict()
        self.applied = self.kept  # the state at the last applied update (``at_update``)
        self.told = False  # whether the elastic state tells this handler of updates

    def bind_broadcast(self, bcast_object) -> None:
        """Called by the elastic state that holds the value: its broadcast, unless one was
        given."""
        self._bcast = self._bcast or bcast_object

    def bcast(self, obj, root_rank: int):
        if self._bcast is None:
            raise RuntimeError(f"{self.name}: no broadcast to move the elastic state with; give "
                               "bcast_object= or hold the value in an elastic State")
        return self._bcast(obj, root_rank, name=f"elastic.{self.name}")

    def at_update(self) -> None:
        """An optimizer update was applied: the live state is the one a redone step starts
        from (the module docstring)."""
        self.told = True
        snapshot = getattr(self.value, "snapshot", None)
        self.applied = snapshot() if snapshot is not None else self.value.state_dict()

    def save(self) -> None:
        self.applied = self.kept = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self.kept)
        self.applied = self.kept

    def sync(self) -> None:
        self.applied = self.kept = self.bcast(self.kept, 0)
        self.value.load_state_dict(self.kept)

    def sync_from(self, root_rank: int) -> None:
        self.applied = self.bcast(self._live(), root_rank)
        self.value.load_state_dict(self.applied)

    def _live(self) -> dict:
        return self.applied if self.told else self.value.state_dict()


class DiLoCoHandler(StateDictHandler):
    """DiLoCo's handler: as ``StateDictHandler``, and the syncs in flight are dropped before
    the state moves (the module docstring)."""

    def __init__(self, diloco, bcast_object=None):
        super().__init__(diloco, bcast_object, name=diloco.name)

    def at_update(self) -> None:
        """Nothing: an inner step is no round, and a snapshot would wait for the syncs in
        flight (``_live`` takes the live state, its syncs orphaned)."""

    def restore(self) -> None:
        self.value._orphan()
        super().restore()

    def sync(self) -> None:
        self.value._orphan()
        super().sync()

    def _live(self) -> dict:
        # The reduction a failure cut is not waited for (it would raise): it is orphaned,
        # and its delta travels with the state, to be reduced again.
        self.value._orphan()
        return self.value.state_dict()
