"""``compression="auto"`` with local SGD allowed: the parameter averaging every H steps.

    opt = hvd.DistributedOptimizer(opt, named_parameters=..., compression="auto",
                                   local_sgd=16)              # H at most 16, auto's choice

``Auto`` only sees gradient buckets; local SGD also needs the parameters, and a moment
after the optimizer's step and before the next backward. A front door that allows local
SGD *attaches* them (``Auto.attach``: the Horovod API's ``DistributedOptimizer`` does it
itself, a DDP script calls it) and calls ``Auto.after_step()`` after every optimizer step.
This module is what those two calls run; the averaging itself is ``diloco.DiLoCo``'s (plain
local SGD: outer lr 1, no momentum, one fragment, no delay), called, not copied, through the
*sync option* auto agreed with H: float32, or a quantizer (bf16, int8, int4) of what each
rank's parameters moved since the window's start, with error feedback across the windows
(``DiLoCo(compressor=...)``: each rank's and each owner's residual go with the next sync).

Windows. Auto agrees H with its per-bucket choices (``auto_model.choose_period``) and
counts the steps (``Auto.period``: the H in force for this step's buckets, ``Auto.phase``:
this step's place in its window). A new H takes effect at a window's end, or, where H was
1, at the step whose first call agreed it (none of its buckets reduced yet: the ranks'
parameters are equal there, after a step that exchanged its gradients or a sync at once).
The warm-up's steps, with every rank attached, are a window of their own through the warm
quantizer, synced at once after the probe step (``auto.py``, 2). So, after each optimizer
step:

- the step ended a window (``phase == period - 1``): the ranks' parameters are averaged
  (``DiLoCo.sync_now``: delta = anchor - theta averaged, anchor moved by it, theta =
  anchor, equal on every rank), timed for auto's drift check;
- or, where auto agreed a sync *behind* (``Auto(local_overlap=D)``, ``decision.overlap``
  = d > 0) and the next window is local SGD through the same option, the sync is started
  there and lands d steps into the next window (``DiLoCo.tick``, after each step): its
  reduction runs on DiLoCo's thread behind those steps' compute, and each rank's parameters
  become the new anchor plus the steps it took meanwhile (``carry``), kept for the next
  sync. The ranks' parameters then differ by those steps, so a window that starts afresh
  (after exchanged steps, or through another option) or H = 1 follows only a sync at once;
- the next step starts a window and the last one was not local (H was 1), or its sync
  option is another: a fresh DiLoCo, through that option, takes the parameters, equal on
  every rank, as its anchors (a quantizer's residuals of the old one are let go: one
  sync's rounding); so does a window agreed at a step's first call (``restart``).

Nothing is exchanged between syncs: auto's buckets return each rank's own gradient.

State. Mid-window, the anchors (the parameters at the window's start) are what the next
sync needs, so ``Auto.state_dict`` carries this DiLoCo's state (a sync behind waited for,
its result kept to land at its step); a state loaded before the
front door attached is kept until it does.
"""

from __future__ import annotations

import time

from .diloco import DiLoCo

__all__ = ["LocalSGD"]


class LocalSGD:
    """The parameters, the comm and the DiLoCo of one ``Auto`` (module docstring).

    Args:
        params: the parameters the optimizer steps, in the same order on every rank.
        comm: what DiLoCo reduces over: ``"horovod"`` (the Horovod API's asynchronous
            collectives on ``process_set``) or a ``Comm`` (``TorchComm(group)``: give it a
            group of its own).
        process_set: with ``comm="horovod"``.
        name: names the syncs' collectives (the same on every rank).
    """

    def __init__(self, params, comm="horovod", process_set=None, name: str = "auto.local_sgd",
                 compressor=None, clock=time.perf_counter):
        self.params = list(params)
        if not self.params:
            raise ValueError("local SGD needs the parameters the optimizer steps; got none")
        self.comm, self.process_set, self.name, self.clock = comm, process_set, name, clock
        self.diloco = self._fresh(compressor)  # made now so that a bad comm fails at attach

    def _fresh(self, compressor) -> DiLoCo:
        """A DiLoCo whose anchors are the parameters now (equal on every rank here), its
        syncs through ``compressor`` (None: float32), started by ``sync`` and counted by
        ``tick``: the window is Auto's. A sync that lands later keeps the steps taken
        meanwhile (``carry``)."""
        return DiLoCo(self.params, None, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                      nesterov=False, carry=True, compressor=compressor, comm=self.comm,
                      process_set=self.process_set, name=self.name, clock=self.clock)

    def tick(self) -> list[float | None]:
        """An optimizer step taken: lands a sync due (waiting for it if late); the seconds
        each landed reduction took (None: not timed, over the Horovod API)."""
        return self.diloco.tick()

    def sync(self, overlap: int = 0) -> list[float | None]:
        """Averages the parameters over the ranks (the window's end, after ``tick``): at
        once (``overlap`` 0: the reductions' seconds, as ``tick``), or landing ``overlap``
        steps later."""
        return self.diloco.sync_now(overlap)

    def in_flight(self) -> bool:
        return bool(self.diloco.pending)

    def settle(self) -> None:
        """Waits for a sync in flight (it lands at its own step all the same)."""
        self.diloco.settle()

    def restart(self, compressor) -> None:
        """A window starts after steps that exchanged gradients, or through another sync
        option, where the ranks' parameters are equal (a sync landed at once, or an elastic
        re-formation): the anchors are now. A sync of a world that is gone is dropped."""
        self.diloco._orphan()  # stops its thread
        self.diloco = self._fresh(compressor)

    def anchored_now(self, compressor) -> dict:
        """The state a window starting now through ``compressor`` will have (anchors: the
        parameters now)."""
        fresh = self._fresh(compressor)
        state = fresh.state_dict()
        fresh._orphan()
        return state

    def state_dict(self) -> dict:
        return self.diloco.state_dict()

    def load_state_dict(self, state: dict, compressor) -> None:
        """``state`` (a window's: its anchors, its sync's residuals) into a DiLoCo through
        ``compressor``, the sync option of that window."""
        self.restart(compressor)
        self.diloco.load_state_dict(state)
