"""``compression="auto"``: per bucket, the compressor the measured link and step call for.

    opt = hvd.DistributedOptimizer(opt, named_parameters=..., compression="auto")
    model.register_comm_hook(HookState("auto"), compressed_hook)        # DDP, any backend

``Auto`` is a compressor like the others (it owns its reduction), so both front doors take
it unchanged; each bucket it reduces goes through the option it chose for that bucket:
none (a float32 allreduce), ``BF16``, ``Int8``, ``Int4`` or ``PowerSGD(rank=r)``, each with
its error feedback and tiers (float32 inside a host, the compressor only across the slowest
tier, ``tiers.py``). The choice is ``auto_model.decide``'s; this module measures what it
reads, agrees it across ranks, and re-decides when the numbers move.

Steps. Auto sees only bucket calls. Every rank calls ``reduce`` for the same keys in the
same order (the front doors' contract), so a *step* is counted where a key comes back that
was already reduced since the last step began: the same call on every rank. Everything that
needs the other ranks (the agreements below) happens at such a call, before its bucket's
reduction, so it is never mid-step and every rank issues the same collectives in the same
order.

1. Off: on one host (the Comm's placement says so) or one rank, every bucket is none, at
   once, with no measurement (compression cannot pay where there is no slow tier).
2. Warm-up and calibration: steps 0 to ``warmup - 1`` are not timed (DDP rebuilds its
   buckets after step 0; connections are made) and run the leanest quantizer among the
   options (``WARM``: int4, else int8, else bf16, else none): what they exchange is measured
   by nothing, and a float32 exchange there would only cost a slow link's time. What the
   warm quantizer still owes when its steps end (each rank's residual and the owners')
   goes with each bucket's next exchange, whatever its option, so error feedback's sum
   stays whole across the change (a bucket reduced in tiers, its residuals laid out per
   host, drops them: one step's rounding).
   The probe step (step ``warmup``, where a warm-up precedes, the warm option is a
   quantizer and ``early`` < 1): the buckets still go through the warm quantizer, timed,
   and beside them the link is probed (the latency sample below, then one float32
   allreduce of ``PROBE_BYTES``, or the largest bucket if smaller; neither counted in the
   step's period). At the next step's first call the ranks agree: where the float32
   exchange the probe's rate predicts would have blocked more than ``early`` (half) of the
   step, they decide there, on the probe's rate (no bucket crosses a slow link in float32:
   at 25 Mbit/s a float32 step of the bench's language model took 2.8 s, an int4 step 0.5 s
   and the probe 0.5 s); else the calibration below follows from that step, in float32
   (``auto_policy.py``, 3).
   With local SGD allowed and every rank's parameters attached with its optimizer (agreed
   at the world's first call: one small allreduce), the warm-up and probe steps are a
   local SGD window of their own (``_warm_locally``): each rank steps on its own gradient
   (nothing exchanged; the probe and the arithmetic's timing as above), and after the probe
   step the parameters are averaged once, at once, through the warm quantizer: one
   exchange of the model's elements where the warm-up exchanged every step (at 25 Mbit/s
   the bench's language model's first 10 steps took 0.75-1.3 s more than ``gs-streaming``'s
   this way, 2.0-2.5 s exchanging). That sync's time bounds the rate from below as the
   quantized exchanges' do, and the probe step's compute plus it stands for the step a
   change is tried against. Where what follows exchanges every step (H = 1, or the
   float32 calibration), the optimizers' states, each of which followed its own rank's
   gradients in the window, are averaged at that first call too, over the buckets' comm
   (``auto_local.py``; the Horovod API runs this on its controller's thread, where an
   operation of its own would never run): equal gradients on unequal states would part
   the ranks for good (a first form of this window,
   without it, left the bench's AdamW ranks apart at 1 Gbit/s). Without the optimizer (a
   DDP script's ``attach`` without ``optimizer=``) the warm-up exchanges as above.
   Then ``calibrate`` steps run none, timed: each
   bucket's float32 exchange, the step's period, the time the training thread was blocked
   on the exchange (the Horovod API's optimizer reports its waits, ``blocked``, and so does
   the DDP hook, its wait at the end of backward; unreported, the whole exchange is taken
   as blocked), and a latency: a one-element allreduce, timed after a
   first one has lined the ranks up. Each candidate's arithmetic is timed on the bucket's
   own gradient, on a one-rank loopback (the same work as on n ranks: an owner sums n
   chunks of 1/n), one run each after a small one (its first-call costs), the agreement
   averaging the ranks' runs (the best of two runs on every rank took about half a second
   of a core per rank on buckets of the bench's language model's sizes; each rank timing
   only its share of the candidates would make their times incomparable, each from another
   rank's moment on a shared machine), in the last warm-up step, which nothing times, or in
   the first
   timed step for a bucket that step did not have (DDP's buckets before their
   rebuild) and where no warm-up precedes (a recalibration). (Timed in a calibrated step,
   its time is taken out of the step's while the backward pass may run beside it on the
   DDP hook's thread: in ``gradsync bench compress`` at 1 Gbit/s the calibration's step
   read 157 ms against float32's 217, and the int8 it chose was undone against that.)
   Without a probe step (no quantizer among the options, ``early`` = 1, a recalibration),
   where the first calibrated step spent more than ``early`` of its time in the float32
   exchange, it decides alone: the link is what the decision turns on, and each more
   float32 step costs the most where the link is slowest. Whether it does is read from the
   agreement's averages, the same on every rank (an allreduce more where it does not).
3. Agreement and 4. Drift: ``auto_policy.py`` (the policy half of Auto): every rank's
   numbers are averaged and rank 0's decision taken by all, at the first call of a step;
   every ``check_every`` steps the link and the compute are measured again, and a drift
   that two readings in a row see re-decides; a change of a bucket's option sends what the
   old option still owes with the new option's first exchange.
5. Resize: a Comm of another size (an elastic job's new world) starts again at 2 (or 1).
6. Outcome: ``auto_policy.py``: a change is a trial, undone where the measured steps
   (weighed by their steps factors) do not bear it out.

Local SGD (only with ``local_sgd=H_max`` and the parameters attached, ``auto_local.py``):
the decision also carries H, the syncs' option, float32 or a quantizer, and, with
``local_overlap``, how many steps a sync may run behind the next window before it lands
(``auto_model.choose_period``), sent by rank 0 with the choices. With H > 1 a bucket
returns this rank's own gradient (no collective) and the front door's ``after_step``
averages the parameters at each window's end (at once, or behind); a new H takes effect at
a window's end, or from H = 1 at once: at the step whose first call agreed it, none of its
buckets reduced yet. Drift checks go on in the windows: the rate is
measured from float32 syncs, each reduction timed on its own thread where the comm allows
(through a quantizer, a sync is probed as a compressed exchange is: ``auto_policy.py``,
4), compute from every step (a sync behind runs in it). Changed buckets
calibrate again from the window's end; a resize at once (an elastic re-formation has given
every rank the same parameters).

Reports (``auto_policy.py``): a changed decision at INFO (rank 0) and on the timeline;
``auto.decision`` is the current one, ``latest()`` the newest of any Auto in the process.

State (``state_dict``): the step count, the agreed numbers and choices, H and the window's
place (with local SGD's anchors mid-window), and each inner compressor's residuals, so a
checkpoint or an elastic state carries it (``elastic.py``'s handler: ``sync`` gives every
rank rank 0's, hence the same choices). A state loaded into a world of another size
recalibrates (5).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from . import auto_model as model
from .auto_policy import ORDER, Policy
from .base import ReducingCompressor
from .comm import Loopback
from .powersgd import PowerSGD
from .quantized import BF16, Int4, Int8

if TYPE_CHECKING:
    from .auto_local import LocalSGD

__all__ = ["Auto", "latest", "OPTIONS"]

log = logging.getLogger("gradsync")

OPTIONS = ("none", "bf16", "int8", "int4", "powersgd")
"""The kinds auto may choose from (``options=`` restricts them; none is always there)."""

WARM = ("int4", "int8", "bf16")
"""The warm-up's option: the first of these among the options (none if none is)."""

