"""``compression="auto"``: the cost model and the decision, as pure functions of measured numbers.

No clocks and no collectives here (``auto.py`` measures, ``auto_policy.py`` agrees); the
same numbers give the same decision in every process, which is what lets ranks agree on it.

The model, per step. The float32 exchange of a bucket of S bytes crosses the slowest tier
at a measured *rate* (gradient bytes per second through that tier's exchange, the ring's
factor 2 (H-1)/H folded in) after a *latency* per collective, and spends ``local`` seconds
in float32 inside each host first and after (the fast tier, never compressed, timed by the
planner's model of the local tier). An option c (bf16, int8, int4, PowerSGD rank r) puts ``ratio_c
x S`` bytes on the slow tier in ``collectives_c`` collectives and costs ``compute_c``
seconds of arithmetic on this machine (measured on the bucket itself):

    wire_c(b)   = local(b) + collectives_c x latency + ratio_c(b) x S_b / rate
    step(choice) = compute + sum_b compute_c(b) + max(0, sum_b wire_c(b) - hidden)

``compute`` is the step's own work (forward, backward, optimizer: measured as the step's
period minus the time its thread was blocked on the exchange); ``hidden`` is the part of
the exchange that already runs behind that work (measured: the exchange's time minus the
blocked time; 0 where the exchange blocks the computing thread, as a DDP hook's does with
``overlap=False``). The
compressors' arithmetic is counted in full, never hidden: on a CPU it takes the cores that
backward needs.

What is minimised is not the step but the time to a quality: a lossy option may need more
steps. Each option carries ``steps``, its steps to float32's quality as a multiple of
float32's: 1 for bf16, int8 and int4 (error feedback keeps float32's steps: in ``gradsync
bench compress`` each reached the target at float32's step or sooner), a prior for PowerSGD, which
the user may set (``Auto(powersgd_steps=...)``, the factor at rank 4). It depends on the
task: PowerSGD rank 4 took 176 steps to float32's 96 on the bench's language model (1.83)
and 96 to 80 on its CNN (1.2, docs/slow-links.md); the default, 1.8, takes the larger, so
that the lossiest option must win clearly to be chosen. It depends on the rank too: what a
rank-r approximation leaves out waits in the residual, and the fewer the ranks the more
(``powersgd_steps``: the prior's excess over float32 scales as 4/r). On the language model,
with rank 2 on 4.23 MB of the gradient and rank 4 on the other 1.09 MB, auto's runs took
176-272 steps (1.83-2.83), rank 2's share thus 1.83-3.1 against the 2.6 this rule gives
with the default. A choice's factor is its options' ``steps`` weighted by bucket bytes, and

    time_to_target(choice) = step(choice) x steps_factor(choice)

The decision. First the fastest: per bucket the option that minimises ``time_to_target``
with the others fixed, repeated until nothing changes (coordinate descent, from every
bucket at none). Then the most faithful within a margin: ``time_to_target`` may grow by
``margin`` (a fraction of the fastest), and buckets, smallest first, go back to the most
faithful option (none, bf16, int8, int4, PowerSGD by falling rank) that keeps it within. So compression
is off where it does not pay (a fast link: what it saves is less than the margin, or less
than its arithmetic), small buckets stay uncompressed (their exchange is latency, which
compression makes longer: two collectives instead of one), and a low-rank PowerSGD, the
lossiest option, is taken only where nothing more faithful comes close.

Worked example: one bucket of 5.6 MB, 100 Mbit/s between two hosts of one rank (rate
12.5 MB/s as the exchange sees it), latency 1 ms, compute 0.2 s, nothing hidden, int8's and
int4's arithmetic 8 ms. None: 0.2 + 0.001 + 5.6/12.5 = 0.649 s. int4 (ratio 0.126, 2
collectives): 0.2 + 0.008 + 0.002 + 0.056 = 0.266 s. int8 (ratio 0.251): 0.2 + 0.008 +
0.002 + 0.112 = 0.322 s. bf16 (ratio 0.501): 0.2 + 0.006 + 0.002 + 0.224 = 0.432 s. The
fastest is int4; the margin (5%: 0.013 s) admits nothing more faithful, so int4. At 1 Gbit/s
int4 takes 0.216 s, int8 0.221 s, bf16 0.230 s and none 0.246 s: int8, the most faithful
within 5% of int4. At 10 Gbit/s the exchange is 4.5 ms and none is within the margin of
anything: none.

Local SGD's H (only where the user allows it: ``Auto(local_sgd=H_max)``, ``periods`` here).
Under local SGD every rank steps on its own gradients and the ranks' parameters are averaged
once every H steps (plain local SGD through ``diloco.py``: outer lr 1, no momentum), in one
reduction of every parameter through a *sync option* s: none (float32) or one of the
quantizers among the options (bf16, int8, int4), with error feedback on what each sync
leaves out. Not hidden, the sync costs ``sync_s / H`` a step:

    sync_s     = collectives_s x latency + sum_b (local(b) + ratio_s(b) x S_b / rate
                                                  + compute_s(b))
    step_H,s   = compute + sync_s / H

A larger H costs quality (the ranks drift apart for longer): steps, by a prior the user may
set (``Auto(local_steps=...)``),

    steps(H)   = 1 + local_steps x max(0, log2(H / LOCAL_FREE))      (LOCAL_FREE = 4)

``local_steps`` is 0.2 by default: on ``gradsync bench compress``'s language model plain
local SGD reached float32's target in float32's 96 steps at H = 2 and 4, and in 120, 128
and 160 (1.25, 1.33, 1.67) at H = 8, 16 and 32, with float32 syncs and with int8 ones alike
(docs/slow-links.md); the rule gives 1.2, 1.4 and 1.6. (DiLoCo's outer Nesterov momentum,
which auto does not use, took that task 296-328 steps at H = 8.) The rule
(``choose_period``), after the per-step choice above:

1. Among the allowed H and the sync options, the fastest ``step_H,s x steps(H)``; then the
   most faithful within the margin of it (the smaller H first, then the more faithful sync).
2. That (H, s) is taken only where it beats the per-step choice's ``time_to_target`` by more
   than the margin; else H = 1.

A sync *behind* (only with ``Auto(local_overlap=D)``, ``inputs.overlap``): started at a
window's end, it lands d steps into the next window, its reduction behind their compute,
the steps taken meanwhile kept (``auto_local.py``). Each (H, s) is also weighed with the
fewest d that cover its sync, ``d = min(D, H / 2, ceil(sync_s / compute))``, as

    step_H,s,d  = compute + (max(0, sync_s - d x compute) + contention) / H
    steps(H, d) = steps(H) + local_steps x log2((H + 2d) / H)

where ``contention`` (``inputs.contention``, 0 until measured) is what a sync behind adds to
the steps it runs beside, in all: its arithmetic, its sockets and its Python share the cores
and the interpreter with the steps' compute. auto measures it once syncs run behind (the
steps with a sync in flight against those without, times the steps it was behind:
``auto_policy.py``, ``_contention``) and weighs every H with it, the same per sync whatever
H: a longer window pays it less often. In ``gradsync bench compress`` at 25 Mbit/s, four
ranks on two cores, H = 4 with its int4 sync two steps behind ran its steps 1.25-1.5 times
as long as the compute alone, where the model without it had them at the compute alone;
measured (53-130 ms a sync), the model put them at 0.211 s against 0.22 s run, and H = 8
two behind at 0.193 s against gs-streaming's 0.19 s (docs/slow-links.md, "Syncs behind the
compute, measured").

(the ranks apart for d steps more, counted twice: a prior, measured on the bench's language
model, unshaped: at H = 4, 104 steps at once, 113, 114 and 115 one, two and three steps
behind; at H = 8 (25 Mbit/s, four runs), 112 at once and 114 two behind; the rule gives
1.12, 1.2 and 1.26 times the steps at once at H = 4, 1.1 at H = 8: pessimistic there, but
at 25 Mbit/s H = 4 two behind took 112 steps against 88-100 at once, unshaped, in three
seeds: docs/slow-links.md, "Syncs behind the compute, measured"), and in step
1 a sync at once is more faithful than one behind (the smaller H first, then at once, then
the sync option). At 25 Mbit/s the example's int4 sync takes 0.236 s, more than a step:
H = 4 with it two steps behind takes 0.2 x 1.2 = 0.24 s a step, against 0.259 at once.
At 100 Mbit/s it takes 0.066 s: at once (0.217) beats one step behind (0.2 x 1.12).

Worked example (the bucket above; ``local_sgd=16``; auto passes its ``tolerance``, 5%, as
the margin here). At 100 Mbit/s int4's 0.266 s a step is the per-step choice; a float32
sync takes 0.449 s, an int8 one 0.122 s, an int4 one 0.066 s. With int4 syncs H = 4 takes
0.2 + 0.0166 = 0.217 s a step (steps 1), H = 8 0.208 x 1.2 = 0.250, H = 16 0.204 x 1.4 =
0.286: the fastest is H = 4 with int4 syncs, nothing more faithful comes within 5% of it
(H = 4 with int8: 0.231; H = 2 with int4: 0.233), and it beats int4 every step by 19%:
H = 4, int4 syncs. At 1 Gbit/s int8 (0.221 s a step) is the per-step choice; the fastest
is H = 4 with int4 syncs (0.204 s), the most faithful within 5% of it H = 2 with int8 syncs
(0.211 s), which beats 0.221 by more than 5%: taken. At 10 Gbit/s none takes 0.2055 s a
step; the best local SGD (H = 4, float32 syncs) 0.2014 s, 2% less: H = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = ["Option", "Bucket", "Inputs", "Decision", "wire_time", "step_time", "steps_factor",
           "powersgd_steps",
           "time_to_target", "decide",
           "PERIODS", "LOCAL_FREE", "LOCAL_STEPS", "LOCAL_OVERLAP", "periods_upto",
           "period_steps", "overlap_steps",
           "sync_options", "sync_time", "period_step_time", "choose_period"]

PERIODS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Local SGD's candidate H (those up to the user's maximum, and the maximum itself)."""

