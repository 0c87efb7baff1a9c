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
parameters are equal there, and so are their optimizers' states, after a step that
exchanged its gradients). The warm-up's steps, where every rank attached its optimizer too,
are a window of their own through the warm quantizer, synced at once after the probe step
(``auto.py``, 2). So, after each optimizer step:

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

The optimizer. Between syncs each rank's optimizer also steps on its own gradients, so its
state (momentum, Adam's moments) differs from the other ranks' at a window's end, which
local SGD takes as it is (the next window's steps start from it). Where every step is
exchanged again after the window (H = 1 from there, or a calibration), equal gradients on
unequal states would move the ranks' parameters apart for good: so at that window's end,
after its sync, the optimizer's floating-point state is averaged over the ranks too, in
float32 (``align_optimizer``; the front door gives the optimizer: ``DistributedOptimizer``
itself, a DDP script ``attach(..., optimizer=opt)``; without it, a WARNING). After the
warm-up's window that is known only at the next step's first call, where the ranks agree
what follows: it is averaged there.

State. Mid-window, the anchors (the parameters at the window's start) are what the next
sync needs, so ``Auto.state_dict`` carries this DiLoCo's state (a sync behind waited for,
its result kept to land at its step); a state loaded before the
front door attached is kept until it does.
"""

from __future__ import annotations

import logging
import time

import torch

from .diloco import DiLoCo, reducer_for

log = logging.getLogger("gradsync")

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
        optimizer: the optimizer that steps ``params`` (its state is averaged where every
            step is exchanged again after a window: module docstring); None: not known.
    """

    def __init__(self, params, comm="horovod", process_set=None, name: str = "auto.local_sgd",
                 compressor=None, clock=time.perf_counter, optimizer=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("local SGD needs the parameters the optimizer steps; got none")
        self.comm, self.process_set, self.name, self.clock = comm, process_set, name, clock
        self.optimizer = optimizer
        self._warned = False
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

    def align_optimizer(self, step: int, comm=None) -> None:
        """After a window's sync at once, where every step is exchanged from here: the
        optimizer's floating-point state of ``params``, averaged over the ranks in float32
        (one allreduce of its tensors in the parameters' order, each state's keys sorted:
        the same layout on every rank, which took the same steps), over ``comm`` where given
        (Auto's, from inside a bucket's reduction: the Horovod API runs it on the
        controller's thread, where an operation of its own would never run), else over this
        local SGD's. Without the optimizer, a WARNING (``step``: the first step exchanged)."""
        if self.optimizer is None:
            if not self._warned:
                self._warned = True
                log.warning("compression auto (step %d): local SGD ends, every step exchanged "
                            "from here, but the optimizer's state (momentum, Adam's moments) "
                            "differs per rank after the local steps, so the ranks' parameters "
                            "will drift apart; pass attach(..., optimizer=opt)", step)
            return
        held = []  # (a parameter's state, a key of it), in the same order on every rank
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            held += [(state, key) for key in sorted(state, key=str)
                     if torch.is_tensor(state[key]) and state[key].is_floating_point()]
        if not held:
            return
        flat = torch.cat([state[key].detach().reshape(-1).float() for state, key in held])
        over = self.comm if comm is None else comm
        if isinstance(over, str):  # a front door's collectives ("horovod")
            reducer = reducer_for(over, None, self.process_set)
            mean = reducer.wait(reducer.start(flat, [tuple(flat.shape)],
                                              f"{self.name}.optimizer")).reshape(-1)
        else:  # here, on this thread: the window's sync has landed
            over.allreduce_sum_(flat)
            mean = flat.div_(over.size)
        at = 0
        with torch.no_grad():
            for state, key in held:
                t = state[key]
                t.copy_(mean[at:at + t.numel()].view(t.shape).to(t.dtype))
                at += t.numel()

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