TOLERANCE = 0.05
"""``Auto(tolerance=)``'s default."""

EARLY = 0.5
"""``Auto(early=)``'s default: where the probe step predicts (or, without one, the first
calibrated step measured) a float32 exchange blocking more than this share of the step, the
ranks decide at once (module docstring, 2)."""

_SMALL = 32  # the side of the matrix each candidate runs on before it is timed

_LIVE: "weakref.WeakSet[Auto]" = weakref.WeakSet()


def latest() -> "model.Decision | None":
    """The newest decision of any ``Auto`` in this process (for a script that passed the
    string ``"auto"`` and holds no instance, and for the bench)."""
    held = [a.decision for a in list(_LIVE) if a.decision is not None]
    return max(held, key=lambda d: d.made, default=None)



class Auto(Policy, ReducingCompressor):
    """Chooses none, bf16, int8, int4 or PowerSGD per bucket from measurements (module docstring).

    Args:
        options: the kinds to choose from, of ``OPTIONS``; none is always one of them.
        powersgd_ranks: PowerSGD's candidate ranks (each an option, the lower the lossier).
        powersgd_steps: PowerSGD rank 4's steps to float32's quality, as a multiple of
            float32's (``auto_model``: what auto minimises is the step's time times this;
            at rank r its excess over 1 is scaled by 4 / r); 1.8 by default, the larger of
            what ``gradsync bench compress``'s two tasks measured (1.83 and 1.2). Set it
            from your own runs: 1 weighs PowerSGD by its step time alone.
        block: the quantizers' (bf16, int8, int4) elements per scale.
        margin: a more faithful option is taken if its predicted time to the target is at
            most this fraction more than the fastest choice's (``auto_model``); 0.02: int8
            over int4 cost 3% a step at 100 Mbit/s where int4 needed no more steps.
        tolerance: a change is undone where the measured steps (times their steps factors)
            got more than this fraction slower; a re-decision keeps the options in force
            within it; local SGD is taken only where it pays beyond it.
        warmup: steps not timed at the start (and after a resize), exchanged through the
            leanest quantizer among the options (``WARM``).
        calibrate: steps timed uncompressed before the first decision.
        check_every: steps between two drift checks.
        drift: relative change of the measured rate or compute that re-decides.
        seed: the inner compressors' seed.
        tiers: the inner compressors' (``tiers.py``): ``"slowest"`` (default) compresses
            only across hosts, and auto is off on one host; ``"all"`` compresses every
            rank's gradient, and auto weighs it even on one host (the ranks' links are then
            the tier measured: loopback TCP, an emulated link).
        local_sgd: the largest H auto may choose for local SGD (parameters averaged every H
            steps, no gradient exchange between); None or 1: never. It runs only once the
            front door attached the parameters (``attach``; ``DistributedOptimizer(...,
            local_sgd=H)`` does) and calls ``after_step`` after each optimizer step.
        early: where the probe step's probe predicts a float32 exchange that would block
            more than this share of the step (without a probe step: where the first
            calibrated step spent more than this share in the float32 exchange), the ranks
            decide at once (a slow link: one probe measures it, and each float32 step costs
            most there); 1: never, no probe step, every calibration takes ``calibrate``
            float32 steps.
        local_steps: local SGD's extra steps to float32's quality, as a fraction of
            float32's, per doubling of H beyond 4 (``auto_model``: a prior, as
            ``powersgd_steps``); 0.2 by default, from ``gradsync bench compress``'s language
            model. Set it from your own runs: 0 takes local SGD's steps as free.
        local_overlap: the most steps a local SGD sync may run behind the next window's
            steps before it lands (those steps kept on top: ``auto_local.py``), where that
            pays (``auto_model``); 0: every sync at once.
        clock: seconds, monotonic (tests give their own).
    """

    def __init__(self, options=OPTIONS, powersgd_ranks=(8, 4, 2), powersgd_steps: float = 1.8,
                 block: int = 1024,
                 margin: float = 0.02, tolerance: float = TOLERANCE, warmup: int = 2,
                 calibrate: int = 2,
                 check_every: int = 16, drift: float = 0.25, seed: int = 0,
                 tiers: str = "slowest", local_sgd: int | None = None,
                 local_steps: float = model.LOCAL_STEPS, early: float = EARLY,
                 local_overlap: int = model.LOCAL_OVERLAP, clock=time.perf_counter):
        super().__init__(seed, tiers)
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"auto: unknown option(s) {sorted(unknown)}; choose from "
                             f"{', '.join(OPTIONS)}")
        for name, value, low in (("warmup", warmup, 0), ("calibrate", calibrate, 1),
                                 ("check_every", check_every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"auto: {name} must be an int >= {low}, got {value!r}")
        if not margin >= 0 or not tolerance >= 0 or not drift > 0:
            raise ValueError(f"auto: margin and tolerance must be >= 0 and drift > 0, got "
                             f"{margin}, {tolerance}, {drift}")
        if local_sgd is not None and (isinstance(local_sgd, bool) or not isinstance(
                local_sgd, int) or local_sgd < 1):
            raise ValueError(f"auto: local_sgd must be None or an int >= 1 (the largest H), "
                             f"got {local_sgd!r}")
        if not powersgd_steps >= 1:
            raise ValueError(f"auto: powersgd_steps must be >= 1 (no lossy option needs fewer "
                             f"steps than float32), got {powersgd_steps!r}")
        self.powersgd_steps = float(powersgd_steps)
        if not local_steps >= 0:
            raise ValueError(f"auto: local_steps must be >= 0, got {local_steps!r}")
        self.periods = model.periods_upto(local_sgd or 1)
        """Local SGD's candidate H (empty: not allowed)."""
        self.local_steps = float(local_steps)
        if isinstance(local_overlap, bool) or not isinstance(local_overlap, int) \
                or local_overlap < 0:
            raise ValueError(f"auto: local_overlap must be an int >= 0, got {local_overlap!r}")
        self.local_overlap = local_overlap
        if not 0 < early <= 1:
            raise ValueError(f"auto: early must be in (0, 1], got {early!r}")
        self.early = float(early)
        self._local: LocalSGD | None = None  # once a front door attaches the parameters
        self._local_pending: dict | None = None  # its state, loaded before it attached
        self._warned = False
        ranks = sorted({int(r) for r in powersgd_ranks}, reverse=True)
        if "powersgd" in options and (not ranks or ranks[-1] < 1):
            raise ValueError(f"auto: powersgd_ranks must be positive ints, got {powersgd_ranks}")
        self.margin, self.drift, self.block = float(margin), float(drift), block
        self.tolerance = float(tolerance)
        self.warmup, self.calibrate, self.check_every = warmup, calibrate, check_every
        self.clock = clock
        # The candidates, most faithful first (auto_model.decide's order).
        # Each candidate is read by its own kind below (Int8's layout, PowerSGD's plan).
        self.inner: dict[str, Any] = {}
        if "bf16" in options:
            self.inner["bf16"] = BF16(block=block, seed=seed, tiers=tiers)
        if "int8" in options:
            self.inner["int8"] = Int8(block=block, seed=seed, tiers=tiers)
        if "int4" in options:
            self.inner["int4"] = Int4(block=block, seed=seed, tiers=tiers)
        if "powersgd" in options:
            for r in ranks:
                self.inner[f"powersgd{r}"] = PowerSGD(rank=r, seed=seed, tiers=tiers)
        self.names = ("none", *self.inner)
        self.warm = next((n for n in WARM if n in self.inner), "none")
        """The option of the warm-up steps (module docstring, 2)."""
        self.decision: model.Decision | None = None
        self.history: list[model.Decision] = []
        """Every decision announced, oldest first (the newest ``HISTORY``)."""
        self._reset(size=None)
        _LIVE.add(self)

    def _describe(self) -> str:
        local = (f", local_sgd<={self.periods[-1]}, local_steps={self.local_steps}"
                 if self.periods
                 else "")
        if self.periods and self.local_overlap != model.LOCAL_OVERLAP:
            local += f", local_overlap={self.local_overlap}"
        # early (whether the ranks agree after one calibrated step) and tolerance (whether
        # they undo a change) must agree too: named where not the default, so that a state
        # of the same settings saved before they existed loads.
        extra = f", early={self.early}" if self.early != EARLY else ""
        extra += f", tolerance={self.tolerance}" if self.tolerance != TOLERANCE else ""
        return (f"auto({'|'.join(self.names)}, block={self.block}, margin={self.margin}, "
                f"drift={self.drift}{local}{extra})")

    # ------------------------------------------------------------------ bookkeeping
    def _reset(self, size) -> None:
        """Back to the start: every bucket none, calibration ahead (a new world too)."""
        self._size = size
        self._step = 0
        self._choice: dict[str, int] = {}
        self._agreed: dict | None = None  # the numbers of the last decision
        self._off = False
        self._calib_from = self.warmup  # the first timed step of the calibration
        # The probe step (module docstring, 2): the first timed step after a warm-up, where
        # a quantizer warms it and the ranks may decide early; None: calibration in float32.
        self._probe_at: int | None = (self.warmup if self.warmup > 0 and self.early < 1
                                      and self.warm != "none" else None)
        self._resized: str | None = None
        # The warm-up and probe steps are a local SGD window of their own (module docstring,
        # 2), through the warm quantizer: ``_warm_locally``.
        self._warm_window = self._warm_ended = False
        self.period = 1  # local SGD's H in force for this step's buckets (1: exchanged)
        self.phase = 0  # this step's place in its window (0 .. period - 1)
        self._target = 1  # the agreed H, in force from the next window
        self._target_sync = 0  # and its sync option (an index in names: 0 is float32)
        self._target_overlap = 0  # and the steps each sync runs behind (0: at once)
        self._sync = 0  # the sync option of the window in force
        self._trial: dict | None = None  # a change on trial (auto_policy.py, 6)
        self._refused: dict[tuple, float] = {}  # options undone -> the rate they were tried at
        self._suspect: tuple[int, int] | None = None  # the drift the last check saw
        self._baseline: float | None = None  # the compressed exchange after the decision
        self._owed: dict[str, dict] = {}  # an old option's residuals, for the next exchange
        self._new_step_state()

    def _new_step_state(self) -> None:
        self._seen: list[str] = []
        self._last_keys: list[str] = []
        self._shapes: dict[str, list[tuple]] = {}
        self._start: float | None = None  # the current step's first call (clock)
        self._times: dict[str, float] = {}  # this step's exchange seconds per key
        self._blocked = 0.0
        self._reported = False
        self._aside = 0.0  # seconds of this step spent measuring (not the step's work)
        # (begin, end) of this step's measuring: its first call's bookkeeping and collectives
        # before the step's clock starts, the arithmetic's timing (``blocked``).
        self._measuring: list[tuple[float, float]] = []
        self._entered: float | None = None  # the step's first call (clock)
        self._waited = 0.0  # the waits reported (``blocked``), measuring and all
        self._window: list[dict] = []  # closed steps since the last agreement
        self._latency: list[float] = []
        self._probes: list[tuple[float, int]] = []  # the probe step's probe (seconds, bytes)
        self._kappa: dict[str, list[float]] = {}
        self._synced = 0.0  # seconds of this step spent in local SGD's sync
        self._syncs: list[float] = []  # the window's syncs (seconds)
        self._stepped = False  # after_step since the last step boundary
        # This step's span (first call to the next step's) had a local SGD sync running
        # behind: in flight at its start, or started in it (``after_step``); and how many
        # syncs behind it started.
        self._beside, self._started = False, 0
        self._check_owed = False  # a drift check waits for the link: a sync runs behind

    def blocked(self, seconds: float) -> None:
        """The front door's training thread waited ``seconds`` on this compressor's
        exchange (the Horovod API's optimizer calls it, and the DDP hook, at the end of
        each backward; a front door that does not is taken to block for the whole
        exchange). The step's compute is its whole span less the whole wait
        (``_close_step``); the exchange's share of the wait (what it did not hide) leaves
        out the part spent in this step's measuring (a probe, a latency sample, an
        agreement, the arithmetic's timing, run where the reductions run)."""
        end = self.clock()
        begin = end - seconds
        measuring = sum(max(0.0, min(end, b) - max(begin, a)) for a, b in self._measuring)
        self._blocked += max(0.0, seconds - measuring)
        self._waited += seconds
        self._reported = True

    # ------------------------------------------------------------------ local SGD
    def attach(self, params, comm="horovod", process_set=None,
               name: str = "auto.local_sgd", optimizer=None) -> None:
        """Gives local SGD the parameters (``auto_local.LocalSGD``): from the next decision
        on, auto may choose H. ``DistributedOptimizer(..., local_sgd=H)`` calls it; a DDP
        script calls it once, with ``comm=TorchComm(group)`` (a group of its own), and
        ``after_step()`` after each optimizer step.

        Args:
            params: the parameters the optimizer steps (the same order on every rank).
            comm: ``"horovod"`` (with ``process_set``) or a ``Comm``.
            name: names the syncs' collectives.
            optimizer: the optimizer that steps ``params``: where every step is exchanged
                again after local SGD, its state is averaged over the ranks
                (``auto_local.py``); without it, a WARNING there.
        """
        if not self.periods:
            raise ValueError(f"{self.describe()} does not allow local SGD: pass "
                             "local_sgd=H (the largest H) to Auto")
        if self.period > 1 and self._local is not None:  # its window's anchors are held
            raise RuntimeError("compression auto: attach() again during a local SGD window")
        from .auto_local import LocalSGD

        self._local = LocalSGD(params, comm, process_set, name,
                               compressor=self._sync_compressor(self._sync), clock=self.clock,
                               optimizer=optimizer)
        if self._local_pending is not None:
            self._local.load_state_dict(self._local_pending, self._sync_compressor(self._sync))
            self._local_pending = None

    def _sync_compressor(self, option: int):
        """A fresh compressor for local SGD's syncs through option ``option`` (None: float32),
        as the candidate of that name is made."""
        if option == 0:
            return None
        like = self.inner[self.names[option]]
        return type(like)(block=self.block, seed=self.seed, tiers=self.tiers)

    def after_step(self) -> None:
        """Call after each optimizer step once attached (DistributedOptimizer does): in a
        local SGD window, lands a sync due; at its end, averages the parameters over the
        ranks, at once or behind the next window's first steps (``auto_local.py``). Timed:
        the drift check's rate (each reduction's own seconds where the reducer tells them)
        and the step's compute (the seconds the training thread spent here). Does nothing
        otherwise, and nothing a second time in a step."""
        if self._local is None or self._stepped or not self._seen:
            return
        self._stepped = True
        if self.period <= 1:
            return
        begin = self.clock()
        took = self._local.tick()
        if self.phase == self.period - 1:
            period, _, starts = self._advance()
            # Behind the next window only where it is local SGD through the same option
            # (its anchors are not taken afresh) and long enough to land the sync in it.
            behind = min(self._target_overlap, period // 2) if period > 1 and not starts else 0
            took += self._local.sync(behind)
            if period == 1 and not self._warm_window:  # every step exchanged from here:
                self._local.align_optimizer(self._step + 1)  # the optimizers' states too
            if behind:
                self._beside, self._started = True, self._started + 1
        spent = self.clock() - begin
        self._synced += spent
        self._syncs.extend(t for t in took if t is not None)

    def in_flight(self) -> bool:
        """Whether a local SGD sync runs behind the steps (``local_overlap``)."""
        return self._local is not None and self._local.in_flight()

    def settle(self) -> None:
        """Waits for a local SGD sync still running behind (``local_overlap``); it lands at
        its own step all the same. Nothing to wait for otherwise."""
        if self._local is not None:
            self._local.settle()

    # ------------------------------------------------------------------ the reduction
    def reduce(self, flat: torch.Tensor, shapes: list, comm, key: str | None,
               average: bool) -> torch.Tensor:
        """See ``base``; the bucket goes through the option chosen for ``key``."""
        if key is None:  # no state, no steps: a one-off call is none
            return self._none(flat.detach().to(torch.float32, copy=True), comm, average)
        shapes = [tuple(s) for s in shapes]
        self._at_call(key, shapes, comm)
        name = (self.warm if self._warming() or self._probing()
                else self.names[self._choice.get(key, 0)])
        start = self.clock()
        x = flat
        if key in self._owed or self.period > 1 or name == "none":
            # What an earlier option still owes goes into this exchange's input, whatever the
            # option now (module docstring, 2; auto_policy.py, 4): error feedback stays whole.
            x = flat.detach().to(torch.float32, copy=True)
            self._pay_owed(key, x, comm, average)
        if self.period > 1:  # local SGD: this rank's own gradient, nothing exchanged
            out = x
        elif name == "none":
            out = self._none(x, comm, average)
        else:
            out = self.inner[name].reduce(x, shapes, comm, key, average)
        self._times[key] = self._times.get(key, 0.0) + self.clock() - start
        if self._arithmetic_due(key):
            begin = self.clock()
            self._kappa[key] = self._arithmetic(flat, shapes)
            self._aside += self.clock() - begin
            self._measuring.append((begin, self.clock()))
        return out

    def _arithmetic_due(self, key: str) -> bool:
        """Whether this bucket's candidates are timed now (module docstring, 2): in the last
        warm-up step, which nothing times, or else (no warm-up before this calibration, or
        a bucket that step did not have) in the first calibrated step that has it."""
        if (self._off or self._agreed is not None or (self.period != 1 and not self._warm_window)
                or key in self._kappa or not self.inner):
            return False
        return (self._step == self._calib_from - 1 and self._warming()) or self._timing()

    def _pay_owed(self, key: str, x: torch.Tensor, comm, average: bool) -> None:
        """Adds to ``x`` what an earlier option still owes for ``key`` (``_owe``): this
        rank's residual, and the owner's for the chunk it owned (in the averaged domain
        where the reduction averages: times n here, the sum divides by n). Error feedback's
        sum stays whole across the change; under local SGD the parameters' average takes it
        the same way. Owed in a world of another size, it is let go."""
        held = self._owed.pop(key, None)
        if not held:
            return
        residual = held["residual"]
        if residual.numel() != x.numel():
            return
        x += residual
        owner = f"owner{comm.rank}of{comm.size}"
        if owner in held:
            piece = held[owner].reshape(-1)
            start = comm.rank * piece.numel()
            end = min(x.numel(), start + piece.numel())
            if end > start:
                x[start:end] += piece[:end - start] * (comm.size if average else 1)

    def _none(self, x: torch.Tensor, comm, average: bool) -> torch.Tensor:
        if comm.size > 1 and x.numel():
            comm.allreduce_sum_(x)
        if average:
            x /= comm.size
        return x

    def _warming(self) -> bool:
        """A warm-up step: not timed, exchanged through ``self.warm`` (module docstring, 2),
        or local in the warm-up's window."""
        return (not self._off and self._step < self._calib_from and self._agreed is None
                and (self.period == 1 or self._warm_window) and not self._choice)

    def _probing(self) -> bool:
        """The probe step: timed, exchanged through ``self.warm`` (or local in the warm-up's
        window), with a float32 probe of the link beside it (module docstring, 2)."""
        return (self._probe_at is not None and self._step == self._probe_at
                and self._timing() and not self._choice)

    def _timing(self) -> bool:
        return (not self._off and self._step >= self._calib_from and self._agreed is None
                and (self.period == 1 or self._warm_window))

    def _at_call(self, key: str, shapes: list[tuple], comm) -> None:
        """A bucket call's bookkeeping: a new world, a new step, and what the step boundary
        brings (an agreement, a drift check): all before the bucket is reduced."""
        entered = self.clock()
        if self._size != comm.size:
            before = self._size
            self._reset(comm.size)
            self._off = not self._spans_hosts(comm)
            if self._off:
                self._announce(comm, self._off_decision(comm, "one host" if comm.size > 1
                                                          else "one rank"))
            elif before is not None:
                log.info("compression auto: the world changed from %d to %d ranks; "
                         "uncompressed until measured again", before, comm.size)
                self._resized = f"resize {before} -> {comm.size} ranks"
            if not self._off:
                self._warm_locally(comm)
        if key in self._seen:
            self._close_step()
            if not self._off:
                # ">": a state saved at a step's end and loaded numbers the step after it as
                # its first, so the boundary may be passed without its first call.
                probe_at = self._probe_at
                probed = probe_at is not None
                if self._agreed is None and probe_at is not None and self._step > probe_at:
                    # Decided from the probe where the link is slow, else calibration goes
                    # on in float32 (auto_policy.py, 3).
                    self._agree(comm, self._resized or "calibrated", early=True)
                elif (self._agreed is None and not probed
                      and self._step >= self._calib_from + self.calibrate):
                    self._agree(comm, self._resized or "calibrated")
                elif (self._agreed is None and not probed
                      and self._step == self._calib_from + 1 and self.early < 1):
                    self._agree(comm, self._resized or "calibrated", early=True)
                elif self._agreed is not None and (self._step % self.check_every == 0
                                                   or self._check_owed or self._trial_due()):
                    # Not while a sync runs behind (the same on every rank): its allreduces
                    # would queue on the link behind the sync's bytes (0.05-0.24 s a check
                    # at 25 Mbit/s); at the first step with none in flight instead.
                    self._check_owed = self.in_flight() and not self._trial_due()
                    if not self._check_owed and self._keys() != self._agreed["keys"]:
                        # The buckets changed (a parameter group added, DDP's buckets
                        # rebuilt): the same keys on every rank, so every rank starts
                        # calibrating again here, with no collective.
                        self._recalibrate("the buckets changed")
                    elif not self._check_owed:
                        self._check(comm)
                if self.period == 1 and self._target > 1 and self._local is not None:
                    self._start_window()
        if not self._seen:
            if self._warm_ended:  # the first step after the warm-up's window
                self._warm_ended = False
                if self.period == 1:  # exchanged (H = 1, calibration): the optimizers too,
                    assert self._local is not None  # (the warm window was attached)
                    self._local.align_optimizer(self._step, comm)  # over the buckets' comm
            if self._timing():  # a latency sample: the first allreduce lines ranks up
                one = torch.zeros(1)
                comm.allreduce_sum_(one)
                begin = self.clock()
                comm.allreduce_sum_(one)
                self._latency.append(self.clock() - begin)
                if self._probing() and self._last_keys:
                    # Sized by the last step's buckets, the same on every rank (this step's
                    # are not known yet; with DDP's rebuild after step 0 they may differ).
                    probe = torch.zeros(self._probe_bytes(self._last_keys) // 4)
                    begin = self.clock()
                    comm.allreduce_sum_(probe)
                    self._probes.append((self.clock() - begin, 4 * probe.numel()))
            self._start = self.clock()
            self._beside, self._started = self.in_flight(), 0  # (see __init__)
            self._measuring = [(entered, self._start)]  # the step boundary's own work
            self._entered = entered
        self._seen.append(key)
        self._shapes[key] = shapes

    def _start_window(self) -> None:
        """H > 1 agreed at this step's first call, none of its buckets reduced yet, the last
        step exchanged: the ranks' parameters (and their optimizers' states) are equal, so
        the window starts at this step, its anchors the parameters now."""
        assert self._local is not None  # (the caller's condition)
        self.period, self.phase, self._sync = self._target, 0, self._target_sync
        self._local.restart(self._sync_compressor(self._sync))

    def _warm_locally(self, comm) -> None:
        """At the first call of a world's first step: where the probe step decides and
        every rank attached its parameters and optimizer (agreed here: one small
        allreduce), the warm-up and probe steps are a local SGD window through the warm
        quantizer, synced at once after the probe step (module docstring, 2). The ranks'
        parameters are equal here: the job's start, or a re-formation's."""
        if self._probe_at is None or not self.periods:
            return
        mine = self._local is not None and self._local.optimizer is not None
        if self._average(comm, [1.0 if mine else 0.0])[0] < 1.0:
            return
        assert self._local is not None
        self.period, self.phase = self._probe_at + 1, 0
        self._sync, self._warm_window = self.names.index(self.warm), True
        self._local.restart(self._sync_compressor(self._sync))

    def _close_step(self) -> None:
        now = self.clock()
        exchange = sum(self._times.values())
        if self._start is not None and self._step >= self._calib_from:
            blocked = min(self._blocked, exchange) if self._reported else exchange
            # The step's compute: its whole span less what the training thread waited (a
            # front door that reports it), or less the exchange and the measuring it ran
            # itself (one that does not); the measuring a reporting front door runs beside
            # the training thread (the DDP hook's thread) overlaps the step's compute.
            span = now - (self._entered if self._entered is not None else self._start)
            spent = (self._waited if self._reported
                     else exchange + sum(b - a for a, b in self._measuring))
            self._window.append({"period": now - self._start - self._aside - self._synced,
                                 "compute": span - spent - self._synced,
                                 "exchange": exchange, "local": self.period > 1,
                                 "beside": self._beside, "started": self._started,
                                 "blocked": blocked, "times": dict(self._times)})
        warmed = self._warming() or self._probing()
        self._step += 1
        self._last_keys = list(self._seen)
        self._owed = {}  # paid in the step after it was owed, or never (a key not back)
        if warmed and not (self._warming() or self._probing()) and self.warm != "none":
            # The warm quantizer's steps end: what they still owe is sent with each
            # bucket's next exchange, float32 or the option decided (``_owe``), and its
            # state goes.
            held = self.inner[self.warm].state.tensors
            for k in sorted({k.partition("@")[0] for k in held}):
                self._owe(self.warm, k)
        self._seen, self._times = [], {}
        self._blocked, self._reported, self._aside, self._synced = 0.0, False, 0.0, 0.0
        self._waited = 0.0
        self._start = now
        self._next_window()

    def _advance(self) -> tuple[int, int, bool]:
        """(H, place) of the next step, and whether a window starts there after steps that
        exchanged gradients or through another sync option (its anchors are the parameters
        then: equal on every rank)."""
        if self.period > 1 and self.phase < self.period - 1:
            return self.period, self.phase + 1, False
        target = self._target if self._local is not None else 1
        return target, 0, target > 1 and (self.period == 1 or self._target_sync != self._sync)

    def _next_window(self) -> None:
        """The step boundary of local SGD's windows (the module docstring)."""
        if (self.period > 1 and self.phase == self.period - 1 and self._local is not None
                and not self._stepped):
            raise RuntimeError(
                f"compression auto: local SGD's window of {self.period} steps ended at step "
                f"{self._step - 1} without after_step() (the parameters were not averaged); "
                "call it after each optimizer step (DistributedOptimizer does)")
        was = self.period
        self.period, self.phase, starts = self._advance()
        self._stepped = False
        if self._warm_window and self.phase == 0:  # the warm-up's window ended (synced)
            self._warm_window, self._warm_ended = False, True
            return
        if starts:
            assert self._local is not None  # a window of H > 1 starts only once attached
            self._sync = self._target_sync
            # The ranks' parameters are equal: the window's anchors.
            self._local.restart(self._sync_compressor(self._sync))
        elif was > 1 and self.period == 1 and self._agreed is None:
            self._calib_from = self._step  # a recalibration waited for this window's end

    def _arithmetic(self, flat: torch.Tensor, shapes: list[tuple]) -> list[float]:
        """Seconds of each candidate's arithmetic on this bucket: one run, after a run on a
        small matrix has paid its first-call costs (module docstring, 2)."""
        loop = Loopback()
        x = flat.detach().to(torch.float32, copy=True)
        small = torch.ones(_SMALL * _SMALL)
        out = []
        for c in self.inner.values():
            c._reduce(small.clone(), [(_SMALL, _SMALL)], loop, None, False)
            begin = self.clock()
            c._reduce(x.clone(), shapes, loop, None, False)
            out.append(self.clock() - begin)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The decision, its numbers, the step count and the inner compressors' states."""
        # Taken between steps: the step whose buckets were all reduced counts as done, so a
        # restored run numbers its steps (and checks, and windows) as this one would.
        period, phase, local, sync = self.period, self.phase, None, self._sync
        if self._seen:
            period, phase, starts = self._advance()
            if starts:  # the parameters now are the next window's anchors
                assert self._local is not None  # a window of H > 1 starts only once attached
                sync = self._target_sync
                local = self._local.anchored_now(self._sync_compressor(sync))
        if local is None and period > 1:  # mid-window: its anchors
            local = (self._local.state_dict() if self._local is not None
                     else self._local_pending)
        return {"compressor": self.describe(), "seed": self.seed,
                "auto": {"step": self._step + (1 if self._seen else 0), "size": self._size,
                         "period": period, "phase": phase, "target": self._target,
                         "target_sync": self._target_sync,
                         "target_overlap": self._target_overlap, "sync": sync, "local": local,
                         "off": self._off, "check_owed": self._check_owed,
                         "calib_from": self._calib_from, "probe_at": self._probe_at,
                         "warm_window": self._warm_window and phase > 0,
                         "warm_ended": self._warm_ended or (self._warm_window and phase == 0),
                         "choice": dict(self._choice),
                         "agreed": None if self._agreed is None else dict(self._agreed),
                         "trial": None if self._trial is None else dict(self._trial),
                         "refused": [[list(c), r] for c, r in self._refused.items()],
                         "suspect": None if self._suspect is None else list(self._suspect),
                         "baseline": self._baseline,
                         "shapes": {k: list(v) for k, v in self._shapes.items()},
                         "decision": None if self.decision is None else
                         self.decision.to_dict()},
                "inner": {name: c.state_dict() for name, c in self.inner.items()}}

    def load_state_dict(self, state: dict) -> None:
        state = self._translated(state)
        if state.get("compressor") != self.describe() or state.get("seed") != self.seed:
            raise ValueError(f"a state of {state.get('compressor')!r} (seed "
                             f"{state.get('seed')}) cannot be loaded into {self.describe()} "
                             f"(seed {self.seed})")
        for name, c in self.inner.items():
            if name in state["inner"]:
                c.load_state_dict(state["inner"][name])
        a = state["auto"]
        self._size, self._step, self._off = a["size"], int(a["step"]), bool(a["off"])
        self._calib_from, self._resized = int(a["calib_from"]), None
        probe_at = a.get("probe_at")  # absent in a state saved before the probe step: none
        self._probe_at = None if probe_at is None else int(probe_at)
        self._warm_window = bool(a.get("warm_window", False))
        self._warm_ended = bool(a.get("warm_ended", False))
        self._choice = {str(k): int(v) for k, v in a["choice"].items()}
        self._agreed = None if a["agreed"] is None else dict(a["agreed"])
        self._trial = None if a.get("trial") is None else dict(a["trial"])
        self._refused = {tuple(c): float(r) for c, r in a.get("refused", [])}
        suspect = a.get("suspect")
        self._suspect = None if suspect is None else (int(suspect[0]), int(suspect[1]))
        self._baseline = a.get("baseline")
        self._check_owed = bool(a.get("check_owed", False))
        self._new_step_state()  # timers start again: a restored step is not measured
        self.period, self.phase = int(a.get("period", 1)), int(a.get("phase", 0))
        self._target = int(a.get("target", 1))
        self._target_sync, self._sync = int(a.get("target_sync", 0)), int(a.get("sync", 0))
        self._target_overlap = int(a.get("target_overlap", 0))
        if a.get("local") is not None:
            if self._local is not None:
                self._local.load_state_dict(a["local"], self._sync_compressor(self._sync))
            else:  # the front door attaches later (auto_local.py)
                self._local_pending = a["local"]
        self._shapes = {k: [tuple(s) for s in v] for k, v in a["shapes"].items()}
        self.decision = None if a["decision"] is None else dataclasses.replace(
            model.Decision(**a["decision"]), made=next(ORDER))

    def _translated(self, state: dict) -> dict:
        """``state`` as this Auto's where it differs only in what steers rank 0's next
        decisions (the margin; local SGD's prior, ``local_steps``, once ``share``), which need
        not match; and with its options' numbers renumbered to this Auto's where it was saved
        by an Auto of before int4 was an option (``none|bf16|int8|powersgd8|...``), whose
        options are a subset of these; any other state as it is (``load_state_dict`` then
        refuses what does not match). An option new to this Auto starts with no residual, as
        a fresh one does."""
        saved, mine = str(state.get("compressor", "")), self.describe()
        head, here = saved.partition(",")[0], mine.partition(",")[0]
        if saved == mine or not head.startswith("auto("):
            return state
        if _margin_out(saved) == _margin_out(mine):
            return {**state, "compressor": mine}
        old = head[len("auto("):].split("|")
        if "int4" in old or not set(old) <= set(self.names):
            return state
        # Such a state was saved under the margin then the default (0.05, now 0.02): the
        # margin steers rank 0's next decisions only, so it need not match.
        if _margin_out(saved[len(head):]) != _margin_out(mine[len(here):]):
            return state
        to = [self.names.index(n) for n in old]
        a = dict(state["auto"])
        a["choice"] = {k: to[int(v)] for k, v in a["choice"].items()}
        if a.get("trial") is not None:
            a["trial"] = {**a["trial"], "old": [to[int(v)] for v in a["trial"]["old"]],
                          "new": [to[int(v)] for v in a["trial"]["new"]]}
        a["refused"] = [[[to[int(v)] for v in c], r] for c, r in a.get("refused", [])]
        return {**state, "compressor": mine, "auto": a}


def _margin_out(settings: str) -> str:
    """``describe()``'s settings without what steers rank 0's decisions only: the margin,
    local SGD's prior (``local_steps``, once ``share``) and how far its syncs may overlap."""
    return re.sub(r", (margin|share|local_steps|local_overlap)=[^,)]*", "", settings)
