"""Recovery after a re-formation: go on from where the survivors are, or roll back.

When a worker is lost, every survivor stops at the collective it was in and re-forms the job
(``worker.reset``). What each survivor's *live* state is worth then depends on where the
failure caught it, and the survivors must agree on one state before training goes on.

**Updates.** A state that can count the optimizer updates it has applied (``State.updates``;
``TorchState`` counts them with the optimizer's step hooks) can also say whether its live
state is a *resume point*: a state from which ``func(state)`` can start again and redo only
what was interrupted. ``TorchState`` says so when the failure came while a gradient round was
in flight -- backward had started reducing gradients, or ``optimizer.step()`` was waiting for
them -- and before the update was applied. Then everything the script records after a step
(``sampler.record_batch``, counters) belongs to the previous, applied step, and restarting the
loop redoes exactly the step in flight. A failure anywhere else (a collective of the script's
own between the update and its bookkeeping, ``sync()`` of an earlier recovery) gives no
resume point: only the last ``commit()`` is known to be consistent.

**The rule.** Right after the re-formation, before any state moves, every member reports
(one ``allgather_object``): whether it is a survivor, its live updates and whether they are a
resume point, the updates of its last save, and whether its state asks for ``rollback =
"always"``. Every member then computes the same ``Plan`` from the same reports (``decide``):

- no survivor (the job's first generation): rank 0's committed state, as always (``sync()``);
- every survivor has a resume point and none asks for rollback: **go on**. The survivor with
  the most updates (the lowest rank among equals) is the root; every member takes its live
  state (``sync_from``) and saves it, so the re-formation is also a commit. Survivors can
  differ by one update: the ring allreduce of the last step may have completed on some
  before the lost worker's bytes stopped; those applied a correct update (the sum over the
  old generation) and the others take it from them, so nothing is lost;
- otherwise: **roll back**: the survivors restore their last save (a commit, or the last
  re-formation's) and everyone takes rank 0's (``sync()``), as Horovod does.

Worked example: four workers, a commit at update 10, worker 2 killed while step 15's
gradients are in flight. Workers 0, 1, 3 are in ``optimizer.step()`` with 14 updates each, all
resume points: they re-form as ranks 0-2, go on from update 14 and redo step 15 at size 3
(no update lost; the forward and backward of step 15 are done again). Had worker 1 been in a
metrics allreduce of its own after update 14 but before ``record_batch``, it would report no
resume point and all three would roll back to update 10 (4 updates lost).

``Recovery`` records what happened (the times, the updates lost); ``run_fn`` logs it and keeps
it in ``state.last_recovery`` for a script or a benchmark to read.
"""

from __future__ import annotations

import dataclasses

from .. import api

__all__ = ["Report", "Plan", "Recovery", "decide", "agree", "ROLLBACK_MODES"]

ROLLBACK_MODES = ("auto", "always")
"""``State.rollback``: ``auto`` goes on when every survivor has a resume point (module
docstring); ``always`` rolls back to the last commit after every failure (Horovod's rule)."""


@dataclasses.dataclass(frozen=True)
class Report:
    """One member's account of itself at a re-formation (the fields ``decide`` reads)."""

    survivor: bool
    """It was a member of an earlier generation (False: a new worker, or the job's start)."""
    live: int | None
    """Updates applied to its live state; None: its state does not count updates."""
    resumable: bool
    """Its live state is a resume point (module docstring)."""
    saved: int | None
    """Updates of its last save (commit or re-formation); None: not counted."""
    always: bool
    """Its state asks for ``rollback = "always"``."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every member does after the reports, the same on every member."""

    action: str
    """``start`` (take rank 0's commit), ``go_on`` (take the root's live state) or
    ``rollback`` (survivors restore their commit, then take rank 0's)."""
    root: int
    """The rank whose state every member takes."""
    updates: int | None
    """Updates of the state the job goes on from (None: not counted)."""
    lost: int | None
    """Updates that the most advanced survivor had applied and the job no longer has."""


@dataclasses.dataclass
class Recovery:
    """What one recovery did (``state.last_recovery``); times are ``time.time()``."""

    generation: int
    """The generation the job went on in."""
    size: int
    """Its number of workers."""
    failed: float
    """When this worker caught the failure (its detection)."""
    formed: float
    """When the new generation's World was connected."""
    resumed: float
    """When every member had the agreed state (training goes on)."""
    plan: Plan
    reason: str


def decide(reports: list[Report]) -> Plan:
    """The plan that every member computes from the same reports (module docstring)."""
    survivors = [(i, r) for i, r in enumerate(reports) if r.survivor]
    if not survivors:
        return Plan("start", 0, None, None)
    lives = [r.live for _, r in survivors if r.live is not None]
    counted = len(lives) == len(survivors)
    top = max(lives) if counted else None
    if counted and all(r.resumable and not r.always for _, r in survivors):
        root = min(i for i, r in survivors if r.live == top)
        return Plan("go_on", root, top, 0)
    # Rank 0 is always a survivor (the launcher lists survivors first), so its save is
    # the one every member ends with.
    saved = reports[0].saved
    lost = top - saved if top is not None and saved is not None else None
    return Plan("rollback", 0, saved, lost)


def agree(report: Report) -> Plan:
    """Exchanges this member's report with every member's and returns the common plan."""
    reports = api.allgather_object(dataclasses.asdict(report), name="gradsync.elastic.agree")
    return decide([Report(**r) for r in reports])