LOCAL_FREE = 4
"""The largest H local SGD's prior takes to cost no steps (module docstring)."""

LOCAL_STEPS = 0.2
"""``Auto(local_steps=)``'s default: local SGD's extra steps (a fraction of float32's) per
doubling of H beyond ``LOCAL_FREE`` (module docstring)."""

LOCAL_OVERLAP = 0
"""``Auto(local_overlap=)``'s default: the most steps a local SGD sync may run behind (0:
every sync at once, so that the ranks' parameters are equal at each window's end)."""

SYNC_OPTIONS = ("none", "bf16", "int8", "int4")
"""What a local SGD sync may go through, most faithful first (of a bucket's options)."""


def periods_upto(most: int) -> tuple[int, ...]:
    """The candidate H up to ``most`` (``most`` included): ``()`` for 1, local SGD off."""
    if most < 2:
        return ()
    return tuple(sorted({h for h in PERIODS if h < most} | {most}))


@dataclass(frozen=True)
class Option:
    """One way to exchange one bucket."""

    name: str
    """``none``, ``bf16``, ``int8``, ``int4`` or ``powersgd<r>``."""
    ratio: float
    """Bytes on the slow tier over the float32 bytes (1 for none)."""
    collectives: int
    """Collectives that cross the slow tier one after another (each pays the latency)."""
    compute: float
    """Seconds of this option's arithmetic on this bucket on this machine (0 for none)."""
    steps: float = 1.0
    """Steps to the same quality, as a multiple of float32's (a prior the user may set, not
    measured here): 1 for none, bf16, int8 and int4, whose error feedback keeps float32's steps;
    more for PowerSGD (``Auto(powersgd_steps=...)``)."""


