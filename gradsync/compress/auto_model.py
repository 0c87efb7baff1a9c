"""``compression="auto"``: the cost model and the decision, as pure functions of measured numbers.

No clocks and no collectives here (``auto.py`` measures, ``auto_policy.py`` agrees); the same numbers give
the same decision in every process, which is what lets ranks agree on it.

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
once every H steps (plain local SGD through ``diloco.py``: one float32 allreduce of every
parameter, not hidden), so the exchange costs ``sync / H`` a step instead of the per-step
choice's:

    sync         = latency + sum_b local(b) + sum_b S_b / rate
    step_H       = compute + sync / H

A larger H costs quality (the ranks drift apart for longer), so H is kept as small as the
link allows. The rule, after the per-step choice above (``choose_period``):

1. If the per-step choice already costs the step at most ``share`` of its compute
   (``step(choice) - compute <= share x compute``; share 0.1 by default), H = 1: local SGD
   could save little and would cost quality.
2. Else H is the smallest of ``periods`` (the powers of two up to the user's maximum, and
   that maximum) with ``sync / H <= share x compute``, or the largest if none is.
3. That H is kept only if it pays beyond the margin: ``step_H x (1 + margin) <
   step(choice)``; else H = 1 (the per-step choice is the more faithful one and close).

Worked example (the bucket above; ``local_sgd=16``): int4's 0.266 s a step spends 0.066 s
on the exchange, more than 10% of 0.2 s; sync = 0.001 + 0.448 = 0.449 s, and sync / H
<= 0.02 s needs H >= 22.5: none of 2, 4, 8, 16 is enough, so the largest, 16: 0.2 + 0.028 =
0.228 s a step, which pays (0.228 x 1.05 < 0.266): H = 16. With ``local_sgd=64``, H = 32.
At 1 Gbit/s int8 (0.221 s) spends 0.021 s, sync = 0.046 s, and H = 4 would take 0.211 s, not
5% less: H = 1. At 10 Gbit/s none spends 5.5 ms, under 0.02 s: H = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["Option", "Bucket", "Inputs", "Decision", "wire_time", "step_time", "steps_factor",
           "powersgd_steps",
           "time_to_target", "decide",
           "PERIODS", "periods_upto", "sync_time", "period_step_time", "choose_period"]

PERIODS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Local SGD's candidate H (those up to the user's maximum, and the maximum itself)."""


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
    share: float = 0.1
    """The exchange's share of the step's compute that local SGD's H is chosen to reach."""

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.latency < 0 or self.compute < 0 or self.hidden < 0 or self.margin < 0:
            raise ValueError(f"latency, compute, hidden and margin must not be negative: "
                             f"{self.latency}, {self.compute}, {self.hidden}, {self.margin}")
        if not self.share > 0 or any(
                isinstance(h, bool) or not isinstance(h, int) or h < 2 for h in self.periods) \
                or list(self.periods) != sorted(set(self.periods)):
            raise ValueError(f"periods must be ascending ints >= 2 and share positive, got "
                             f"{self.periods}, {self.share}")
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
            local = (f"local SGD every {self.period} steps (parameters averaged in float32, "
                     f"{sum(self.sizes.values()) / 1e6:.3g} MB, {self.sync * 1e3:.4g} ms a sync; "
                     f"no gradient exchange between); every step it would be: ")
        tier = {"flat": "flat (placement unknown: every rank's bucket)",
                "all": "every tier (tiers=all: every rank's bucket)"}.get(self.tier, self.tier)
        classes = ", ".join(f"{name} for {count} bucket{'s' if count != 1 else ''} "
                            f"({nbytes / 1e6:.3g} MB)" for name, count, nbytes in self.classes())
        link = self.rate * 8 / 1e6
        return (f"{local}tier {tier}: {classes}; faster tiers: none (float32) | {self.reason}: "
                f"{self.ranks} ranks on {self.hosts} units, measured {link:.4g} Mbit/s "
                f"of gradient, latency {self.latency * 1e3:.3g} ms, compute "
                f"{self.compute * 1e3:.4g} ms/step, hidden {self.hidden * 1e3:.3g} ms; "
                f"predicted {self.predicted * 1e3:.4g} ms/step against "
                f"{self.uncompressed * 1e3:.4g} ms uncompressed")

    def short(self) -> str:
        """The choice alone, for a table cell: ``int8 x2 (5.6 MB), none x1 (0.01 MB)``."""
        if self.tier == "local" or not self.choices:
            return f"none ({self.reason})"
        if self.period > 1:
            return (f"local SGD H={self.period} "
                    f"({sum(self.sizes.values()) / 1e6:.3g} MB every {self.period} steps)")
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


def sync_time(inputs: Inputs) -> float:
    """Seconds of one local SGD sync: every bucket's parameters in one float32 allreduce."""
    return (inputs.latency + sum(b.local for b in inputs.buckets)
            + sum(b.nbytes for b in inputs.buckets) / inputs.rate)


def period_step_time(inputs: Inputs, choice, period: int) -> float:
    """Predicted seconds per step with ``choice`` every step (period 1), or local SGD with
    H = ``period`` (the module docstring)."""
    if period <= 1:
        return step_time(inputs, choice)
    return inputs.compute + sync_time(inputs) / period


def choose_period(inputs: Inputs, choice) -> int:
    """Local SGD's H for the per-step ``choice`` (``decide``'s): the module docstring's rule."""
    if not inputs.periods:
        return 1
    best = step_time(inputs, choice)
    target = inputs.share * inputs.compute
    if best - inputs.compute <= target:
        return 1  # the exchange is already a small share of the step: keep every step
    sync = sync_time(inputs)
    period = next((h for h in inputs.periods if sync / h <= target), inputs.periods[-1])
    if period_step_time(inputs, choice, period) * (1.0 + inputs.margin) < best:
        return period
    return 1
