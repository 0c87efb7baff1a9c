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
   warm-up still owes (each rank's residual and the owners') goes with the first float32
   exchange of each bucket, so error feedback's sum stays whole across the change (a
   bucket reduced in tiers, its residuals laid out per host, drops them: one step's
   rounding).
   Steps ``warmup`` to ``warmup + calibrate - 1`` run none, timed: each
   bucket's float32 exchange, the step's period, the time the training thread was blocked
   on the exchange (the Horovod API's optimizer reports its waits, ``blocked``, and so does
   the DDP hook, its wait at the end of backward; unreported, the whole exchange is taken
   as blocked), and a latency: a one-element allreduce, timed after a
   first one has lined the ranks up. Each candidate's arithmetic is timed on the bucket's
   own gradient, on a one-rank loopback (the same work as on n ranks: an owner sums n
   chunks of 1/n), in the last warm-up step, which nothing times, or in the first
   calibrated step for a bucket that step did not have (DDP's buckets before their
   rebuild) and where no warm-up precedes (a recalibration). (Timed in a calibrated step,
   its time is taken out of the step's while the backward pass may run beside it on the
   DDP hook's thread: in ``gradsync bench compress`` at 1 Gbit/s the calibration's step
   read 157 ms against float32's 217, and the int8 it chose was undone against that.)
   Where the first calibrated step spent more than ``early`` (half) of its time in the
   float32 exchange, it decides alone: the link is what
   the decision turns on, a step measures it well, and each more float32 step costs the
   most where the link is slowest (2.8 s a step at 25 Mbit/s on the bench's language model,
   against 0.5 s with int4). Whether it does is read from the agreement's averages, the
   same on every rank (an allreduce more where it does not).
3. Agreement: at the first call of the next step, every rank's numbers are averaged (one
   allreduce: the same bytes on every rank), then rank 0's decision is sent to all (a second
   allreduce, every other rank adding zeros): every rank uses rank 0's choice, even where a
   rank's own arithmetic would have rounded differently.
4. Drift: every ``check_every`` steps the same two allreduces carry the window's numbers;
   the link's rate is measured again, and the step's compute. Beyond ``drift`` (a fraction)
   from what the decision used, the same way at two readings in a row, rank 0 decides again
   (a single slow probe, a loss episode on a slow link, is not a slower link: read as one,
   it switched a 25 Mbit/s run from int4 to PowerSGD and back, each switch costing
   steps; under local SGD a check without a sync has no new rate, and the first reading
   waits for the next sync's). A re-decision keeps the options in force where their
   predicted time to the target comes within ``tolerance`` of the new choice's: a change
   starts error feedback (and PowerSGD's warm start) afresh and costs steps (at 25 Mbit/s
   the bench's language model went from PowerSGD to int4 at step 32, a near tie, and
   needed 112 steps, where int4 alone needed 88 and PowerSGD 152 in about the same time).
   A change of a bucket's option (a decision, an undo) sends what the old option still
   owes (each rank's residual, laid out as the bucket: PowerSGD's over its matrices; a
   quantizer's owners' too) with the new option's first exchange, as after the warm-up
   (2): nothing of the gradients is lost. Where every bucket is none, the rate
   comes from their float32 exchanges, as in calibration. Where a bucket is compressed, its
   exchange says little about the link: a few hundred kilobytes of PowerSGD factors take a
   millisecond of wire and tens of milliseconds of arithmetic, small collectives and waiting
   for the other ranks, and what is left after subtracting the modelled part is mostly what
   the model leaves out. Read as a rate, it made the link look slower at each check, which
   chose more compression, whose exchange looked slower still (a 1 Gbit link read as 85
   Mbit/s in ``gradsync bench compress``). So the check measures the link itself: one float32
   allreduce of a probe (``PROBE_BYTES``, or the largest bucket if smaller), timed after a
   one-element allreduce has lined the ranks up. A probe costs a slow link's time (1 MiB:
   0.5 s at 25 Mbit/s, 4% of an int4 run's steps there with a probe every 16), so it runs
   at the first check after a decision, which also takes the compressed exchange's time as
   its measure, and after that only where a reading suspects the rate: a compressed
   exchange that moved by more than ``drift`` from its measure is read as a suspicion (not
   as a rate), which the next check's probe confirms or clears (a link as it was: the
   exchange moved for another reason, and its time is the new measure).
5. Resize: a Comm of another size (an elastic job's new world) starts again at 2 (or 1).
6. Outcome: a decision that changes a bucket's option is a trial. At the next check, the
   window's median step (every rank's, averaged) is compared with the median step of the
   window that led to it, each times its choice's steps factor (what the model minimises is
   the time to the target, not the step: a lossier choice's shorter steps must also pay for
   the steps it adds); slower by more than ``tolerance``, the change is undone (the earlier
   options again, the numbers that led to it kept as the agreed ones) and the option it tried
   is refused until the link's measured rate moves by more than ``drift`` from the rate it was
   tried at. The model does not see everything a compressor costs: on ranks that share their
   cores, the arithmetic of a compressor slows the backward pass beside it, which a drift
   check then reads as more compute and a slower link, and chooses more compression (in
   ``gradsync bench compress`` at 1 Gbit/s, four ranks on two cores: none, then int8 for one
   bucket, then both, the steps twice as long as float32's). The step itself is the measure.

Local SGD (only with ``local_sgd=H_max`` and the parameters attached, ``auto_local.py``):
the decision also carries H (``auto_model.choose_period``), sent by rank 0 with the
choices. With H > 1 a bucket returns this rank's own gradient (no collective) and the
front door's ``after_step`` averages the parameters at each window's end; a new H takes
effect at a window's end (or at once from H = 1), where the ranks' parameters are equal.
Drift checks go on in the windows: the rate is measured from the syncs, compute from every
step. Changed buckets calibrate again from the window's end; a resize at once (an elastic
re-formation has given every rank the same parameters).