@dataclass(frozen=True)
class Bucket:
    """A bucket and its options, most faithful first (``options[0]`` is none)."""

    key: str
    nbytes: int
    """Its float32 bytes."""
    options: tuple[Option, ...]
    local: float = 0.0
    """Seconds of the float32 steps inside each host (the same for every option)."""


@dataclass(frozen=True)
class Inputs:
    """Everything ``decide`` reads: identical on every rank after ``auto.py`` agrees it."""

    buckets: tuple[Bucket, ...]
    rate: float
    """Gradient bytes per second through the slow tier's float32 exchange (measured)."""
    latency: float
    """Seconds per collective across the slow tier (measured)."""
    compute: float
    """Seconds of the step's own work (measured)."""
    hidden: float = 0.0
    """Seconds of exchange that run behind the step's work (measured)."""
    margin: float = 0.05
    """How much slower than the fastest choice a more faithful one may be (a fraction)."""
    periods: tuple[int, ...] = ()
    """Local SGD's candidate H, ascending (empty: not allowed)."""
    local_steps: float = LOCAL_STEPS
    """Local SGD's extra steps per doubling of H beyond ``LOCAL_FREE`` (module docstring)."""
    overlap: int = 0
    """The most steps a local SGD sync may run behind (0: every sync at once)."""
    contention: float = 0.0
    """Seconds a local SGD sync behind adds to the steps it runs beside, in all (measured;
    0 until then: module docstring)."""

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.latency < 0 or self.compute < 0 or self.hidden < 0 or self.margin < 0:
            raise ValueError(f"latency, compute, hidden and margin must not be negative: "
                             f"{self.latency}, {self.compute}, {self.hidden}, {self.margin}")
        if not self.local_steps >= 0 or any(
                isinstance(h, bool) or not isinstance(h, int) or h < 2 for h in self.periods) \
                or list(self.periods) != sorted(set(self.periods)):
            raise ValueError(f"periods must be ascending ints >= 2 and local_steps >= 0, got "
                             f"{self.periods}, {self.local_steps}")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) \
                or self.overlap < 0:
            raise ValueError(f"overlap must be an int >= 0, got {self.overlap!r}")
        if not self.contention >= 0:
            raise ValueError(f"contention must be >= 0, got {self.contention!r}")
        for b in self.buckets:
            if not b.options or b.options[0].name != "none":
                raise ValueError(f"bucket {b.key!r}: the first option must be none")


@dataclass(frozen=True)
class Decision:
    """What auto chose, with the numbers behind it (``auto.py`` makes it, logs it, keeps it)."""

    step: int
    """The step (of the bucket calls auto counted) at which it was taken."""
    reason: str
    """Why now: ``calibrated``, ``one host``, ``drift ...``, ``resize ...``."""
    ranks: int
    hosts: int
    tier: str
    """The slowest tier the ranks cross (the one compressed: ``host``, ``group``), ``local``
    (one host: off), ``flat`` (placement unknown) or ``all`` (``tiers="all"``)."""
    choices: dict = field(default_factory=dict)
    """Bucket key -> option name."""
    sizes: dict = field(default_factory=dict)
    """Bucket key -> float32 bytes."""
    rate: float = 0.0
    latency: float = 0.0
    compute: float = 0.0
    hidden: float = 0.0
    predicted: float = 0.0
    """Predicted seconds per step with these choices."""
    uncompressed: float = 0.0
    """Predicted seconds per step with none everywhere."""
    period: int = 1
    """Local SGD's H: parameters averaged every ``period`` steps, no gradient exchange
    between (1: the per-bucket choices, every step)."""
    sync: float = 0.0
    """Predicted seconds of one local SGD sync (when ``period`` > 1)."""
    sync_option: str = "none"
    """What local SGD's syncs go through (when ``period`` > 1): none (float32), or a
    quantizer with error feedback."""
    overlap: int = 0
    """Steps each local SGD sync runs behind before it lands (0: at once)."""
    contention: float = 0.0
    """Measured seconds a sync behind adds to the steps it runs beside (0: not measured)."""
    made: int = field(default=0, compare=False)
    """Order of making in this process (``auto.latest`` takes the newest)."""

    def classes(self) -> list[tuple[str, int, int]]:
        """(option, buckets, bytes) per option chosen, most bytes first: the bucket classes."""
        out: dict[str, list[int]] = {}
        for key, name in self.choices.items():
            entry = out.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += self.sizes.get(key, 0)
        return sorted(((n, c, b) for n, (c, b) in out.items()), key=lambda t: (-t[2], t[0]))

    def summary(self) -> str:
        """One line: the choice per tier and bucket class, and the numbers behind it."""
        if self.tier == "local" or not self.choices:
            return f"none on every tier ({self.reason})"
        local = ""
        if self.period > 1:
            through = "float32" if self.sync_option == "none" else self.sync_option
            behind = (f", landing {self.overlap} step{'s' if self.overlap > 1 else ''} "
                      f"later" if self.overlap else "")
            local = (f"local SGD every {self.period} steps (parameters averaged in {through}, "
                     f"{sum(self.sizes.values()) / 1e6:.3g} MB, {self.sync * 1e3:.4g} ms a sync"
                     f"{behind}; no gradient exchange between); every step it would be: ")
        tier = {"flat": "flat (placement unknown: every rank's bucket)",
                "all": "every tier (tiers=all: every rank's bucket)"}.get(self.tier, self.tier)
        classes = ", ".join(f"{name} for {count} bucket{'s' if count != 1 else ''} "
                            f"({nbytes / 1e6:.3g} MB)" for name, count, nbytes in self.classes())
        link = self.rate * 8 / 1e6
        return (f"{local}tier {tier}: {classes}; faster tiers: none (float32) | {self.reason}: "
                f"{self.ranks} ranks on {self.hosts} units, measured {link:.4g} Mbit/s "
                f"of gradient, latency {self.latency * 1e3:.3g} ms, compute "
                f"{self.compute * 1e3:.4g} ms/step, hidden {self.hidden * 1e3:.3g} ms"
                f"{self._contention()}; "
                f"predicted {self.predicted * 1e3:.4g} ms/step against "
                f"{self.uncompressed * 1e3:.4g} ms uncompressed")

    def _contention(self) -> str:
        if not self.contention:
            return ""
        return f", a sync behind adds {self.contention * 1e3:.4g} ms to the steps beside it"

    def short(self) -> str:
        """The choice alone, for a table cell: ``int8 x2 (5.6 MB), none x1 (0.01 MB)``."""
        if self.tier == "local" or not self.choices:
            return f"none ({self.reason})"
        if self.period > 1:
            through = "" if self.sync_option == "none" else f" through {self.sync_option}"
            behind = f", {self.overlap} behind" if self.overlap else ""
            return (f"local SGD H={self.period} "
                    f"({sum(self.sizes.values()) / 1e6:.3g} MB every {self.period} "
                    f"steps{through}{behind})")
        return ", ".join(f"{name} x{count} ({nbytes / 1e6:.3g} MB)"
                         for name, count, nbytes in self.classes())

    def to_dict(self) -> dict:
        return {f.name: (dict(v) if isinstance(v, dict) else v)
                for f in fields(self) for v in [getattr(self, f.name)]}