Reports. A changed decision is logged at INFO once (rank 0; ``Decision.summary``: per tier
and bucket class, and the numbers behind it) and marked on the timeline (``AUTO`` on the
``compression`` row, every rank, when the Horovod API's timeline records). ``auto.decision``
is the current one, ``latest()`` the newest of any Auto in the process.

State (``state_dict``): the step count, the agreed numbers and choices, H and the window's
place (with local SGD's anchors mid-window), and each inner compressor's residuals, so a
checkpoint or an elastic state carries it (``elastic.py``'s handler: ``sync`` gives every
rank rank 0's, hence the same choices). A state loaded into a world of another size
recalibrates (5).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import statistics
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from . import auto_model as model
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
"""``Auto(early=)``'s default: a first calibrated step that spent more than this share of
its time in the float32 exchange decides alone (module docstring, 2)."""

HISTORY = 32
"""Decisions ``Auto.history`` keeps."""

_TINY = 1e-6  # seconds: a floor for measured wire times (a division by them follows)

PROBE_BYTES = 1 << 20
"""Bytes of the float32 allreduce a drift check times where a bucket is compressed (module
docstring, 4): large enough that the wire, not the latency, is most of its time on the links
auto weighs (8 ms at 1 Gbit/s, 0.3-0.5 s at 25 Mbit/s, at the checks that need it)."""

_LIVE: "weakref.WeakSet[Auto]" = weakref.WeakSet()
_ORDER = itertools.count(1)


def latest() -> "model.Decision | None":
    """The newest decision of any ``Auto`` in this process (for a script that passed the
    string ``"auto"`` and holds no instance, and for the bench)."""
    held = [a.decision for a in list(_LIVE) if a.decision is not None]
    return max(held, key=lambda d: d.made, default=None)



class Auto(ReducingCompressor):
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
        early: a first calibrated step that spent more than this share of its time in the
            float32 exchange decides alone (a slow link: one step measures it, and each more
            float32 step costs most there); 1: never, every calibration takes ``calibrate``
            steps.
        local_share: local SGD's H is the smallest that brings the exchange under this
            share of the step's compute (``auto_model.choose_period``).
        clock: seconds, monotonic (tests give their own).
    """

    def __init__(self, options=OPTIONS, powersgd_ranks=(8, 4, 2), powersgd_steps: float = 1.8,
                 block: int = 1024,
                 margin: float = 0.02, tolerance: float = TOLERANCE, warmup: int = 2,
                 calibrate: int = 2,
                 check_every: int = 16, drift: float = 0.25, seed: int = 0,
                 tiers: str = "slowest", local_sgd: int | None = None,
                 local_share: float = 0.1, early: float = EARLY, clock=time.perf_counter):
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
        if not 0 < local_share < 1:
            raise ValueError(f"auto: local_share must be in (0, 1), got {local_share!r}")
        self.periods = model.periods_upto(local_sgd or 1)
        """Local SGD's candidate H (empty: not allowed)."""
        self.share = float(local_share)
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
        local = (f", local_sgd<={self.periods[-1]}, share={self.share}" if self.periods
                 else "")
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
        self._resized: str | None = None
        self.period = 1  # local SGD's H in force for this step's buckets (1: exchanged)
        self.phase = 0  # this step's place in its window (0 .. period - 1)
        self._target = 1  # the agreed H, in force from the next window
        self._trial: dict | None = None  # a change on trial (module docstring, 6)
        self._refused: dict[tuple, float] = {}  # options undone -> the rate they were tried at
        self._suspect: tuple[int, int] | None = None  # the drift the last check saw
        self._baseline: float | None = None  # the compressed exchange after the decision
        self._owed: dict[str, dict] = {}  # an old option's residuals, for the next exchange
        self._new_step_state()

    def _new_step_state(self) -> None:
        self._seen: list[str] = []
        self._last_keys: list[str] = []
        self._shapes: dict[str, list[tuple]] = {}
        self._start = None  # the current step's first call (clock)
        self._times: dict[str, float] = {}  # this step's exchange seconds per key
        self._blocked = 0.0
        self._reported = False
        self._aside = 0.0  # seconds of this step spent measuring (not the step's work)
        self._window: list[dict] = []  # closed steps since the last agreement
        self._latency: list[float] = []
        self._kappa: dict[str, list[float]] = {}
        self._synced = 0.0  # seconds of this step spent in local SGD's sync
        self._syncs: list[float] = []  # the window's syncs (seconds)
        self._stepped = False  # after_step since the last step boundary

    def blocked(self, seconds: float) -> None:
        """The front door's training thread waited ``seconds`` on this compressor's
        exchange (the Horovod API's optimizer calls it, and the DDP hook, at the end of
        each backward; a front door that does not is taken to block for the whole
        exchange)."""
        self._blocked += seconds
        self._reported = True

    # ------------------------------------------------------------------ local SGD
    def attach(self, params, comm="horovod", process_set=None,
               name: str = "auto.local_sgd") -> None:
        """Gives local SGD the parameters (``auto_local.LocalSGD``): from the next decision
        on, auto may choose H. ``DistributedOptimizer(..., local_sgd=H)`` calls it; a DDP
        script calls it once, with ``comm=TorchComm(group)`` (a group of its own), and
        ``after_step()`` after each optimizer step.

        Args:
            params: the parameters the optimizer steps (the same order on every rank).
            comm: ``"horovod"`` (with ``process_set``) or a ``Comm``.
            name: names the syncs' collectives.
        """
        if not self.periods:
            raise ValueError(f"{self.describe()} does not allow local SGD: pass "
                             "local_sgd=H (the largest H) to Auto")
        if self.period > 1 and self._local is not None:  # its window's anchors are held
            raise RuntimeError("compression auto: attach() again during a local SGD window")
        from .auto_local import LocalSGD

        self._local = LocalSGD(params, comm, process_set, name)
        if self._local_pending is not None:
            self._local.load_state_dict(self._local_pending)
            self._local_pending = None

    def after_step(self) -> None:
        """Call after each optimizer step once attached (DistributedOptimizer does): at a
        local SGD window's end, averages the parameters over the ranks (timed: the drift
        check's rate). Does nothing otherwise, and nothing a second time in a step."""
        if self._local is None or self._stepped or not self._seen:
            return
        self._stepped = True
        if self.period > 1 and self.phase == self.period - 1:
            begin = self.clock()
            self._local.sync()
            spent = self.clock() - begin
            self._synced += spent
            self._syncs.append(spent)

    # ------------------------------------------------------------------ the reduction
    def reduce(self, flat: torch.Tensor, shapes: list, comm, key: str | None,
               average: bool) -> torch.Tensor:
        """See ``base``; the bucket goes through the option chosen for ``key``."""
        if key is None:  # no state, no steps: a one-off call is none
            return self._none(flat.detach().to(torch.float32, copy=True), comm, average)
        shapes = [tuple(s) for s in shapes]
        self._at_call(key, shapes, comm)
        name = self.warm if self._warming() else self.names[self._choice.get(key, 0)]
        start = self.clock()
        x = flat
        if key in self._owed or self.period > 1 or name == "none":
            # What an earlier option still owes goes into this exchange's input, whatever
            # the option now (module docstring, 2 and 4): error feedback's sum stays whole.
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
        return out

    def _arithmetic_due(self, key: str) -> bool:
        """Whether this bucket's candidates are timed now (module docstring, 2): in the last
        warm-up step, which nothing times, or else (no warm-up before this calibration, or
        a bucket that step did not have) in the first calibrated step that has it."""
        if (self._off or self._agreed is not None or self.period != 1 or key in self._kappa
                or not self.inner):
            return False
        return (self._step == self._calib_from - 1 and self._warming()) or self._timing()

    def _owed_by(self, name: str, key: str) -> dict[str, torch.Tensor] | None:
        """What option ``name`` still owes for ``key``, laid out as the bucket: this rank's
        residual (PowerSGD's covers its matrices: zeros elsewhere) and, for a quantizer, the
        owner's residual of the chunk this rank owned; None where it holds none, or holds
        them per host (a bucket reduced in tiers: ``key@path`` states), which is let go
        (one step's rounding)."""
        c = self.inner.get(name)
        held = c.state.tensors.get(key) if c is not None else None
        if not held or "residual" not in held:
            return None
        if not isinstance(c, PowerSGD):  # a quantizer: the bucket's residual, a chunk's
            return {k: v for k, v in held.items() if k == "residual" or k.startswith("owner")}
        shapes = self._shapes.get(key, [])
        residual, flat = held["residual"], torch.zeros(self._numel(key))
        at = done = 0
        for shape, plan in zip(shapes, c.plan(shapes)):
            n = _numel(shape)
            if plan is not None:  # a compressed matrix: its residual is the next n elements
                if done + n > residual.numel():
                    return None
                flat[at:at + n] = residual[done:done + n]
                done += n
            at += n
        return {"residual": flat} if done == residual.numel() else None

    def _owe(self, name: str, key: str) -> None:
        """Keeps what option ``name`` still owes for ``key``, to go with the bucket's next
        exchange (``_pay_owed``), and drops every inner state of ``key`` (``_forget``)."""
        owed = self._owed_by(name, key)
        self._forget(key)
        if owed is None:
            return
        held = self._owed.setdefault(key, {})
        for part, value in owed.items():
            held[part] = held[part] + value if part in held else value.clone()

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
        """A warm-up step: not timed, exchanged through ``self.warm`` (module docstring, 2)."""
        return (not self._off and self._step < self._calib_from and self._agreed is None
                and self.period == 1 and not self._choice)

    def _timing(self) -> bool:
        return (not self._off and self._step >= self._calib_from and self._agreed is None
                and self.period == 1)

    def _at_call(self, key: str, shapes: list[tuple], comm) -> None:
        """A bucket call's bookkeeping: a new world, a new step, and what the step boundary
        brings (an agreement, a drift check): all before the bucket is reduced."""
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
        if key in self._seen:
            self._close_step()
            if not self._off:
                if self._agreed is None and self._step == self._calib_from + self.calibrate:
                    self._agree(comm, self._resized or "calibrated")
                elif (self._agreed is None and self._step == self._calib_from + 1
                      and self.early < 1):
                    self._agree(comm, self._resized or "calibrated", early=True)
                elif self._agreed is not None and self._step % self.check_every == 0:
                    if self._keys() != self._agreed["keys"]:
                        # The buckets changed (a parameter group added, DDP's buckets
                        # rebuilt): the same keys on every rank, so every rank starts
                        # calibrating again here, with no collective.
                        self._recalibrate("the buckets changed")
                    else:
                        self._check(comm)
        if not self._seen:
            if self._timing():  # a latency sample: the first allreduce lines ranks up
                one = torch.zeros(1)
                comm.allreduce_sum_(one)
                begin = self.clock()
                comm.allreduce_sum_(one)
                self._latency.append(self.clock() - begin)
            self._start = self.clock()
        self._seen.append(key)
        self._shapes[key] = shapes

    def _recalibrate(self, why: str) -> None:
        log.info("compression auto (step %d): %s; uncompressed until measured again",
                 self._step, why)
        self._choice, self._agreed, self._resized = {}, None, why
        self._target = 1
        self._trial, self._refused, self._suspect = None, {}, None
        self._baseline = None
        # Mid-window, calibration starts after the window's sync (the ranks equal again).
        self._calib_from = self._step + (self.period - self.phase if self.period > 1 else 0)
        self._window, self._latency, self._kappa = [], [], {}
        self._syncs = []

    def _close_step(self) -> None:
        now = self.clock()
        exchange = sum(self._times.values())
        if self._start is not None and self._step >= self._calib_from:
            blocked = min(self._blocked, exchange) if self._reported else exchange
            self._window.append({"period": now - self._start - self._aside - self._synced,
                                 "exchange": exchange, "local": self.period > 1,
                                 "blocked": blocked, "times": dict(self._times)})
        warmed = self._warming()
        self._step += 1
        self._last_keys = list(self._seen)
        self._owed = {}  # paid in the step after it was owed, or never (a key not back)
        if warmed and not self._warming() and self.warm != "none":
            # Calibration begins, in float32: what the warm-up still owes is sent with the
            # first float32 exchange of each bucket (``_owe``), and its state goes.
            held = self.inner[self.warm].state.tensors
            for k in sorted({k.partition("@")[0] for k in held}):
                self._owe(self.warm, k)
        self._seen, self._times = [], {}
        self._blocked, self._reported, self._aside, self._synced = 0.0, False, 0.0, 0.0
        self._start = now
        self._next_window()

    def _advance(self) -> tuple[int, int, bool]:
        """(H, place) of the next step, and whether a window starts there after steps that
        exchanged gradients (its anchors are the parameters then)."""
        if self.period > 1 and self.phase < self.period - 1:
            return self.period, self.phase + 1, False
        target = self._target if self._local is not None else 1
        return target, 0, target > 1 and self.period == 1

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
        if starts:
            assert self._local is not None  # a window of H > 1 starts only once attached
            self._local.restart()  # the ranks' parameters are equal: the window's anchors
        elif was > 1 and self.period == 1 and self._agreed is None:
            self._calib_from = self._step  # a recalibration waited for this window's end

    def _arithmetic(self, flat: torch.Tensor, shapes: list[tuple]) -> list[float]:
        """Seconds of each candidate's arithmetic on this bucket (the best of two runs)."""
        loop = Loopback()
        x = flat.detach().to(torch.float32, copy=True)
        out = []
        for name, c in self.inner.items():
            best = float("inf")
            for _ in range(2):
                begin = self.clock()
                c._reduce(x.clone(), shapes, loop, None, False)
                best = min(best, self.clock() - begin)
            out.append(best)
        return out

    # ------------------------------------------------------------------ agreement
    def _spans_hosts(self, comm) -> bool:
        if comm.size < 2:
            return False
        if self.tiers == "all":
            return True
        placement = getattr(comm, "placement", None)
        topo = placement() if placement is not None else None
        return topo is None or len(topo.hosts) > 1

    def _placement(self, comm):
        """(units across the slowest tier, ranks per unit k, its tier, topology or None);
        the tier is ``all`` (every rank's bucket compressed, ``tiers="all"``) or ``flat``
        (the Comm does not know its placement: the same, every rank a unit)."""
        if self.tiers == "all":
            return comm.size, 1, "all", None
        placement = getattr(comm, "placement", None)
        topo = placement() if placement is not None else None
        if topo is None:
            return comm.size, 1, "flat", None
        if len(topo.groups) > 1:
            units = [sum(1 for r in range(topo.size) if topo.group_of[topo.host_of[r]] == g)
                     for g in range(len(topo.groups))]
            return len(topo.groups), max(units), "group", topo
        per_host = [topo.host_of.count(h) for h in range(len(topo.hosts))]
        return len(topo.hosts), max(per_host), "host", topo

    def _local_seconds(self, topo, nbytes: int) -> float:
        """The float32 steps inside the largest host, by the planner's model (costs.py)."""
        if topo is None:
            return 0.0
        from ..collectives.costs import RankFabric, ring

        host = max(range(len(topo.hosts)), key=topo.host_of.count)
        ranks = [r for r in range(topo.size) if topo.host_of[r] == host]
        return ring(RankFabric(topo, ranks), nbytes) if len(ranks) > 1 else 0.0

    def _keys(self) -> list[str]:
        """The keys of the last whole step, in call order (the same on every rank)."""
        return list(self._last_keys)

    def _agree(self, comm, reason: str, early: bool = False) -> None:
        """The calibration's numbers, averaged; rank 0's decision, taken by every rank.
        ``early`` (after the first calibrated step): decided only where that step spent
        more than ``self.early`` of its time in the float32 exchange (module docstring, 2)."""
        keys = self._keys()
        w = self._window
        per = 1 + len(self.inner)
        local = [1.0 if w else 0.0]
        if w:
            local += [statistics.median(self._latency) if self._latency else 0.0,
                      statistics.median(s["period"] for s in w),
                      statistics.median(s["exchange"] for s in w),
                      statistics.median(s["blocked"] for s in w)]
            for k in keys:
                local.append(statistics.median(s["times"].get(k, 0.0) for s in w))
                local.extend(self._kappa.get(k, [0.0] * len(self.inner)))
        else:  # nothing timed here (a state loaded mid-calibration): the same length
            local += [0.0] * (4 + per * len(keys))
        local.append(1.0 if self._local is not None else 0.0)
        agreed = self._average(comm, local)
        if early and (agreed[0] < 1.0 or self.early >= 1
                      or not agreed[3] > self.early * agreed[2]):
            return  # calibration goes on (the same averages: the same on every rank)
        if agreed[0] < 1.0:  # some rank timed nothing: every rank calibrates again
            self._recalibrate("not every rank had timed the calibration")
            return
        latency, period, exchange, blocked = agreed[1:5]
        times = {k: agreed[5 + i * per] for i, k in enumerate(keys)}
        kappa = {k: agreed[6 + i * per:5 + (i + 1) * per] for i, k in enumerate(keys)}
        units, k_local, tier, topo = self._placement(comm)
        local_s = {k: self._local_seconds(topo, 4 * self._numel(k)) for k in keys}
        busy = sum(max(times[k] - latency - local_s[k], _TINY) for k in keys)
        numbers = {"keys": keys, "rate": sum(4 * self._numel(k) for k in keys) / busy,
                   "latency": latency, "compute": max(period - blocked, 0.0),
                   "hidden": max(exchange - blocked, 0.0), "kappa": kappa, "local": local_s,
                   "units": units, "per_unit": k_local, "tier": tier,
                   "attached": agreed[-1]}
        self._decide(comm, numbers, reason, before=period)

    def _check(self, comm) -> None:
        """The window's numbers, averaged; a decision again where they drifted."""
        a = self._agreed
        assert a is not None  # checked only once a decision is agreed (step)
        keys = a["keys"]
        w = self._window
        # Steps that exchanged gradients give the rate from their buckets; under local SGD
        # the syncs give it. Every rank has the same steps of each kind (H is agreed).
        ex = [s for s in w if not s["local"]]
        options = self._options(a)
        compressed = any(options[b].options[self._choice.get(k, 0)].name != "none"
                         for b, k in enumerate(keys))
        # The probe costs a slow link's time (0.5 s of 1 MiB at 25 Mbit/s): it runs at the
        # first check after a decision and where a reading suspects the rate (module
        # docstring, 4); the suspicion is agreed, so every rank probes or none does.
        suspect_rate = self._suspect is not None and self._suspect[0] != 0
        wants = compressed and ex and (self._baseline is None or suspect_rate)
        probe = self._probe(comm, a) if wants else 0.0
        local = [1.0 if w else 0.0,
                 statistics.median(s["period"] - s["blocked"] for s in w) if w else 0.0,
                 statistics.median(s["exchange"] for s in ex) if ex else 0.0,
                 statistics.median(s["blocked"] for s in ex) if ex else 0.0]
        local += [statistics.median(s["times"].get(k, 0.0) for s in ex) if ex else 0.0
                  for k in keys]
        local += [1.0 if ex else 0.0, 1.0 if self._local is not None else 0.0,
                  statistics.median(self._syncs) if self._syncs else 0.0,
                  1.0 if self._syncs else 0.0, probe,
                  statistics.median(s["period"] for s in ex) if ex else 0.0]
        agreed = self._average(comm, local)
        work, exchange, blocked = agreed[1:4]
        times = dict(zip(keys, agreed[4:4 + len(keys)]))
        exchanged, attached, sync, synced, probe_s, step_s = agreed[4 + len(keys):]
        trial, self._trial = self._trial, None
        if (trial is not None and agreed[0] >= 1.0 and exchanged >= 1.0
                and step_s * trial.get("steps_new", 1.0)
                > trial["before"] * trial.get("steps_old", 1.0) * (1 + self.tolerance)):
            self._undo(comm, trial, step_s)  # (the same averages, so the same on every rank)
            return
        rate, hidden = a["rate"], a["hidden"]
        # A compressed exchange that moved from what it took after the decision: the
        # link's rate is suspect (the probe confirms or clears it at the next check).
        hint = 0
        if exchanged >= 1.0 and compressed and probe_s == 0.0 and self._baseline is not None:
            hint = -_direction(exchange / max(self._baseline, _TINY) - 1, self.drift)
        if exchanged >= 1.0 and compressed and self._baseline is None:
            self._baseline = exchange
        if exchanged >= 1.0 and probe_s > 0.0:  # the link itself (module docstring, 4)
            nbytes = self._probe_bytes(keys)
            _, _, _, topo = self._placement(comm)
            busy = probe_s - a["latency"] - self._local_seconds(topo, nbytes)
            rate, hidden = nbytes / max(busy, _TINY), max(exchange - blocked, 0.0)
        elif exchanged >= 1.0:  # every bucket none: their own float32 exchanges
            busy = sum(max(times[k] - a["latency"] - a["local"][k], _TINY) for k in keys)
            rate = sum(4 * self._numel(k) for k in keys) / busy
            hidden = max(exchange - blocked, 0.0)
        elif synced >= 1.0:  # one float32 allreduce of every parameter (auto_local.py)
            busy = sync - a["latency"] - sum(a["local"][k] for k in keys)
            rate = sum(4 * self._numel(k) for k in keys) / max(busy, _TINY)
        compute = max(work, 0.0)
        moved = []
        rate_moved = compute_moved = False
        if agreed[0] < 1.0:
            self._suspect = None  # some rank timed nothing: no drift to judge this time
        else:
            # A drift counts where the reading before saw it too, the same way (module
            # docstring, 4): one slow probe (a loss episode) is not a slower link. Under
            # local SGD a check without a sync has no new rate: the suspicion waits.
            fresh = (exchanged >= 1.0 and (probe_s > 0.0 or not compressed)) or synced >= 1.0
            was = self._suspect or (0, 0)
            if fresh:
                rate_dir = _direction(rate / a["rate"] - 1, self.drift)
            elif exchanged >= 1.0 and compressed:  # no probe: the exchange's hint
                rate_dir = hint
            else:  # local SGD without a sync: the suspicion waits for one
                rate_dir = was[0]
            compute_dir = _direction((compute - a["compute"]) / max(a["compute"], 1e-3),
                                     self.drift)
            self._suspect = (rate_dir, compute_dir)
            if probe_s > 0.0 and not rate_dir:  # the link as it was: the exchange moved
                self._baseline = exchange  # for another reason, its new measure
            rate_moved = bool(fresh and rate_dir and was[0] == rate_dir)
            compute_moved = bool(compute_dir and was[1] == compute_dir)
            if rate_moved:
                moved.append(f"rate {a['rate'] * 8 / 1e6:.4g} -> {rate * 8 / 1e6:.4g} Mbit/s")
            if compute_moved:
                moved.append(f"compute {a['compute'] * 1e3:.4g} -> {compute * 1e3:.4g} ms")
            if self.periods and attached >= 1.0 and a.get("attached", 0.0) < 1.0:
                moved.append("local SGD attached")
            if moved:
                self._suspect = None
        # Every rank runs the second allreduce, drifted or not: the agreement is rank 0's.
        # Only confirmed readings move the numbers: a rate read once waits for the next (a
        # compute drift once took a reading of 297 Mbit/s of a 100 Mbit/s link with it, in
        # gradsync bench compress).
        numbers = dict(a, rate=rate if rate_moved else a["rate"],
                       compute=compute if compute_moved else a["compute"],
                       hidden=hidden if rate_moved else a["hidden"], attached=attached)
        self._decide(comm, numbers if moved else a, "drift: " + ", ".join(moved),
                     quiet=not moved, before=step_s if exchanged >= 1.0 else None)

    def _undo(self, comm, trial: dict, step_s: float) -> None:
        """The change on trial made the steps slower: back to the options before it (module
        docstring, 6)."""
        numbers = trial["numbers"]
        self._refused[tuple(trial["new"])] = numbers["rate"]
        self._suspect = None  # its numbers again: a drift from them is seen afresh
        tried = ", ".join(sorted({self.names[n] for o, n in zip(trial["old"], trial["new"])
                                  if o != n}))
        new, old = trial.get("steps_new", 1.0), trial.get("steps_old", 1.0)
        weighed = (f" (times their steps factors {new:.3g} and {old:.3g}: "
                   f"{step_s * new * 1e3:.4g} against {trial['before'] * old * 1e3:.4g} ms)"
                   if (new, old) != (1.0, 1.0) else "")
        reason = (f"measured: {tried} took {step_s * 1e3:.4g} ms a step against "
                  f"{trial['before'] * 1e3:.4g} ms before{weighed}; undone")
        self._decide(comm, numbers, reason, forced=tuple(trial["old"]))

    def _probe_bytes(self, keys: list[str]) -> int:
        """The drift check's probe: ``PROBE_BYTES``, or the largest bucket if smaller."""
        return min(PROBE_BYTES, max(4 * self._numel(k) for k in keys))

    def _probe(self, comm, numbers: dict) -> float:
        """Seconds of one float32 allreduce of the probe, after a one-element allreduce
        has lined the ranks up (every rank calls it at the same check)."""
        one = torch.zeros(1)
        comm.allreduce_sum_(one)
        probe = torch.zeros(self._probe_bytes(numbers["keys"]) // 4)
        begin = self.clock()
        comm.allreduce_sum_(probe)
        return self.clock() - begin

    def _average(self, comm, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float32)
        comm.allreduce_sum_(t)
        return [v / comm.size for v in t.tolist()]

    def _numel(self, key: str) -> int:
        return sum(_numel(s) for s in self._shapes[key])

    def _options(self, numbers: dict) -> list[model.Bucket]:
        units, k = numbers["units"], numbers["per_unit"]
        out = []
        for key in numbers["keys"]:
            numel, shapes = self._numel(key), self._shapes[key]
            options = [model.Option("none", 1.0, 1, 0.0)]
            for (name, c), kappa in zip(self.inner.items(), numbers["kappa"][key]):
                # Tiered, an element-wise compressor's work is shared by a host's k ranks;
                # PowerSGD runs whole on the host's leader.
                kappa = kappa / k if c.shardable else kappa
                if name in ("bf16", "int8", "int4"):
                    block, blocks = c.layout(numel, units)
                    wire = units * (4 * blocks + c.row_bytes(block) * blocks)
                    options.append(model.Option(name, wire / (4 * max(numel, 1)), 2, kappa))
                else:
                    plan = c.plan(shapes)
                    sent = sum(_numel(s) if p is None else p[2] * (p[0] + p[1])
                               for s, p in zip(shapes, plan))
                    twice = any(p is not None for p in plan)
                    steps = model.powersgd_steps(self.powersgd_steps, c.rank) if twice else 1.0
                    options.append(model.Option(name, sent / max(numel, 1), 2 if twice else 1,
                                                kappa, steps))
            out.append(model.Bucket(key, 4 * numel, tuple(options), numbers["local"][key]))
        return out

    def _decide(self, comm, numbers: dict, reason: str, quiet: bool = False,
                before: float | None = None, forced: tuple | None = None) -> None:
        """Rank 0's choice for ``numbers``, taken by every rank. ``quiet``: the choice in
        force (a check that found no drift); ``forced``: these options (an undone trial);
        ``before``: the median step of the window the numbers came from, which makes a
        change a trial (module docstring, 6)."""
        buckets = self._options(numbers)
        current = tuple(self._choice.get(k, 0) for k in numbers["keys"])
        # Local SGD only where every rank attached its parameters (a rank that cannot
        # average them would drift away for good).
        periods = self.periods if numbers.get("attached", 0.0) >= 1.0 else ()
        if self.periods and not periods and not self._warned and comm.rank == 0:
            self._warned = True
            log.warning("compression auto: local_sgd=%d is allowed but not every rank "
                        "attached its parameters (Auto.attach); H stays 1", self.periods[-1])
        inputs = model.Inputs(tuple(buckets), rate=max(numbers["rate"], 1.0),
                              latency=numbers["latency"], compute=numbers["compute"],
                              hidden=numbers["hidden"], margin=self.margin,
                              periods=periods, share=self.share)
        if quiet:
            mine = (*current, self._target)
        elif forced is not None:
            mine = (*forced, self._target)
        else:
            per_step = tuple(model.decide(inputs))
            if (self._agreed is not None and per_step != current
                    and model.time_to_target(inputs, current)
                    <= model.time_to_target(inputs, per_step) * (1 + self.tolerance)):
                # A re-decision keeps the options in force where they come within the
                # tolerance of the new ones: a change starts error feedback afresh and costs
                # steps, which a near tie does not repay (module docstring, 4).
                per_step = current
            refused_at = self._refused.get(per_step)
            if refused_at is not None and abs(inputs.rate / refused_at - 1) <= self.drift:
                per_step = current  # undone at about this rate (module docstring, 6)
            elif refused_at is not None:
                del self._refused[per_step]  # the link moved: it may be tried again
            # Local SGD, a change of algorithm, must pay beyond the tolerance.
            mine = (*per_step, model.choose_period(
                dataclasses.replace(inputs, margin=self.tolerance), per_step))
        # Rank 0's choice (and H, last) everywhere: the others add zeros (exact in float32).
        codes = torch.tensor(mine if comm.rank == 0 else [0] * len(mine), dtype=torch.float32)
        comm.allreduce_sum_(codes)
        *codes_of_buckets, period = (int(round(v)) for v in codes.tolist())
        choice = tuple(codes_of_buckets)
        self._agreed = numbers
        self._window, self._latency, self._kappa, self._syncs = [], [], {}, []
        changed = period != self._target or any(
            self._choice.get(k, 0) != c for k, c in zip(numbers["keys"], choice))
        if (changed and before is not None and period == 1 and self._target == 1
                and choice != current):
            self._trial = {"before": before, "old": list(current), "new": list(choice),
                           "numbers": numbers,
                           "steps_old": model.steps_factor(inputs, current),
                           "steps_new": model.steps_factor(inputs, choice)}
        self._target = period
        if changed:
            self._baseline = None  # the new options' exchange is measured afresh
        for k, c in zip(numbers["keys"], choice):
            if self._choice.get(k, 0) != c:  # the old option's residuals go with the new
                self._owe(self.names[self._choice.get(k, 0)], k)
            self._choice[k] = c
        self._resized = None
        if quiet and not changed and self.decision is not None:
            return
        decision = model.Decision(
            step=self._step, reason=reason, ranks=comm.size, hosts=numbers["units"],
            tier=numbers["tier"], made=next(_ORDER),
            choices={k: self.names[c] for k, c in zip(numbers["keys"], choice)},
            sizes={b.key: b.nbytes for b in buckets}, rate=inputs.rate,
            latency=inputs.latency, compute=inputs.compute, hidden=inputs.hidden,
            predicted=model.period_step_time(inputs, choice, period),
            uncompressed=model.step_time(inputs, [0] * len(choice)), period=period,
            sync=model.sync_time(inputs) if period > 1 else 0.0)
        if not changed and self.decision is not None and reason.startswith("drift"):
            self.decision = decision  # the same choice on new numbers: nothing to report
            return
        self._announce(comm, decision)

    def _forget(self, key: str) -> None:
        """Drops the state of ``key`` in every inner compressor: a bucket that changes option
        starts its error feedback afresh (what the old one owed goes with its next exchange:
        ``_owe``), PowerSGD its Q."""
        for c in self.inner.values():
            for k in [k for k in c.state.tensors if k == key or k.startswith(key + "@")]:
                del c.state.tensors[k]

    def _off_decision(self, comm, reason: str) -> model.Decision:
        return model.Decision(step=self._step, reason=reason, ranks=comm.size, hosts=1,
                              tier="local", made=next(_ORDER))

    def _announce(self, comm, decision: model.Decision) -> None:
        self.decision = decision
        self.history = (self.history + [decision])[-HISTORY:]
        if comm.rank == 0:
            log.info("compression auto (step %d): %s", decision.step, decision.summary())
        from ..liveness.pace import meter

        timeline = meter.timeline
        if timeline is not None:
            timeline.instant("compression", "AUTO", {"step": decision.step,
                                                     "choice": decision.short(),
                                                     "reason": decision.reason})

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The decision, its numbers, the step count and the inner compressors' states."""
        # Taken between steps: the step whose buckets were all reduced counts as done, so a
        # restored run numbers its steps (and checks, and windows) as this one would.
        period, phase, local = self.period, self.phase, None
        if self._seen:
            period, phase, starts = self._advance()
            if starts:  # the parameters now are the next window's anchors
                assert self._local is not None  # a window of H > 1 starts only once attached
                local = self._local.anchored_now()
        if local is None and period > 1:  # mid-window: its anchors
            local = (self._local.state_dict() if self._local is not None
                     else self._local_pending)
        return {"compressor": self.describe(), "seed": self.seed,
                "auto": {"step": self._step + (1 if self._seen else 0), "size": self._size,
                         "period": period, "phase": phase, "target": self._target,
                         "local": local,
                         "off": self._off,
                         "calib_from": self._calib_from,
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
        self._choice = {str(k): int(v) for k, v in a["choice"].items()}
        self._agreed = None if a["agreed"] is None else dict(a["agreed"])
        self._trial = None if a.get("trial") is None else dict(a["trial"])
        self._refused = {tuple(c): float(r) for c, r in a.get("refused", [])}
        suspect = a.get("suspect")
        self._suspect = None if suspect is None else (int(suspect[0]), int(suspect[1]))
        self._baseline = a.get("baseline")
        self._new_step_state()  # timers start again: a restored step is not measured
        self.period, self.phase = int(a.get("period", 1)), int(a.get("phase", 0))
        self._target = int(a.get("target", 1))
        if a.get("local") is not None:
            if self._local is not None:
                self._local.load_state_dict(a["local"])
            else:  # the front door attaches later (auto_local.py)
                self._local_pending = a["local"]
        self._shapes = {k: [tuple(s) for s in v] for k, v in a["shapes"].items()}
        self.decision = None if a["decision"] is None else dataclasses.replace(
            model.Decision(**a["decision"]), made=next(_ORDER))

    def _translated(self, state: dict) -> dict:
        """``state`` with its options' numbers renumbered to this Auto's, where it was saved
        by an Auto of before int4 was an option (``none|bf16|int8|powersgd8|...``), whose
        options are a subset of these and whose settings are otherwise the same but for the
        margin; any other state as it is (``load_state_dict`` then refuses what does not
        match). An option new to this Auto starts with no residual, as a fresh one does."""
        saved, mine = str(state.get("compressor", "")), self.describe()
        head, here = saved.partition(",")[0], mine.partition(",")[0]
        if saved == mine or not head.startswith("auto("):
            return state
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
    """``describe()``'s settings without the margin."""
    return re.sub(r", margin=[^,)]*", "", settings)


def _direction(change: float, drift: float) -> int:
    """+1 or -1 where a relative ``change`` is beyond ``drift``, else 0."""
    return 0 if abs(change) <= drift else (1 if change > 0 else -1)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