def wire_time(inputs: Inputs, bucket: Bucket, option: Option) -> float:
    """Seconds bucket ``bucket`` spends in exchange with ``option`` (the module docstring)."""
    return (bucket.local + option.collectives * inputs.latency
            + option.ratio * bucket.nbytes / inputs.rate)


def step_time(inputs: Inputs, choice: "tuple[int, ...] | list[int]") -> float:
    """Predicted seconds per step with option ``choice[i]`` for bucket i."""
    arithmetic = wire = 0.0
    for bucket, i in zip(inputs.buckets, choice):
        option = bucket.options[i]
        arithmetic += option.compute
        wire += wire_time(inputs, bucket, option)
    return inputs.compute + arithmetic + max(0.0, wire - inputs.hidden)


def powersgd_steps(at_rank_4: float, rank: int) -> float:
    """PowerSGD rank ``rank``'s steps factor (module docstring), given the factor at rank 4:
    its excess over float32's steps grows as 4 / rank (1 stays 1)."""
    return 1.0 + (at_rank_4 - 1.0) * 4.0 / rank


def steps_factor(inputs: Inputs, choice: "tuple[int, ...] | list[int]") -> float:
    """The choice's steps to the same quality as a multiple of float32's: each bucket's
    option's ``steps``, weighted by the bucket's bytes (the share of the gradient it
    carries)."""
    total = sum(b.nbytes for b in inputs.buckets)
    if total == 0:
        return 1.0
    return sum(b.nbytes * b.options[i].steps for b, i in zip(inputs.buckets, choice)) / total


def time_to_target(inputs: Inputs, choice: "tuple[int, ...] | list[int]") -> float:
    """What ``decide`` minimises: ``step_time x steps_factor``, seconds per float32 step's
    worth of progress."""
    return step_time(inputs, choice) * steps_factor(inputs, choice)


def decide(inputs: Inputs) -> tuple[int, ...]:
    """The option index per bucket (the module docstring's two passes)."""
    buckets = inputs.buckets
    choice = [0] * len(buckets)
    for _ in range(4 * len(buckets) + 4):  # converges in a few passes; bounded regardless
        changed = False
        for b, bucket in enumerate(buckets):
            best, best_t = choice[b], time_to_target(inputs, choice)
            for i in range(len(bucket.options)):
                trial = choice[:b] + [i] + choice[b + 1:]
                t = time_to_target(inputs, trial)
                if t < best_t:
                    best, best_t = i, t
            if best != choice[b]:
                choice[b], changed = best, True
        if not changed:
            break
    budget = time_to_target(inputs, choice) * (1.0 + inputs.margin)
    # Smallest buckets first: going back to float32 costs them least (their exchange is
    # latency), so the margin is spent where compression gains least.
    for b in sorted(range(len(buckets)), key=lambda b: (buckets[b].nbytes, buckets[b].key)):
        for i in range(choice[b]):
            trial = choice[:b] + [i] + choice[b + 1:]
            if time_to_target(inputs, trial) <= budget:
                choice[b] = i
                break
    return tuple(choice)


def period_steps(inputs: Inputs, period: int, overlap: int = 0) -> float:
    """Local SGD's steps factor at H = ``period`` (module docstring): 1 up to ``LOCAL_FREE``,
    then ``local_steps`` more per doubling; a sync ``overlap`` steps behind, as much again
    per doubling of H + 2 x overlap over H (free of ``LOCAL_FREE``)."""
    return 1.0 + inputs.local_steps * (max(0.0, math.log2(period / LOCAL_FREE))
                                       + math.log2((period + 2 * overlap) / period))


def overlap_steps(inputs: Inputs, period: int, sync: str = "none") -> int:
    """The steps a sync of H = ``period`` through ``sync`` runs behind, if it may (module
    docstring): the fewest whose compute covers it, at most ``inputs.overlap`` and H / 2."""
    if inputs.overlap < 1 or period < 2:
        return 0
    need = math.ceil(sync_time(inputs, sync) / inputs.compute) if inputs.compute > 0 else 1
    return max(1, min(inputs.overlap, period // 2, need))


def sync_options(inputs: Inputs) -> tuple[str, ...]:
    """The sync options every bucket has, most faithful first (none always)."""
    names = [{o.name for o in b.options} for b in inputs.buckets]
    return tuple(n for n in SYNC_OPTIONS if all(n in have for have in names))


def sync_time(inputs: Inputs, sync: str = "none") -> float:
    """Seconds of one local SGD sync: every bucket's parameters in one reduction through
    ``sync`` (module docstring)."""
    used = [(b, next(o for o in b.options if o.name == sync)) for b in inputs.buckets]
    collectives = max((o.collectives for _, o in used), default=1)  # one reduction of all
    return collectives * inputs.latency + sum(
        b.local + o.ratio * b.nbytes / inputs.rate + o.compute for b, o in used)


def period_step_time(inputs: Inputs, choice, period: int, sync: str = "none",
                     overlap: int = 0) -> float:
    """Predicted seconds per step with ``choice`` every step (period 1), or local SGD with
    H = ``period``, its syncs through ``sync``, each ``overlap`` steps behind (the module
    docstring)."""
    if period <= 1:
        return step_time(inputs, choice)
    behind = inputs.contention if overlap > 0 else 0.0
    return inputs.compute + (max(0.0, sync_time(inputs, sync) - overlap * inputs.compute)
                             + behind) / period


def choose_period(inputs: Inputs, choice) -> tuple[int, str, int]:
    """Local SGD's (H, sync option, overlap) for the per-step ``choice`` (``decide``'s): the
    module docstring's rule; (1, "none", 0) where local SGD does not pay or is not
    allowed."""
    if not inputs.periods:
        return 1, "none", 0
    # Most faithful first: the smaller H, then at once before behind, then the sync option.
    timed = sorted((((h, s, d), period_step_time(inputs, choice, h, s, d)
                     * period_steps(inputs, h, d))
                    for h in inputs.periods for s in sync_options(inputs)
                    for d in sorted({0, overlap_steps(inputs, h, s)})),
                   key=lambda c: (c[0][0], c[0][2] > 0, SYNC_OPTIONS.index(c[0][1])))
    fastest = min(t for _, t in timed)
    pick, t = next((c, t) for c, t in timed if t <= fastest * (1.0 + inputs.margin))
    if t * (1.0 + inputs.margin) < time_to_target(inputs, choice):
        return pick
    return 1, "none", 0
