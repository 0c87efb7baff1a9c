"""compression="auto" (gradsync/compress/auto.py, auto_model.py): the decision and its agreement.

The model is a pure function (``auto_model.decide``), checked over a grid of link rates,
latencies and compute times. The runtime (``Auto``) runs on threads as ranks
(``test_compress``'s in-memory group) over an *emulated link*: every collective advances
its rank's own clock by ``latency + bytes / rate`` (the rank's own figures, so ranks can
measure different links), and each step advances it by the step's compute. Time is an
input (``Auto(clock=...)``): nothing here sleeps or depends on the machine's load. The
front doors on real processes are tests/ranks/compress_train.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gradsync.cluster.topology import Topology
from gradsync.compress import Auto
from gradsync.compress import auto_model as m
from test_compress import ThreadComm, ThreadGroup, run_threads

# --------------------------------------------------------------------------- the model
ARITHMETIC = 1e-9  # seconds per byte of a compressor's arithmetic (about a CPU's)


def bucket(key: str, nbytes: int, arithmetic: float = ARITHMETIC) -> m.Bucket:
    k = arithmetic * nbytes
    return m.Bucket(key, nbytes, (m.Option("none", 1.0, 1, 0.0),
                                  m.Option("bf16", 0.501, 2, k),
                                  m.Option("int8", 0.251, 2, k),
                                  m.Option("powersgd4", 0.05, 2, 2 * k)))


def names(inputs: m.Inputs) -> list[str]:
    return [b.options[i].name for b, i in zip(inputs.buckets, m.decide(inputs))]


RATES = [1e6, 12.5e6, 125e6, 1.25e9, 12.5e9]  # bytes/s: 8 Mbit/s .. 100 Gbit/s
LATENCIES = [1e-5, 1e-3, 1e-2]
COMPUTES = [0.01, 0.2, 1.0]
GRID = [(r, lat, c) for r in RATES for lat in LATENCIES for c in COMPUTES]


@pytest.mark.parametrize("rate,latency,compute", GRID)
def test_decision_over_a_grid_of_links_and_steps(rate, latency, compute):
    """Fast links: none (what compression saves is less than its arithmetic); slow links
    with big buckets: a compressor; tiny latency-bound buckets: none."""
    big, tiny = bucket("big", 16 << 20), bucket("tiny", 1024)
    chosen = dict(zip(["big", "tiny"], names(m.Inputs((big, tiny), rate, latency, compute))))
    if rate >= 1.25e9:
        assert chosen == {"big": "none", "tiny": "none"}
    if rate <= 12.5e6:
        assert chosen["big"] != "none", chosen
    if latency >= 1e-3:
        assert chosen["tiny"] == "none", chosen


WORKED = m.Bucket("b", 5_600_000, (m.Option("none", 1.0, 1, 0.0),
                                   m.Option("bf16", 0.501, 2, 0.006),
                                   m.Option("int8", 0.251, 2, 0.008),
                                   m.Option("int4", 0.126, 2, 0.008)))
"""The bucket of auto_model's worked examples."""


def test_the_worked_example_of_the_models_docstring():
    inputs = m.Inputs((WORKED,), rate=12.5e6, latency=1e-3, compute=0.2)
    assert m.step_time(inputs, [0]) == pytest.approx(0.649)
    assert m.step_time(inputs, [3]) == pytest.approx(0.2664, abs=1e-3)
    assert m.step_time(inputs, [2]) == pytest.approx(0.3224, abs=1e-3)
    assert m.step_time(inputs, [1]) == pytest.approx(0.4324, abs=1e-3)
    assert names(inputs) == ["int4"]
    # At 1 Gbit/s int4 is the fastest, and int8 the most faithful within 5% of it.
    gbit = m.Inputs((WORKED,), rate=125e6, latency=1e-3, compute=0.2)
    assert [round(m.step_time(gbit, [c]), 3) for c in range(4)] == [0.246, 0.230, 0.221, 0.216]
    assert names(gbit) == ["int8"]
    assert names(m.Inputs((WORKED,), rate=1.25e9, latency=1e-3, compute=0.2)) == ["none"]


def test_an_exchange_hidden_behind_compute_is_not_compressed():
    big = bucket("big", 16 << 20)
    wire = m.wire_time(m.Inputs((big,), 12.5e6, 1e-3, 0.2), big, big.options[0])
    assert names(m.Inputs((big,), 12.5e6, 1e-3, 0.2, hidden=0.0)) != ["none"]
    assert names(m.Inputs((big,), 12.5e6, 1e-3, 0.2, hidden=wire)) == ["none"]


def test_the_most_faithful_option_within_the_margin():
    """Where bf16 is within the margin of the fastest, bf16, not int8 or PowerSGD; with no
    margin, the fastest (PowerSGD, the lossiest)."""
    big = bucket("big", 4 << 20, arithmetic=0.0)
    inputs = m.Inputs((big,), rate=1e9, latency=1e-4, compute=0.2, margin=0.01)
    assert names(inputs) == ["bf16"]
    assert names(m.Inputs((big,), rate=1e9, latency=1e-4, compute=0.2, margin=0.0)) == \
        ["powersgd4"]


def test_a_lossy_option_pays_for_its_extra_steps():
    """The bench's language model at 100 Mbit/s (4 hosts, 5.3 MB of gradient, 0.13 s of
    compute): PowerSGD's step is the shortest, but at 1.8 times float32's steps int8 reaches
    the target first; weighed by step time alone (steps 1), PowerSGD. At 25 Mbit/s
    PowerSGD's step is short enough to pay for its steps."""
    def lm(rate, steps):
        k = 5e-9 * 5_320_000
        b = m.Bucket("b", 5_320_000, (m.Option("none", 1.0, 1, 0.0),
                                      m.Option("int8", 0.251, 2, k),
                                      m.Option("powersgd4", 0.04, 2, 2 * k, steps)))
        return m.Inputs((b,), rate=rate, latency=1e-3, compute=0.13)

    assert names(lm(8e6, 1.0)) == ["powersgd4"]
    assert names(lm(8e6, 1.8)) == ["int8"]
    assert m.time_to_target(lm(8e6, 1.8), [2]) == pytest.approx(
        1.8 * m.step_time(lm(8e6, 1.8), [2]))
    assert names(lm(2e6, 1.8)) == ["powersgd4"]


def test_a_lower_powersgd_rank_is_weighed_by_more_steps():
    """PowerSGD's prior is its factor at rank 4; the excess over float32 scales as 4 / r, so
    rank 2 needs 2.6 x float32's steps by default, not 1.8 (the bench's language model:
    auto's rank-2 runs took 2.25-2.83 x). At 25 Mbit/s on the language model's 5.3 MB, a flat
    1.8 for every rank chose rank 2; weighed by its rank, rank 4."""
    assert m.powersgd_steps(1.8, 4) == pytest.approx(1.8)
    assert m.powersgd_steps(1.8, 2) == pytest.approx(2.6)
    assert m.powersgd_steps(1.8, 8) == pytest.approx(1.4)
    assert m.powersgd_steps(1.0, 1) == 1.0

    def lm(scaled: bool):
        k = 5e-9 * 5_320_000
        options = [m.Option("none", 1.0, 1, 0.0), m.Option("int8", 0.251, 2, k)]
        for r, ratio in ((4, 0.083), (2, 0.042)):
            options.append(m.Option(f"powersgd{r}", ratio, 2, 2 * k,
                                    m.powersgd_steps(1.8, r) if scaled else 1.8))
        b = m.Bucket("b", 5_320_000, tuple(options))
        return m.Inputs((b,), rate=2e6, latency=1e-3, compute=0.13)

    assert names(lm(scaled=False)) == ["powersgd2"]
    assert names(lm(scaled=True)) == ["powersgd4"]

    auto = Auto(powersgd_ranks=(8, 4, 2), powersgd_steps=1.5)  # what auto builds per rank
    auto._shapes["b"] = [(256, 256)]
    numbers = {"units": 4, "per_unit": 1, "keys": ["b"], "local": {"b": 0.0},
               "kappa": {"b": [0.0] * len(auto.inner)}}
    (bucket,) = auto._options(numbers)
    steps = {o.name: o.steps for o in bucket.options}
    assert steps == pytest.approx({"none": 1.0, "bf16": 1.0, "int8": 1.0, "int4": 1.0,
                                   "powersgd8": 1.25, "powersgd4": 1.5, "powersgd2": 2.0})
    ratios = {o.name: o.ratio for o in bucket.options}  # scales of 4 bytes per 1,024 elements
    assert ratios["int8"] == pytest.approx((1024 + 4) / 4096)
    assert ratios["int4"] == pytest.approx((512 + 4) / 4096)


def test_the_steps_factor_weighs_each_bucket_by_its_bytes():
    big = m.Bucket("big", 3000, (m.Option("none", 1.0, 1, 0.0),
                                 m.Option("powersgd4", 0.1, 2, 0.0, 2.0)))
    small = m.Bucket("small", 1000, (m.Option("none", 1.0, 1, 0.0),))
    inputs = m.Inputs((big, small), rate=1e6, latency=0.0, compute=0.1)
    assert m.steps_factor(inputs, [0, 0]) == 1.0
    assert m.steps_factor(inputs, [1, 0]) == pytest.approx((3000 * 2.0 + 1000) / 4000)
    assert m.steps_factor(m.Inputs((), 1.0, 0.0, 0.0), []) == 1.0


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="rate"):
        m.Inputs((), rate=0.0, latency=0.0, compute=0.0)
    with pytest.raises(ValueError, match="first option"):
        m.Inputs((m.Bucket("b", 4, (m.Option("int8", 0.25, 2, 0.0),)),), 1.0, 0.0, 0.0)


# --------------------------------------------------------------------------- the runtime
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Link:
    """Each rank's link: its own rate and latency, changeable between steps."""

    def __init__(self, size: int, rate: float, latency: float = 1e-3):
        self.rate, self.latency = [rate] * size, [latency] * size


class LinkComm(ThreadComm):
    """A thread rank whose collectives advance its clock as its link says."""

    def __init__(self, group, rank, clock: Clock, link: Link, hosts: int | None = None):
        super().__init__(group, rank)
        self.clock, self.link, self.hosts = clock, link, hosts
        self.collectives = 0

    def _spend(self, nbytes: int) -> None:
        self.collectives += 1
        self.clock.t += self.link.latency[self.rank] + nbytes / self.link.rate[self.rank]

    def allreduce_sum_(self, t):
        self._spend(t.numel() * t.element_size())
        super().allreduce_sum_(t)

    def alltoall(self, send):
        self._spend(send.numel())
        return super().alltoall(send)

    def allgather(self, mine):
        self._spend(mine.numel())
        return super().allgather(mine)

    def placement(self):
        if self.hosts is None:
            return None
        return Topology.from_hosts([f"h{r * self.hosts // self.size}"
                                    for r in range(self.size)])


SHAPES = {"big": [(256, 256)], "tiny": [(8,)]}  # 256 KB and 32 bytes of float32


def grad(step: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of ``n`` elements at ``step`` (``train``'s)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + rank))


def train(autos, comms, steps: int, compute, on_step=None, kept=None):
    """``steps`` steps on every rank: compute (per rank), then the two buckets. Returns
    each rank's outputs of its last step (``kept``: a list per rank takes every step's)."""
    size = len(comms)

    def body(r):
        out = None
        for step in range(steps):
            if on_step is not None and r == 0:
                on_step(step)
            comms[r].group.barrier.wait()  # on_step's change is seen by every rank
            comms[r].clock.t += compute[r]
            out = []
            for key, shapes in SHAPES.items():
                g = grad(step, r, sum(math.prod(s) for s in shapes))
                out.append(autos[r].reduce(g, shapes, comms[r], key, average=True))
            if kept is not None:
                kept[r].append(out)
        return out

    return run_threads(size, body, comms[0].group.barrier.abort)


def job(size: int, rate, latency=1e-3, hosts=None, **settings):
    group = ThreadGroup(size)
    link = Link(size, rate, latency)
    clocks = [Clock() for _ in range(size)]
    comms = [LinkComm(group, r, clocks[r], link, hosts) for r in range(size)]
    # The steps these tests count assume both calibration steps (early=1); the early
    # decision has its own test.
    settings.setdefault("early", 1.0)
    autos = [Auto(clock=clocks[r], warmup=1, calibrate=2, check_every=4, **settings)
             for r in range(size)]
    return autos, comms, link


def test_a_reported_wait_is_what_the_step_loses_not_the_measuring_beside_it():
    """A front door that reports its wait (the DDP hook: its reductions, and auto's
    measuring at a step's first bucket, run on a thread of their own beside the training
    thread's backward): the step's compute is its whole span, from its first call to the
    next step's, less that wait, the measuring included (subtracting the measuring as well,
    as the step's period does, read compute low: 98 ms for 185 in gradsync bench compress).
    Unreported, the exchange and the measuring are the step's own. Each rank computes
    50 ms; the first call of each timed step measures the latency (two one-element
    allreduces: 2 x 1.004 ms on this link); the buckets' exchange takes the rest."""
    sample = 2 * (1e-3 + 4 / 1e6)
    for report in (True, False):
        _, comms, _ = job(2, rate=1e6)
        autos = [Auto(clock=c.clock, warmup=1, calibrate=4, early=1.0) for c in comms]

        def body(r):
            for step in range(5):
                comms[r].group.barrier.wait()
                comms[r].clock.t += 0.05
                for key, shapes in SHAPES.items():
                    g = grad(step, r, sum(math.prod(s) for s in shapes))
                    autos[r].reduce(g, shapes, comms[r], key, average=True)
                if report:
                    autos[r].blocked(0.01)
            return [dict(w) for w in autos[r]._window]

        windows = run_threads(2, body, comms[0].group.barrier.abort)
        assert len(windows[0]) == 3  # steps 1, 2, 3 closed (step 0 is the warm-up)
        for w in windows[0]:
            # period: the exchange and the next step's compute; span: the sample too
            expected = w["period"] + sample - 0.01 if report else 0.05
            assert w["compute"] == pytest.approx(expected, abs=1e-9), (report, w)


def test_slow_link_compresses_the_big_bucket_and_not_the_tiny_one():
    autos, comms, _ = job(2, rate=1e6)
    outs = train(autos, comms, 6, [0.05, 0.05])
    d = autos[0].decision
    assert d is not None and d.reason == "calibrated" and d.step == 3
    assert d.choices["big"] != "none" and d.choices["tiny"] == "none", d.summary()
    assert d.predicted < d.uncompressed
    assert all(a.decision.choices == d.choices for a in autos)
    assert torch.equal(outs[0][0], outs[1][0])  # the same result on every rank


@pytest.mark.parametrize("size", [2, 3])
def test_the_warm_up_runs_the_leanest_quantizer_and_the_calibration_float32(size):
    """The warm-up steps are timed by nothing, so they go through int4 (a slow link's
    float32 exchange there would cost time for nothing); calibration then runs float32 and
    sends what the warm-up still owed with its first exchange: the two steps' results sum to
    the two exact means (error feedback whole across the change), the next step's result
    is the exact mean, and no residual is left."""
    autos, comms, _ = job(size, rate=1e6)  # warm-up 1 step, calibration 2
    compute = [0.05] * size
    assert autos[0].warm == "int4"
    grads = [torch.randn(65536, generator=torch.Generator().manual_seed(r))
             for r in range(size)]
    mean = sum(grads) / size
    (warm, _), *_ = train(autos, comms, 1, compute)
    assert "big" in autos[0].inner["int4"].state.tensors
    assert not torch.allclose(warm, mean, atol=1e-3)  # rounded to 4 bits
    (calibrating, _), *_ = train(autos, comms, 1, compute)
    assert not torch.allclose(calibrating, mean, atol=1e-3)  # the owed part with it
    assert torch.allclose(warm + calibrating, 2 * mean, atol=1e-5)  # and nothing lost
    assert all(not c.state.tensors for a in autos for c in a.inner.values())
    assert not any(a._owed for a in autos)
    (again, _), *_ = train(autos, comms, 1, compute)
    assert torch.allclose(again, mean, atol=1e-6)  # float32, nothing owed
    assert autos[0].decision is None  # nothing decided yet (calibration: steps 1 and 2)
    # On one host auto is off from the first step: float32 throughout.
    autos, comms, _ = job(size, rate=1e6, hosts=1)
    (first, _), *_ = train(autos, comms, 1, compute)
    assert torch.allclose(first, mean, atol=1e-6)
    assert Auto(options=("none", "bf16", "int8")).warm == "int8"
    assert Auto(options=("none", "powersgd")).warm == "none"


class Counting(LinkComm):
    """A LinkComm that counts the bytes of each allreduce, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sizes: list[int] = []

    def allreduce_sum_(self, t):
        self.sizes.append(t.numel() * t.element_size())
        super().allreduce_sum_(t)


def probed_job(size: int, rate, latency=1e-3, check_every=4, **settings):
    group = ThreadGroup(size)
    link = Link(size, rate, latency)
    clocks = [Clock() for _ in range(size)]
    comms = [Counting(group, r, clocks[r], link, None) for r in range(size)]
    autos = [Auto(clock=clocks[r], warmup=1, calibrate=2, check_every=check_every, early=0.5,
                  **settings) for r in range(size)]
    return autos, comms


@pytest.mark.parametrize("size", [2, 3])
def test_a_slow_link_is_decided_on_a_probe_without_a_float32_step(size, monkeypatch):
    """The first timed step after the warm-up still goes through the warm quantizer, with a
    float32 probe of the link beside it; where the float32 exchange the probe's rate
    predicts would have taken more than half the step (a slow link), the ranks decide after
    it (step 2 here, warm-up 1) on the probe's rate, and no bucket ever crossed the link in
    float32. Nothing of the gradients is lost across it: the results of every step sum to
    the exact means, less what the options in force still hold."""
    from gradsync.compress import auto_policy

    monkeypatch.setattr(auto_policy, "PROBE_BYTES", 1 << 16)  # a quarter of the big bucket
    autos, comms = probed_job(size, rate=1e6, options=("none", "int8", "int4"))
    kept: list[list] = [[] for _ in range(size)]
    train(autos, comms, 4, [0.05] * size, kept=kept)
    d = autos[0].decision
    assert (d.step, d.reason) == (2, "calibrated") and d.choices["big"] != "none", d
    assert [a.decision.choices for a in autos] == [d.choices] * size
    assert d.rate == pytest.approx(1e6, rel=1e-4)  # the probe's: latency taken off
    big = 4 * 256 * 256
    assert 1 << 16 in comms[0].sizes  # the probe, once
    assert comms[0].sizes.count(1 << 16) == 1 and big not in comms[0].sizes
    # A change from the warm quantizer is a trial against the step it ran.
    if d.choices["big"] != "int4" or d.choices["tiny"] != "int4":
        warm = autos[0].names.index("int4")
        assert autos[0]._trial is not None and autos[0]._trial["old"] == [warm, warm]
    n = 256 * 256
    means = [sum(grad(step, r, n) for r in range(size)) / size for step in range(4)]
    assert not any(a._owed for a in autos)  # the warm quantizer's, paid in step 2
    held = torch.zeros(n)  # what the options in force still hold, in the mean's domain
    for r, a in enumerate(autos):
        for c in a.inner.values():
            state = c.state.tensors.get("big", {})
            if "residual" in state:
                held += state["residual"] / size
            piece = state.get(f"owner{r}of{size}")
            if piece is not None:
                piece = piece.reshape(-1)
                end = min(n, (r + 1) * piece.numel())
                held[r * piece.numel():end] += piece[:end - r * piece.numel()]
    for r in range(size):
        total = sum(out[0] for out in kept[r])
        assert torch.allclose(total + held, sum(means), atol=1e-4), \
            (total + held - sum(means)).abs().max()


class SlowProbe(Counting):
    """A Counting comm whose probe-sized allreduces take four times the link's time."""

    def allreduce_sum_(self, t):
        if t.numel() * t.element_size() == 1 << 16:
            self.clock.t += 3 * (1 << 16) / self.link.rate[self.rank]
        super().allreduce_sum_(t)


def test_a_probe_slower_than_the_quantized_exchange_is_not_the_links_rate(monkeypatch):
    """The probe step's quantized exchanges carried their bytes in their time: the link is at
    least that fast, so a probe that met something else (here it takes four times the
    link's time) does not make the decision's rate slower than that."""
    from gradsync.compress import auto_policy

    monkeypatch.setattr(auto_policy, "PROBE_BYTES", 1 << 16)
    group = ThreadGroup(2)
    link = Link(2, 1e6)
    clocks = [Clock() for _ in range(2)]
    comms = [SlowProbe(group, r, clocks[r], link, None) for r in range(2)]
    autos = [Auto(clock=clocks[r], warmup=1, calibrate=2, check_every=4, early=0.5,
                  options=("none", "int8", "int4")) for r in range(2)]
    train(autos, comms, 3, [0.05, 0.05])
    d = autos[0].decision
    assert d is not None and d.step == 2, d
    assert 0.5e6 < d.rate <= 1e6, d.rate  # the probe alone: 0.25e6


def test_a_change_on_trial_is_checked_after_a_few_steps_not_at_the_next_drift_check():
    """A decision that changes the options (here from the probe step's int4: the tiny bucket
    goes float32) is a trial, checked ``TRIAL`` (4) steps later, well before the next drift
    check (step 16 here): a wrong first choice costs 4 steps, not 14."""
    from gradsync.compress.auto_policy import TRIAL

    autos, comms = probed_job(2, rate=1e6, check_every=16, options=("none", "int8", "int4"))
    train(autos, comms, 3, [0.05, 0.05])
    d = autos[0].decision
    assert d.step == 2 and d.choices["tiny"] != "int4", d.summary()
    assert all(a._trial is not None and a._trial["at"] == 2 for a in autos)
    train(autos, comms, TRIAL - 1, [0.05, 0.05])  # steps 3 .. 5: not yet
    assert all(a._trial is not None for a in autos)
    train(autos, comms, 1, [0.05, 0.05])  # step 6's first call checks it
    assert all(a._trial is None for a in autos)
    assert autos[0]._baseline is not None  # the check ran: the exchange's measure taken


def test_a_link_that_is_not_slow_is_calibrated_in_float32_after_its_probe():
    """Where the probe's rate predicts a float32 exchange under half the step, two float32
    steps follow the probe step and decide (step 4 here): what the warm quantizer still
    owed goes with their first exchange, and the probe's step is not in their numbers."""
    autos, comms = probed_job(2, rate=1e10, latency=1e-5)
    train(autos, comms, 5, [0.05, 0.05])
    d = autos[1].decision
    assert (d.step, d.choices["big"]) == (4, "none")
    assert 4 * 256 * 256 in comms[0].sizes  # the calibration's float32 exchanges
    assert d.compute == pytest.approx(0.05, rel=1e-3)


def test_a_first_calibrated_float32_step_spent_in_the_exchange_decides_alone():
    """Without a quantizer among the options (no warm-up quantizer, so no probe), the first
    calibrated step runs float32; where it spent more than half its time in the exchange,
    the ranks decide after it (step 2 here, warm-up 1); elsewhere after both calibration
    steps (step 3), having agreed once more that it was not so."""
    autos, comms, _ = job(2, rate=1e5, early=0.5, options=("none", "powersgd"))
    train(autos, comms, 4, [0.05, 0.05])
    d = autos[0].decision
    assert (d.step, d.reason) == (2, "calibrated") and d.choices["big"] != "none"
    assert [a.decision.choices for a in autos] == [d.choices] * 2
    autos, comms, _ = job(2, rate=1e10, latency=1e-5, early=0.5, options=("none", "powersgd"))
    train(autos, comms, 5, [0.05, 0.05])
    assert (autos[1].decision.step, autos[1].decision.choices["big"]) == (3, "none")
    assert Auto().describe() == Auto(early=0.5).describe()  # the default is not named
    assert "early=1.0" in Auto(early=1.0).describe()
    for wrong in (0, 1.5):
        with pytest.raises(ValueError, match="early"):
            Auto(early=wrong)


def test_the_arithmetic_is_timed_in_the_last_warm_up_step():
    """Nothing times the warm-up, so the candidates' arithmetic is timed there (not in a
    calibrated step, whose period it would distort); a bucket first seen in calibration,
    and a recalibration (no warm-up), time it in the first calibrated step."""
    autos, comms, _ = job(2, rate=1e6)  # warm-up 1 step
    when: list[tuple[int, int]] = []
    real = autos[0]._arithmetic
    autos[0]._arithmetic = lambda flat, shapes: (when.append((autos[0]._step, flat.numel())),
                                                 real(flat, shapes))[1]
    train(autos, comms, 6, [0.05, 0.05])
    assert when == [(0, 65536), (0, 8)]  # step 0, the warm-up; both buckets
    for a in autos:  # as the buckets changing would (every rank at the same step)
        a._recalibrate("test")
    start = autos[0]._step
    train(autos, comms, 3, [0.05, 0.05])
    assert when[2:] == [(start + 1, 65536), (start + 1, 8)]  # the first calibrated step


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_times_every_candidate_once_and_the_ranks_agree_on_the_mean(size):
    """Each candidate's arithmetic is timed once per bucket on every rank, after a run on a
    small matrix (its first-call costs); the agreed time is the ranks' mean. Here candidate
    c takes (c + 1) ms times (rank + 1) on each rank's clock."""
    from gradsync.compress.comm import Loopback

    autos, comms, _ = job(size, rate=1e6)
    timed: list[tuple[int, int, int]] = []
    for r, a in enumerate(autos):
        for index, c in enumerate(a.inner.values()):
            def slow(x, shapes, comm, key, average, real=c._reduce, index=index, r=r):
                if isinstance(comm, Loopback):  # the arithmetic's timing, not an exchange
                    comms[r].clock.t += (index + 1) * 1e-3 * (r + 1)
                    timed.append((r, index, x.numel()))
                return real(x, shapes, comm, key, average)
            c._reduce = slow
    train(autos, comms, 4, [0.05] * size)
    count = len(autos[0].inner)
    for r in range(size):  # per bucket, per candidate: the small matrix, then the bucket
        mine = [(i, k) for rr, i, k in timed if rr == r]
        assert mine == [(i, k) for n in (65536, 8) for i in range(count)
                        for k in (32 * 32, n)], mine
    kappa = autos[0]._agreed["kappa"]["big"]
    mean_rank = sum(r + 1 for r in range(size)) / size
    assert kappa == pytest.approx([(i + 1) * 1e-3 * mean_rank for i in range(count)], rel=1e-4)


def test_fast_link_and_one_host_stay_uncompressed():
    autos, comms, _ = job(2, rate=1e10, latency=1e-5)
    train(autos, comms, 6, [0.05, 0.05])
    assert set(autos[0].decision.choices.values()) == {"none"}, autos[0].decision.summary()
    autos, comms, _ = job(2, rate=1e6, hosts=1)
    train(autos, comms, 6, [0.05, 0.05])
    d = autos[1].decision
    assert (d.reason, d.tier, d.short()) == ("one host", "local", "none (one host)")
    # Off: no collective beyond the buckets' own float32 allreduces (no timing, no vote).
    assert comms[1].collectives == 6 * 2


def test_ranks_that_measure_different_links_take_rank_0s_choice():
    """Rank 0 sees a fast link, rank 1 a slow one: on its own numbers each would choose
    differently; averaged and sent by rank 0, both use one choice (and the reductions,
    which would mismatch otherwise, give the same result on both)."""
    alone = []
    for rate in (1e10, 1e5):
        autos, comms, _ = job(2, rate=rate)
        train(autos, comms, 6, [0.05, 0.05])
        alone.append(autos[0].decision.choices["big"])
    assert alone[0] != alone[1], alone
    autos, comms, link = job(2, rate=1e10)
    link.rate[1] = 1e5
    outs = train(autos, comms, 6, [0.01, 0.3])
    assert autos[0].decision.choices == autos[1].decision.choices
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_link_that_slows_down_is_decided_again_once_two_checks_see_it():
    """The check at step 8 sees the slower link and waits; the one at 12 sees it again and
    decides. A link slow for one window only (one slow probe: a loss episode) changes
    nothing."""
    autos, comms, link = job(2, rate=1e10, latency=1e-5)

    def slow_down(step, back=None):
        if step == 5:  # after the decision at step 3 (none), before the check at step 8
            link.rate[:] = [1e5, 1e5]
            link.latency[:] = [1e-3, 1e-3]
        if step == back:
            link.rate[:] = [1e10, 1e10]
            link.latency[:] = [1e-5, 1e-5]

    train(autos, comms, 14, [0.05, 0.05], on_step=slow_down)
    first, last = autos[0].history[0], autos[0].history[-1]
    assert first.choices["big"] == "none"
    assert last.reason.startswith("drift: rate") and last.step == 12, last
    assert last.choices["big"] != "none"
    assert [a.decision.choices for a in autos] == [last.choices] * 2
    autos, comms, link = job(2, rate=1e10, latency=1e-5)
    train(autos, comms, 18, [0.05, 0.05], on_step=lambda step: slow_down(step, back=9))
    assert [d.step for d in autos[0].history] == [3], [d.summary() for d in autos[0].history]
    assert autos[0]._suspect == (0, 0)  # seen at 8, not at 12 or 16
    # A suspicion goes with a checkpoint (a restored run confirms it as this one would).
    autos, comms, link = job(2, rate=1e10, latency=1e-5)
    train(autos, comms, 10, [0.05, 0.05], on_step=slow_down)
    state = autos[0].state_dict()
    assert state["auto"]["suspect"] == [-1, 0]
    again = Auto(warmup=1, calibrate=2, check_every=4, early=1.0)
    again.load_state_dict(state)
    assert again._suspect == (-1, 0)


def counting_probes(autos) -> list[int]:
    """Counts each rank's probes (``Auto._probe``), one entry per rank."""
    counts = [0] * len(autos)
    for r, a in enumerate(autos):
        def probe(comm, numbers, r=r, real=a._probe):
            counts[r] += 1
            return real(comm, numbers)
        a._probe = probe
    return counts


def test_a_compressed_exchange_is_probed_after_a_decision_and_when_it_moves():
    """Compressed, the link is probed at the first check after the decision (its exchange's
    measure is taken then) and not again while the exchange stays as it was; a link that
    slows makes the exchange slower at the check of step 12, the probe at 16 confirms, and
    auto decides again on the new rate (int8 still: the same choice, so not announced)."""
    autos, comms, link = job(2, rate=1e6, options=("none", "int8"))
    probes = counting_probes(autos)
    train(autos, comms, 25, [0.05, 0.05])
    assert probes == [1, 1]  # the check of step 8 only (decided at 3; checks 8 .. 24)
    assert [d.step for d in autos[0].history] == [3]

    autos, comms, link = job(2, rate=1e6, options=("none", "int8"))
    probes = counting_probes(autos)

    def slow_down(step):
        if step == 9:  # after the probe at step 8
            link.rate[:] = [2e5, 2e5]

    train(autos, comms, 21, [0.05, 0.05], on_step=slow_down)
    assert probes == [2, 2]  # 8, then 16 (the exchange moved at 12); not 20
    now = autos[0].decision
    assert (now.step, now.reason.split(":")[0]) == (16, "drift"), now.summary()
    assert now.rate == pytest.approx(2e5, rel=0.1) and now.choices["big"] == "int8"


def test_a_rate_read_once_does_not_move_a_decision_taken_for_compute():
    """The compute doubles (seen at the checks of steps 8 and 12: decided again at 12); the
    probes of those checks read the link 10 times faster, then 10 times slower, neither
    twice: the decision at 12 keeps the rate the calibration measured."""
    autos, comms, link = job(2, rate=1e6, options=("none", "int8"))
    compute = [0.05, 0.05]

    def change(step):
        if step == 5:
            compute[:] = [0.1, 0.1]
        link.rate[:] = {8: [1e7, 1e7], 12: [1e5, 1e5]}.get(step, [1e6, 1e6])

    train(autos, comms, 13, compute, on_step=change)
    now = autos[0].decision
    assert (now.step, now.reason) == (12, "drift: compute 50 -> 100 ms"), now.summary()
    assert now.rate == pytest.approx(1e6, rel=0.05)


def test_a_re_decision_keeps_the_options_in_force_within_the_tolerance():
    """int4 is chosen for a short step; the compute grows to 2 s, where int8 (more
    faithful) comes within the margin (2%) of int4 and a first decision would take it. A
    re-decision keeps int4: a change drops the residuals and costs steps, which a near tie
    does not repay."""
    autos, comms, _ = job(2, rate=1e6, options=("none", "int8", "int4"))
    compute = [0.05, 0.05]

    def grow(step):
        if step == 5:
            compute[:] = [2.0, 2.0]

    train(autos, comms, 13, compute, on_step=grow)
    now = autos[0].decision
    assert now.reason.startswith("drift: compute") and now.step == 12, now.summary()
    assert now.choices["big"] == "int4" and [d.step for d in autos[0].history] == [3]
    fresh, comms2, _ = job(2, rate=1e6, options=("none", "int8", "int4"))
    train(fresh, comms2, 4, [2.0, 2.0])
    assert fresh[0].decision.choices["big"] == "int8"  # what a first decision takes


def slowed(comms, seconds: float) -> None:
    """Each compressed collective (int8's all-to-all and gather) takes ``seconds`` more than
    its bytes: what the model leaves out (arithmetic, small collectives, waiting for the
    other ranks, cores shared with the backward pass)."""

    class Slowed(LinkComm):
        def alltoall(self, send):
            self.clock.t += seconds
            return super().alltoall(send)

        def allgather(self, mine):
            self.clock.t += seconds
            return super().allgather(mine)

    for c in comms:
        c.__class__ = Slowed


def test_a_compressed_exchange_slowed_by_what_the_model_leaves_out_is_no_slower_link():
    """The chosen option's exchanges take far longer than the model says (here 0.05 s more
    per compressed collective), though its steps are still faster than float32's; the link
    is as fast as calibrated. The drift check measures the link by its probe and keeps the
    rate and the choice; read from those exchanges, the rate fell at each check and chose
    ever more compression."""
    autos, comms, _ = job(2, rate=1e6, options=("none", "int8"))
    slowed(comms, 0.05)
    train(autos, comms, 18, [0.05, 0.05])
    first = autos[0].history[0]
    assert first.reason == "calibrated" and first.choices["big"] != "none"
    assert len(autos[0].history) == 1, [d.summary() for d in autos[0].history]
    assert autos[0]._agreed["rate"] == pytest.approx(1e6, rel=0.05)


def test_a_choice_the_steps_do_not_bear_out_is_undone_and_not_tried_again_at_that_rate():
    """int8 pays by the model, but each of its collectives costs 0.2 s more than its bytes:
    its steps are slower than float32's. The check after the decision compares the steps
    and goes back to none; a later check, at the same rate, re-decides for a longer compute
    and is not let to try int8 again; a link that then slows down by more than ``drift``
    lets it be tried again."""
    autos, comms, link = job(2, rate=1e6, options=("none", "int8"))
    slowed(comms, 0.2)
    compute = [0.05, 0.05]

    def change(step):
        if step == 9:  # the checks at 12 and 16 re-decide for it (int8 wins by the model)
            compute[:] = [0.1, 0.1]
        if step == 17:  # seen at the checks of steps 20 and 24
            link.rate[:] = [2e5, 2e5]

    train(autos, comms, 25, compute, on_step=change)
    history = autos[0].history
    assert [d.choices["big"] for d in history] == ["int8", "none", "int8"], \
        [d.summary() for d in history]
    assert history[1].step == 4 and history[1].reason.startswith("measured: int8 took "), \
        history[1].reason
    assert history[1].reason.endswith("; undone")
    assert history[2].step == 24 and history[2].reason.startswith("drift: rate"), \
        history[2].reason
    assert [a.history[-1].choices for a in autos] == [history[-1].choices] * 2
    # the undone trial and its refusal go with a checkpoint
    state = autos[0].state_dict()["auto"]
    assert state["refused"] == [] and state["trial"]["new"] == [1, 0] and \
        state["trial"]["old"] == [0, 0]


def test_the_outcome_check_weighs_each_choices_steps_by_its_steps_factor():
    """PowerSGD (steps factor 1.8 at rank 4) is chosen on a slow link; the link speeds up and
    int4 (1.0) is chosen, and its steps (each of its collectives 5 ms slower than its bytes)
    are longer than PowerSGD's, but not by 1.8 times: it reaches the target sooner, and is
    kept. Compared step for step, as before, it was undone (``gradsync bench compress`` at
    25 Mbit/s: int4 495 ms a step against PowerSGD's 325 ms, which needed 144 steps to
    int4's 88)."""
    autos, comms, link = job(2, rate=1e5, options=("none", "int4", "powersgd"),
                             powersgd_ranks=(4,))
    slowed(comms, 0.005)

    def speed_up(step):
        if step == 5:  # after the decision at step 3, seen at the checks of 8 and 12
            link.rate[:] = [1e6, 1e6]

    train(autos, comms, 17, [0.05, 0.05], on_step=speed_up)
    steps = [(d.step, d.choices["big"], d.reason.split(":")[0]) for d in autos[0].history]
    assert steps == [(3, "powersgd4", "calibrated"), (12, "int4", "drift")], \
        [d.summary() for d in autos[0].history]
    assert autos[0]._trial is None and not autos[0]._refused  # judged at 16, and kept


@pytest.mark.parametrize("size", [2, 3])
def test_a_change_of_option_sends_what_the_old_one_still_owes(size):
    """PowerSGD on a slow link, int4 once it speeds up, none once it is fast and the step
    short: each change sends what the old option still owes (each rank's residual, a
    quantizer's owners') with the new option's first exchange, so once a step went float32
    the results of every step sum to the sum of the exact means, and nothing is held."""
    autos, comms, link = job(size, rate=1e5, options=("none", "int4", "powersgd"),
                             powersgd_ranks=(4,))
    slowed(comms, 0.005)
    compute = [0.05] * size

    def change(step):
        if step == 5:  # seen at the checks of 8 and 12: int4
            link.rate[:] = [1e6] * size
        if step == 13:  # seen at the checks of 16 and 20: none
            link.rate[:] = [1e10] * size
            compute[:] = [0.001] * size

    kept: list[list] = [[] for _ in range(size)]
    steps = 22
    train(autos, comms, steps, compute, on_step=change, kept=kept)
    changes = [(d.step, d.choices["big"]) for d in autos[0].history]
    assert changes == [(3, "powersgd4"), (12, "int4"), (20, "none")], \
        [d.summary() for d in autos[0].history]
    n = 256 * 256
    means = [sum(grad(step, r, n) for r in range(size)) / size for step in range(steps)]
    for r in range(size):
        total = sum(out[0] for out in kept[r])
        assert torch.allclose(total, sum(means), atol=1e-4), (total - sum(means)).abs().max()
    assert not any(a._owed for a in autos)
    assert all(not c.state.tensors for a in autos for c in a.inner.values())


def test_a_resize_recalibrates_and_a_checkpoint_continues():
    autos, comms, _ = job(2, rate=1e6)
    train(autos, comms, 6, [0.05, 0.05])
    chosen = autos[0].decision.choices
    states = [a.state_dict() for a in autos]  # each rank's checkpoint: its own residuals
    # The same world, restored from a checkpoint: the choice and its residuals go on, bit
    # for bit as the run that was not interrupted, and nothing recalibrates.
    straight = train(autos, comms, 3, [0.05, 0.05])
    again, comms2, _ = job(2, rate=1e6)
    for a, state in zip(again, states):
        a.load_state_dict(state)
    assert again[1].decision.choices == chosen
    resumed = train(again, comms2, 3, [0.05, 0.05])
    assert len(again[0].history) == 0 and again[0].decision.choices == chosen
    for s_out, r_out in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(s_out, r_out))
    # Steps numbered alike (the drift checks fall on the same steps).
    assert again[0].state_dict()["auto"]["step"] == autos[0].state_dict()["auto"]["step"]
    # A new world of 3 ranks that took rank 0's state (an elastic sync): measured again.
    bigger, comms3, _ = job(3, rate=1e6)
    for a in bigger:
        a.load_state_dict(states[0])
    train(bigger, comms3, 6, [0.05] * 3)
    d = bigger[2].decision
    assert d.reason == "resize 2 -> 3 ranks" and d.ranks == 3 and d.step == 3, d
    assert all(a.decision.choices == d.choices for a in bigger)


@pytest.mark.parametrize("early,saved_after", [(1.0, 3), (0.5, 2), (0.5, 1)])
def test_a_checkpoint_taken_where_calibration_ends_still_decides(early, saved_after):
    """A state saved at the end of the step before an agreement (the last calibration step,
    or the probe step) numbers the next step as done: the agreement's boundary is passed
    without its first call, and the restored ranks still decide (they never did before)."""
    autos, comms, _ = job(2, rate=1e6, early=early)
    train(autos, comms, saved_after, [0.05, 0.05])
    states = [a.state_dict() for a in autos]
    fresh = [Auto(clock=comms[r].clock, warmup=1, calibrate=2, check_every=4, early=early)
             for r in range(2)]
    for a, state in zip(fresh, states):
        a.load_state_dict(state)
    train(fresh, comms, 4, [0.05, 0.05])
    d = fresh[0].decision
    assert d is not None and d.reason == "calibrated" and d.choices["big"] != "none", d
    assert fresh[1].decision.choices == d.choices


def test_a_checkpoint_from_before_int4_loads_with_its_choices_by_name():
    """A state saved by an Auto without int4 (the options before it was one) loads into
    today's: each bucket keeps the option it had, by name, and its residuals, and the run
    goes on bit for bit; a state of other settings is still refused."""
    before = ("none", "bf16", "int8", "powersgd")
    autos, comms, _ = job(2, rate=1e6, options=before)
    train(autos, comms, 6, [0.05, 0.05])
    chosen = autos[0].decision.choices
    assert set(chosen.values()) - {"none", "bf16", "int8"}, chosen  # a PowerSGD: renumbered
    states = [a.state_dict() for a in autos]
    straight = train(autos, comms, 2, [0.05, 0.05])
    today, comms2, _ = job(2, rate=1e6)
    assert "int4" in today[0].names
    for a, state in zip(today, states):
        a.load_state_dict(state)
    assert today[0].decision.choices == chosen
    assert {k: today[0].names[c] for k, c in today[0]._choice.items()} == chosen
    resumed = train(today, comms2, 2, [0.05, 0.05])
    for s_out, r_out in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(s_out, r_out))
    # Saved under the margin then the default (0.05): it loads into today's default too.
    legacy = dict(states[0], compressor=states[0]["compressor"].replace("margin=0.02",
                                                                        "margin=0.05"))
    assert legacy != states[0]
    Auto(warmup=1, calibrate=2, check_every=4, early=1.0).load_state_dict(legacy)
    with pytest.raises(ValueError, match="cannot be loaded"):
        Auto(options=before, margin=0.5).load_state_dict(states[0])
    with pytest.raises(ValueError, match="cannot be loaded"):  # not a subset of its options
        Auto(options=("none", "int8")).load_state_dict(states[0])


def test_state_dict_holds_the_inner_residuals_and_refuses_another_compressor():
    autos, comms, _ = job(2, rate=1e6)
    train(autos, comms, 6, [0.05, 0.05])
    name = autos[0].decision.choices["big"]
    state = autos[0].state_dict()
    assert "big" in state["inner"][name]["state"]["tensors"]
    with pytest.raises(ValueError, match="cannot be loaded"):  # drift: every rank's checks
        Auto(drift=0.5, early=1.0).load_state_dict(state)
    # What steers rank 0's next decisions only need not match: the margin, local SGD's prior
    # (and its setting of before, share).
    Auto(margin=0.5, early=1.0).load_state_dict(state)
    local = Auto(local_sgd=8, early=1.0)
    saved = {**state, "compressor": local.describe().replace("local_steps=0.2", "share=0.1")}
    Auto(local_sgd=8, local_steps=0.0, early=1.0).load_state_dict(saved)
    with pytest.raises(ValueError, match="cannot be loaded"):  # local SGD not allowed here
        Auto(early=1.0).load_state_dict(saved)


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown option"):
        Auto(options=("none", "int2"))
    with pytest.raises(ValueError, match="calibrate"):
        Auto(calibrate=0)
    with pytest.raises(ValueError, match="powersgd_steps"):
        Auto(powersgd_steps=0.5)
    assert Auto(options=("none", "int8")).names == ("none", "int8")
    with pytest.raises(ValueError, match="tolerance"):
        Auto(tolerance=-0.1)
    assert "tolerance" not in Auto().describe() and "margin=0.02" in Auto().describe()
    assert "tolerance=0.1" in Auto(tolerance=0.1).describe()


def test_the_elastic_handler_commits_and_rolls_back_the_choice():
    """In an elastic State (``elastic.py``'s handler): a commit keeps the choice and the
    residuals; a roll-back after more steps and a re-decision (here: a resize to 3 ranks
    on a fast link, measured and decided afresh) brings the committed ones back."""
    autos, comms, _ = job(2, rate=1e6)
    train(autos, comms, 6, [0.05, 0.05])
    handler = autos[0].elastic_handler(lambda obj, root, name: obj)
    committed = autos[0].state_dict()
    train(autos, comms, 2, [0.05, 0.05])  # the residuals move on
    bigger, comms3, _ = job(3, rate=1e10, latency=1e-5)
    bigger[0] = autos[0]  # rank 0's Auto goes on in the new world
    train(bigger, comms3, 6, [0.05] * 3)
    assert autos[0].decision.reason == "resize 2 -> 3 ranks"
    assert autos[0].decision.choices != committed["auto"]["decision"]["choices"]
    handler.restore()
    restored = autos[0].state_dict()["auto"]
    for held in (restored, committed["auto"]):
        held["decision"].pop("made")  # the order of making, renewed by a load
    assert restored == committed["auto"]
    inner = autos[0].state_dict()["inner"]
    for name, state in committed["inner"].items():
        for key, held in state["state"]["tensors"].items():
            assert all(torch.equal(t, inner[name]["state"]["tensors"][key][n])
                       for n, t in held.items())


# --------------------------------------------------------------------------- local SGD's H
def only(nbytes: int, int8_seconds: float = 0.004) -> m.Bucket:
    return m.Bucket("b", nbytes, (m.Option("none", 1.0, 1, 0.0),
                                  m.Option("int8", 0.25, 2, int8_seconds)))


def period(rate, compute, periods=m.periods_upto(32), bucket=None, latency=1e-3,
           margin=0.05, local_steps=m.LOCAL_STEPS, overlap=0) -> tuple:
    """(H, sync option), with ``overlap`` also the steps each sync runs behind."""
    inputs = m.Inputs((bucket or only(4_000_000),), rate, latency, compute, margin=margin,
                      periods=periods, local_steps=local_steps, overlap=overlap)
    chosen = m.choose_period(inputs, m.decide(inputs))
    return chosen if overlap else chosen[:2]


# One 4 MB bucket, latency 1 ms, H at most 32, margin 0.05, steps(H) 1, 1, 1.2, 1.4, 1.6
# for H = 2 .. 32; worked by hand from the rule (auto_model's docstring): int8 costs
# c + 0.006 + 1e6 / rate a step, none c + 0.001 + 4e6 / rate; a float32 sync 0.001 +
# 4e6 / rate, an int8 one 0.002 + 1e6 / rate + 0.004; step_H = (c + sync / H) x steps(H).
EXPECTED_H = {
    # int8 1.056 s a step; int8 syncs: H = 32 (0.05 + 0.031) x 1.6 = 0.130, the fastest,
    # nothing more faithful within 5% (H = 16: 0.158)
    (1e6, 0.05): (32, "int8"),
    # int8 1.506; H = 8 with int8 syncs the fastest (0.626 x 1.2 = 0.7509), H = 4 (0.7515)
    # within 5% of it and more faithful
    (1e6, 0.5): (4, "int8"),
    # int8 0.136; H = 4, int8 syncs (0.05 + 0.0215 = 0.0715); H = 2 (0.093) not within 5%
    (12.5e6, 0.05): (4, "int8"),
    # int8 0.586; H = 4, int8 syncs the fastest (0.5215), H = 2 (0.543) within 5% of it,
    # and 0.543 x 1.05 < 0.586
    (12.5e6, 0.5): (2, "int8"),
    # int8 0.064; H = 4, int8 syncs (0.0535); nothing more faithful within 5%
    (125e6, 0.05): (4, "int8"),
    # none 0.533; the most faithful within 5% of the fastest (H = 4, int8, 0.5035) is
    # H = 2 in float32 (0.5165), which saves less than 5% of 0.533: every step
    (125e6, 0.5): (1, "none"),
    # none 0.0542; H = 2 in float32 (0.0521) the most faithful near the fastest, not 5% less
    (1.25e9, 0.05): (1, "none"),
    (1.25e9, 0.5): (1, "none"),
}


@pytest.mark.parametrize("rate,compute", sorted(EXPECTED_H))
def test_local_sgds_h_on_a_grid_of_links_and_computes(rate, compute):
    assert period(rate, compute) == EXPECTED_H[(rate, compute)]
    assert period(rate, compute, periods=()) == (1, "none")  # not allowed: never


def test_a_larger_h_pays_only_as_far_as_its_steps_allow():
    """steps(H): 1 up to H = 4, then ``local_steps`` more per doubling. A 4 MB bucket that
    only goes float32, 0.2 s of exchange on 0.5 s of compute, no latency: with the default
    prior H = 4 (0.55 s; H = 8: 0.525 x 1.2 = 0.63); with local SGD's steps taken as free
    (local_steps=0) the largest, 32 (0.50625 s)."""
    inputs = m.Inputs((), 1.0, 0.0, 0.0, periods=m.periods_upto(32))
    assert [m.period_steps(inputs, h) for h in inputs.periods] == \
        pytest.approx([1.0, 1.0, 1.2, 1.4, 1.6])
    none_only = m.Bucket("b", 4_000_000, (m.Option("none", 1.0, 1, 0.0),))
    assert period(4e6 / 0.2, 0.5, bucket=none_only, latency=0.0, margin=0.0) == (4, "none")
    assert period(4e6 / 0.2, 0.5, bucket=none_only, latency=0.0, margin=0.0,
                  local_steps=0.0) == (32, "none")


def test_local_sgd_is_not_chosen_where_it_does_not_pay():
    """At 1 Gbit/s and 50 ms of compute H = 4 with int8 syncs pays; allowed only H = 2, it
    still does (0.057 x 1.05 against int8's 0.064); with no sync but float32 allowed, the
    most faithful local SGD near the fastest saves less than the margin: every step."""
    assert period(125e6, 0.05, periods=m.periods_upto(16)) == (4, "int8")
    assert period(125e6, 0.05, periods=m.periods_upto(2)) == (2, "int8")
    none_only = m.Bucket("b", 4_000_000, (m.Option("none", 1.0, 1, 0.0),))
    assert period(1.25e9, 0.05, bucket=none_only) == (1, "none")


def test_the_worked_example_of_local_sgd():
    b = WORKED
    assert period(12.5e6, 0.2, m.periods_upto(16), b) == (4, "int4")
    assert period(12.5e6, 0.2, m.periods_upto(64), b) == (4, "int4")  # no more than needed
    assert period(125e6, 0.2, m.periods_upto(16), b) == (2, "int8")
    assert period(1.25e9, 0.2, m.periods_upto(16), b) == (1, "none")
    inputs = m.Inputs((b,), 12.5e6, 1e-3, 0.2, periods=m.periods_upto(16))
    assert m.sync_time(inputs, "none") == pytest.approx(0.449, abs=1e-3)
    assert m.sync_time(inputs, "int4") == pytest.approx(0.0666, abs=1e-3)
    assert m.period_step_time(inputs, m.decide(inputs), 4, "int4") == \
        pytest.approx(0.2166, abs=1e-3)


def test_local_sgd_settings_are_checked():
    assert m.periods_upto(1) == () and m.periods_upto(12) == (2, 4, 8, 12)
    with pytest.raises(ValueError, match="periods"):
        m.Inputs((), 1.0, 0.0, 0.0, periods=(4, 2))
    with pytest.raises(ValueError, match="local_sgd"):
        Auto(local_sgd=0)
    with pytest.raises(ValueError, match="does not allow local SGD"):
        Auto().attach([torch.zeros(2)], comm=ThreadComm(ThreadGroup(1), 0))
    assert "local_sgd<=16" in Auto(local_sgd=16).describe()


# Local SGD at run time: every rank holds parameters of SHAPES' shapes, steps on the
# reduced gradient (plain SGD) and calls after_step, as DistributedOptimizer.step does.
LOCAL = {"options": ("none",)}


def local_job(size: int, rate, local_sgd=8, attach=True, **settings):
    settings = {**LOCAL, **settings}
    autos, comms, link = job(size, rate, local_sgd=local_sgd, **settings)
    params = [[torch.zeros(s) for shapes in SHAPES.values() for s in shapes]
              for _ in range(size)]
    if attach:
        for a, c, p in zip(autos, comms, params):
            a.attach(p, comm=c)
    return autos, comms, link, params


def train_local(autos, comms, params, steps, compute, start=0, on_step=None,
                after_step=True, optimizers=None):
    """``steps`` steps from step ``start``; returns per rank, per step: (H in force, the
    parameters after the step). ``optimizers`` (one per rank, over its ``params``) step
    them; else plain SGD, lr 0.1, here."""
    def body(r):
        seen = []
        for step in range(start, start + steps):
            if on_step is not None and r == 0:
                on_step(step)
            comms[r].group.barrier.wait()
            comms[r].clock.t += compute[r]
            grads = []
            for (key, shapes), p in zip(SHAPES.items(), params[r]):
                g = torch.randn(p.numel(), generator=torch.Generator().manual_seed(step * 10 + r))
                grads.append(autos[r].reduce(g, shapes, comms[r], key, average=True))
            held = autos[r].period
            if optimizers is not None:
                for p, g in zip(params[r], grads):
                    p.grad = g.view(p.shape).clone()
                optimizers[r].step()
            else:
                for p, g in zip(params[r], grads):
                    p.sub_(0.1 * g.view(p.shape))
            if after_step:
                autos[r].after_step()
            seen.append((held, [p.clone() for p in params[r]]))
        return seen

    return run_threads(len(comms), body, comms[0].group.barrier.abort)


def test_local_sgd_only_where_allowed_and_attached(caplog):
    for local_sgd, attach, expected in ((None, False, 1), (8, False, 1), (8, True, 8)):
        autos, comms, _, params = local_job(2, 1e6, local_sgd=local_sgd, attach=attach)
        with caplog.at_level("WARNING", logger="gradsync"):
            seen = train_local(autos, comms, params, 6, [0.05, 0.05])
        d = autos[0].decision
        assert (d.period, autos[1].decision.period) == (expected, expected), d.summary()
        # H takes effect at the step it was agreed in (3), whose buckets follow the
        # agreement: the ranks were equal then.
        assert [h for h, _ in seen[0]] == [1, 1, 1] + [expected] * 3
        assert d.short().startswith("local SGD H=8") == (expected == 8)
    assert "not every rank attached" in caplog.text


# (rate, compute, largest H) -> H: two ranks, the buckets of SHAPES in float32 only (LOCAL),
# sync = 1 ms + 0.262 s at 1 MB/s; closed forms as in EXPECTED_H.
RUNTIME_H = {(1e6, 0.05, 8): 8,      # none 0.314 s a step; H = 8: 0.083 x 1.2 = 0.0995
             (1e6, 0.05, 64): 16,    # H = 16: 0.0664 x 1.4 = 0.0930 (32: 0.0932, 64: 0.0974)
             (1e6, 0.5, 64): 4,      # H = 4: 0.566 (8: 0.533 x 1.2 = 0.640)
             (1e6, 5.0, 64): 1,      # H = 2 (5.13 s) saves less than 5% of 5.264
             (1e10, 0.05, 64): 1}    # a fast link: none, every step


@pytest.mark.parametrize("rate,compute,most", sorted(RUNTIME_H))
def test_auto_chooses_h_from_the_measured_link_and_step(rate, compute, most):
    autos, comms, _, params = local_job(2, rate, local_sgd=most, latency=1e-3)
    train_local(autos, comms, params, 5, [compute, compute])
    assert [a.decision.period for a in autos] == [RUNTIME_H[(rate, compute, most)]] * 2, \
        autos[0].decision.summary()


def test_local_sgd_exchanges_nothing_between_syncs_and_averages_at_each_windows_end():
    autos, comms, _, params = local_job(2, 1e6)
    counted = []
    seen = train_local(autos, comms, params, 13, [0.05, 0.05],
                       on_step=lambda step: counted.append(comms[0].collectives))
    # Steps 3 .. 10 are the first window (agreed at step 3's first call, before its
    # buckets): no collective but the agreement at step 3 and the drift checks at steps 4
    # and 8 (two each: nothing was compressed, so no probe of the link); the sync after
    # step 10 is one allreduce (float32: the only option here).
    assert [h for h, _ in seen[1]][2:] == [1] + [8] * 10
    assert [b - a for a, b in zip(counted[3:], counted[4:11])] == [2, 2, 0, 0, 0, 2, 0]
    assert counted[11] - counted[10] == 1
    for step in (2, 10):  # exchanged, and the window's sync: equal bit for bit
        assert all(torch.equal(a, b) for a, b in zip(seen[0][step][1], seen[1][step][1]))
    for step in (3, 9, 11):  # each rank on its own gradients
        assert not torch.equal(seen[0][step][1][0], seen[1][step][1][0])
    # The sync is the ranks' mean: after step 10, (sum of the two ranks' parameters) / 2.
    alone = [torch.zeros(256, 256), torch.zeros(256, 256)]
    for r in range(2):
        alone[r].copy_(seen[r][2][1][0])
        for step in range(3, 11):
            alone[r] -= 0.1 * torch.randn(
                256 * 256, generator=torch.Generator().manual_seed(step * 10 + r)).view(256, 256)
    assert torch.allclose(seen[0][10][1][0], (alone[0] + alone[1]) / 2, atol=1e-5)


def test_every_rank_takes_rank_0s_h():
    """Rank 0 allows H up to 8, rank 1 up to 64: each alone would choose another (8, and
    16 where its steps allow no more); together both take rank 0's, and their syncs stay
    paired."""
    alone = []
    for most in (8, 64):
        autos, comms, _, params = local_job(2, 1e6, local_sgd=most)
        train_local(autos, comms, params, 5, [0.05, 0.05])
        alone.append(autos[0].decision.period)
    assert alone == [8, 16]
    autos, comms, _, params = local_job(2, 1e6)
    autos[1] = Auto(clock=comms[1].clock, warmup=1, calibrate=2, check_every=4, **LOCAL,
                    early=1.0, local_sgd=64)
    autos[1].attach(params[1], comm=comms[1])
    seen = train_local(autos, comms, params, 12, [0.05, 0.05])
    assert [a.decision.period for a in autos] == [8, 8]
    assert all(torch.equal(a, b) for a, b in zip(seen[0][10][1], seen[1][10][1]))


def test_a_slow_sync_runs_behind_the_next_windows_first_steps():
    """``local_overlap=2``: the float32 sync (0.263 s) outlasts five steps of 50 ms, so it
    may run two steps behind (H = 8: 0.05 + 0.163 / 8 = 0.070 s a step x 1.32 = 0.093,
    against 0.0995 at once). The window of steps 3 .. 10 ends in a sync that lands after
    step 12: each rank then holds the ranks' mean of step 10 plus its own steps 11 and 12,
    kept, not overwritten; the ranks never hold the same parameters."""
    autos, comms, link = job(2, 1e6, local_sgd=8, local_overlap=2, **LOCAL)
    params = [[torch.zeros(s) for shapes in SHAPES.values() for s in shapes]
              for _ in range(2)]
    syncs = ThreadGroup(2)  # a group of its own: the sync runs beside the steps' collectives
    for r, (a, p) in enumerate(zip(autos, params)):
        a.attach(p, comm=LinkComm(syncs, r, Clock(), link))
    seen = train_local(autos, comms, params, 15, [0.05, 0.05])
    d = autos[0].decision
    assert (d.period, d.overlap, d.sync_option) == (8, 2, "none"), d.summary()
    assert "landing 2 steps later" in d.summary() and "2 behind" in d.short()
    assert [h for h, _ in seen[0]] == [1] * 3 + [8] * 12
    assert autos[0]._local.diloco.landed == [(10, 0)]  # its 10th step: step 12
    mean = [(a + b) / 2 for a, b in zip(seen[0][10][1], seen[1][10][1])]
    for r in range(2):
        for i, p in enumerate(seen[r][12][1]):
            own = sum(torch.randn(p.numel(), generator=torch.Generator().manual_seed(
                step * 10 + r)) for step in (11, 12)).view(p.shape)
            assert torch.allclose(p, mean[i] - 0.1 * own, atol=1e-5), (r, i)
    for step in (10, 11, 12, 13):
        assert not torch.equal(seen[0][step][1][0], seen[1][step][1][0])
    autos[0].settle()  # nothing in flight: returns at once


@pytest.mark.parametrize("stop", [12, 13])
def test_a_sync_behind_survives_a_state_dict(stop):
    """A checkpoint after step 11, the window's sync in flight (it lands after step 12): the
    restored run, its sync's result in the state, lands it at the same step and goes on bit
    for bit as the one that was not interrupted. After step 12, the sync landed, step 12's
    drift check waits (it fell on the sync): the state keeps it owed."""
    def overlapped(attach=True):
        autos, comms, link = job(2, 1e6, local_sgd=8, local_overlap=2, **LOCAL)
        params = [[torch.zeros(s) for shapes in SHAPES.values() for s in shapes]
                  for _ in range(2)]
        syncs = ThreadGroup(2)
        attach_to = [(a, p, LinkComm(syncs, r, Clock(), link))
                     for r, (a, p) in enumerate(zip(autos, params))]
        if attach:
            for a, p, c in attach_to:
                a.attach(p, comm=c)
        return autos, comms, params, attach_to

    autos, comms, params, _ = overlapped()
    train_local(autos, comms, params, stop, [0.05, 0.05])
    assert autos[0]._local.in_flight() == (stop == 12)
    states = [a.state_dict() for a in autos]
    assert states[0]["auto"]["check_owed"] == (stop == 13)
    kept = [[p.clone() for p in ps] for ps in params]
    straight = train_local(autos, comms, params, 3, [0.05, 0.05], start=stop)
    again, comms2, _, attach_to = overlapped(attach=False)
    for r, (a, _, c) in enumerate(attach_to):
        a.attach(kept[r], comm=c)
        a.load_state_dict(states[r])
    resumed = train_local(again, comms2, kept, 3, [0.05, 0.05], start=stop)
    assert again[0]._local.diloco.landed == ([(10, 0)] if stop == 12 else [])
    assert again[0]._check_owed is False and again[0].decision.step == autos[0].decision.step
    for s_rank, r_rank in zip(straight, resumed):
        for (s_h, s_params), (r_h, r_params) in zip(s_rank, r_rank):
            assert s_h == r_h
            assert all(torch.equal(a, b) for a, b in zip(s_params, r_params))


def test_overlap_in_the_model():
    """The worked bucket, 0.2 s of compute. At 25 Mbit/s an int4 sync (0.236 s) outlasts a
    step: allowed two steps behind, H = 4 with int4 syncs two behind (0.2 x 1.2 = 0.24 s a
    step, against 0.259 at once). At 100 Mbit/s the int4 sync (0.066 s) costs less at once
    than the steps a sync behind costs: at once. overlap_steps: the fewest steps that cover
    the sync, at most the allowed and H / 2."""
    def chosen(rate, overlap):
        inputs = m.Inputs((WORKED,), rate, 1e-3, 0.2, periods=m.periods_upto(16),
                          overlap=overlap)
        return m.choose_period(inputs, m.decide(inputs))

    assert chosen(3.125e6, 2) == (4, "int4", 2)
    assert chosen(3.125e6, 0) == (4, "int4", 0)
    assert chosen(12.5e6, 2) == (4, "int4", 0)
    inputs = m.Inputs((WORKED,), 3.125e6, 1e-3, 0.2, periods=m.periods_upto(16), overlap=2)
    assert m.period_step_time(inputs, (), 4, "int4", 2) == pytest.approx(0.2)
    assert m.period_steps(inputs, 4, 2) == pytest.approx(1.2)
    assert m.period_steps(inputs, 8, 2) == pytest.approx(1.2 + 0.2 * math.log2(1.5))
    assert [m.overlap_steps(inputs, h, "int4") for h in (2, 4, 16)] == [1, 2, 2]
    assert m.overlap_steps(dataclasses.replace(inputs, overlap=1), 16, "int4") == 1
    assert m.overlap_steps(dataclasses.replace(inputs, compute=0.5), 16, "int4") == 1
    assert m.overlap_steps(dataclasses.replace(inputs, overlap=0), 16, "int4") == 0
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(inputs, overlap=-1)
    with pytest.raises(ValueError, match="local_overlap"):
        Auto(local_sgd=8, local_overlap=-1)
    assert "local_overlap=2" in Auto(local_sgd=8, local_overlap=2).describe()
    assert "local_overlap" not in Auto(local_sgd=8).describe()


def test_a_window_without_after_step_fails_loudly():
    autos, comms, _, params = local_job(2, 1e6)
    with pytest.raises(RuntimeError, match="after_step"):
        train_local(autos, comms, params, 13, [0.05, 0.05], after_step=False)


def test_a_faster_link_ends_local_sgd_at_the_windows_end():
    autos, comms, link, params = local_job(2, 1e6)

    def speed_up(step):
        if step == 5:  # inside the first window (steps 3 .. 10)
            link.rate[:] = [1e10, 1e10]
            link.latency[:] = [1e-5, 1e-5]

    seen = train_local(autos, comms, params, 30, [0.05, 0.05], on_step=speed_up)
    last = autos[0].history[-1]
    # Measured from the syncs after steps 10 and 18 (the check of step 16 has none: the
    # suspicion waits), judged at the check of step 20; the window that began at step 19
    # runs to its end (step 26: its anchors are the parameters of its start).
    assert (last.reason.startswith("drift: rate"), last.step, last.period) == (True, 20, 1)
    assert [h for h, _ in seen[0]][10:] == [8] * 17 + [1] * 3
    assert all(torch.equal(a, b) for a, b in zip(seen[0][29][1], seen[1][29][1]))


@pytest.mark.parametrize("given", [True, False], ids=["optimizer", "no-optimizer"])
def test_where_local_sgd_ends_the_optimizers_state_is_averaged_too(given, caplog):
    """SGD with momentum: in local SGD's windows each rank's momentum follows its own
    gradients. Where a faster link hands back to every step exchanged (the window of steps
    19 .. 26 ends, H = 1 from step 27), equal gradients on unequal momenta would move the
    ranks apart for good: with the optimizer given to attach, its state is averaged after
    that window's sync, and the ranks stay equal bit for bit; without it, a WARNING, and
    they drift apart."""
    autos, comms, link, params = local_job(2, 1e6, attach=False)
    opts = [torch.optim.SGD(p, lr=0.1, momentum=0.9) for p in params]
    for a, c, p, o in zip(autos, comms, params, opts):
        a.attach(p, comm=c, optimizer=o if given else None)

    def speed_up(step):
        if step == 5:
            link.rate[:] = [1e10, 1e10]
            link.latency[:] = [1e-5, 1e-5]

    with caplog.at_level("WARNING", logger="gradsync"):
        seen = train_local(autos, comms, params, 30, [0.05, 0.05], on_step=speed_up,
                           optimizers=opts)
    assert [h for h, _ in seen[0]][26:] == [8, 1, 1, 1]
    equal = [all(torch.equal(a, b) for a, b in zip(seen[0][s][1], seen[1][s][1]))
             for s in (26, 27, 29)]
    assert equal == ([True] * 3 if given else [True, False, False])
    momenta = [[o.state[p]["momentum_buffer"] for p in ps] for o, ps in zip(opts, params)]
    assert all(torch.equal(a, b) for a, b in zip(*momenta)) == given
    assert ("pass attach(..., optimizer=opt)" in caplog.text) != given


QUANTIZED = {"options": ("none", "int8")}


def test_local_sgd_syncs_through_the_quantizer_it_chose():
    """With int8 among the options, a slow link's syncs go through it (H = 4: per step int8
    0.119 s; H = 4 with int8 syncs 0.05 + 0.068 / 4 = 0.067, float32 syncs 0.116): two
    collectives a sync, the ranks equal bit for bit after it, the parameters within int8's
    rounding of the ranks' mean, and what the sync left out kept for the next."""
    autos, comms, _, params = local_job(2, 1e6, **QUANTIZED)
    counted = []
    seen = train_local(autos, comms, params, 12, [0.05, 0.05],
                       on_step=lambda step: counted.append(comms[0].collectives))
    d = autos[0].decision
    assert (d.period, d.sync_option, d.step) == (4, "int8", 3), d.summary()
    assert "through int8" in d.short() and "parameters averaged in int8" in d.summary()
    assert [h for h, _ in seen[0]][2:] == [1] + [4] * 9
    assert counted[7] - counted[6] == 2  # the sync after step 6: alltoall and allgather
    alone = [[p.clone() for p in seen[r][2][1]] for r in range(2)]
    for r in range(2):
        for step in range(3, 7):
            for p, (key, shapes) in zip(alone[r], SHAPES.items()):
                p -= 0.1 * grad(step, r, p.numel()).view(p.shape)
    mean = [(a + b) / 2 for a, b in zip(*alone)]
    for step in (6, 10):
        assert all(torch.equal(a, b) for a, b in zip(seen[0][step][1], seen[1][step][1]))
    after = seen[0][6][1]
    assert all(torch.allclose(a, m_, atol=0.02) for a, m_ in zip(after, mean))
    assert not all(torch.equal(a, m_) for a, m_ in zip(after, mean))  # rounded: not exact
    held = autos[0]._local.diloco.compressor.state.tensors
    assert held and all("residual" in v for v in held.values())


def test_a_quantized_sync_slowed_by_what_the_model_leaves_out_is_no_slower_link():
    """Local SGD's syncs through int8 take 0.1 s more than the model says (0.05 s more per
    compressed collective); the link is as fast as calibrated. The drift checks measure the
    link by a probe, as for a compressed exchange, and keep the rate and the choice; read
    from the syncs, the link looked slower at each check and H grew."""
    autos, comms, _, params = local_job(2, 1e6, **QUANTIZED)
    slowed(comms, 0.05)
    train_local(autos, comms, params, 30, [0.05, 0.05])
    history = autos[0].history
    assert [(d.step, d.period, d.sync_option) for d in history] == [(3, 4, "int8")], \
        [d.summary() for d in history]
    assert autos[0]._agreed["rate"] == pytest.approx(1e6, rel=0.05)


def test_a_slower_link_under_quantized_syncs_is_seen_by_two_probes():
    """The link slows to a fifth at step 5, inside local SGD's first window (int8 syncs):
    the probe of the check at step 8 (the first after the calibration's decision) reads it,
    the one at 12 confirms it, and the ranks decide again for the slower link. That
    re-decision's rate was read twice: its first sync is its measure, with no probe (none
    at the checks of steps 16 to 28)."""
    autos, comms, link, params = local_job(2, 1e6, **QUANTIZED)
    probes = counting_probes(autos)

    def slow_down(step):
        if step == 5:
            link.rate[:] = [2e5, 2e5]

    train_local(autos, comms, params, 14, [0.05, 0.05], on_step=slow_down)
    last = autos[0].history[-1]
    assert (last.step, last.reason.startswith("drift: rate")) == (12, True), last.summary()
    assert last.rate == pytest.approx(2e5, rel=0.05)
    assert probes == [2, 2]
    train_local(autos, comms, params, 16, [0.05, 0.05], start=14)
    assert probes == [2, 2] and autos[0].history[-1].step == 12


# The warm-up as a local SGD window: a quantizer among the options (so a probe step), local
# SGD attached with the optimizer.
WARM_LOCAL = {"options": ("none", "int8", "int4"), "local_sgd": 8, "early": 0.5,
              "calibrate": 2, "check_every": 4}


def warm_local_job(size: int, rate, attached=None, warmup=1, comm=Counting, latency=1e-3,
                   momentum=0.0, optimizer=True, **settings):
    """Ranks over ``SHAPES``' parameters, each stepped by SGD (lr 0.1, ``momentum``), attached
    (``attached[r]``, default every rank) with its optimizer (``optimizer``)."""
    group = ThreadGroup(size)
    link = Link(size, rate, latency)
    clocks = [Clock() for _ in range(size)]
    comms = [comm(group, r, clocks[r], link, None) for r in range(size)]
    autos = [Auto(clock=clocks[r], warmup=warmup, **{**WARM_LOCAL, **settings})
             for r in range(size)]
    params = [[torch.zeros(s) for shapes in SHAPES.values() for s in shapes]
              for _ in range(size)]
    opts = [torch.optim.SGD(p, lr=0.1, momentum=momentum) for p in params]
    for r, (a, c, p, o) in enumerate(zip(autos, comms, params, opts)):
        if attached is None or attached[r]:
            a.attach(p, comm=c, optimizer=o if optimizer else None)
    return autos, comms, params, opts


@pytest.mark.parametrize("size", [2, 3])
def test_with_local_sgd_attached_the_warm_up_is_a_local_window(size, monkeypatch):
    """The warm-up and probe steps (0 and 1 here) exchange no gradient: each rank steps on
    its own, and after the probe step the parameters are averaged once through the warm
    quantizer (int4), where the warm-up exchanged every step before. The probe still
    measures the link (once), the ranks decide after it (step 2) on its rate, local SGD
    from there, and no bucket ever crossed the link in float32."""
    from gradsync.compress import auto_policy

    monkeypatch.setattr(auto_policy, "PROBE_BYTES", 1 << 16)
    autos, comms, params, opts = warm_local_job(size, 1e6)
    counted = []
    seen = train_local(autos, comms, params, 6, [0.05] * size, optimizers=opts,
                       on_step=lambda step: counted.append(comms[0].collectives))
    d = autos[0].decision
    assert (d.step, d.reason, d.period) == (2, "calibrated", 4), d.summary()
    assert [h for h, _ in seen[0]] == [2, 2, 4, 4, 4, 4]
    assert d.rate == pytest.approx(1e6, rel=1e-4)  # the probe's
    assert [a.decision.short() for a in autos] == [d.short()] * size
    big = 4 * 256 * 256
    assert comms[0].sizes.count(1 << 16) == 1 and big not in comms[0].sizes
    # Step 0: the attach agreed (one allreduce) and nothing else; step 1: the latency
    # samples, the probe and, after the step, the sync (an alltoall and an allgather).
    assert counted[1] - counted[0] == 1 and comms[0].sizes[0] == 4
    assert counted[2] - counted[1] == 3 + 2
    assert not torch.equal(seen[0][0][1][0], seen[1][0][1][0])  # each rank on its own
    after = seen[0][1][1]
    for r in range(1, size):
        assert all(torch.equal(a, b) for a, b in zip(after, seen[r][1][1]))
    own = [sum(grad(step, r, 256 * 256) for step in (0, 1)) for r in range(size)]
    mean = -0.1 * sum(own) / size
    error = (after[0].reshape(-1) - mean).abs()
    assert 0 < error.mean() < 0.3 * mean.abs().mean()  # int4's rounding of the mean


@pytest.mark.parametrize("attached,optimizer", [([True, False], True), (None, False)],
                         ids=["a-rank-not-attached", "no-optimizer"])
def test_the_warm_up_exchanges_where_a_rank_gave_no_parameters_or_optimizer(
        attached, optimizer):
    """The local warm-up needs every rank's parameters and optimizer (whose state is
    averaged where every step is exchanged after it): where one rank did not attach, or
    attached without its optimizer, every rank exchanges the warm-up's gradients (agreed at
    the first call)."""
    autos, comms, params, opts = warm_local_job(2, 1e6, attached=attached, optimizer=optimizer)
    seen = train_local(autos, comms, params, 4, [0.05, 0.05], optimizers=opts)
    assert [h for h, _ in seen[0]][:2] == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(seen[0][1][1], seen[1][1][1]))


@pytest.mark.parametrize("restored", [False, True], ids=["straight", "restored"])
def test_where_the_link_is_fast_the_warm_windows_optimizer_states_are_averaged(restored):
    """A fast link after the local warm-up: calibration in float32, every step exchanged
    from step 2. SGD with momentum: each rank's momentum followed its own gradients in the
    warm window; averaged at step 2's first call (where the ranks agreed that no decision
    was taken on the probe), the ranks stay equal bit for bit; so too from a state taken
    at the window's end (the averaging still owed)."""
    autos, comms, params, opts = warm_local_job(2, 1e10, latency=1e-5, momentum=0.9)
    seen = train_local(autos, comms, params, 2, [0.05, 0.05], optimizers=opts)
    if restored:
        states = [a.state_dict() for a in autos]
        assert states[0]["auto"]["warm_ended"] and not states[0]["auto"]["warm_window"]
        again, comms, _, _ = warm_local_job(2, 1e10, latency=1e-5, attached=[False, False])
        for r in range(2):
            again[r].attach(params[r], comm=comms[r], optimizer=opts[r])
            again[r].load_state_dict(states[r])
        autos = again
    seen += train_local(autos, comms, params, 6, [0.05, 0.05], start=2, optimizers=opts)
    assert [h for h, _ in seen[0][:2]] + [h for h, _ in seen[2][:6]] == [2, 2] + [1] * 6
    # (Restored where the ranks agree, the probe's reading is not in the state: calibrated
    # from step 3, decided at 5.)
    assert (autos[0].decision.step, autos[0].decision.period) == (5 if restored else 4, 1)
    first, later = seen[:2], seen[2:]
    assert not torch.equal(first[0][0][1][0], first[1][0][1][0])
    steps = [(first[0][1], first[1][1])] + list(zip(later[0], later[1]))
    for a_step, b_step in steps:
        assert all(torch.equal(a, b) for a, b in zip(a_step[1], b_step[1]))


def test_a_probe_slower_than_the_warm_windows_sync_is_not_the_links_rate(monkeypatch):
    """The warm window's sync carried the buckets' elements through the warm quantizer in
    its time: the link is at least that fast, whatever the probe met (four times the
    link's time here)."""
    from gradsync.compress import auto_policy

    monkeypatch.setattr(auto_policy, "PROBE_BYTES", 1 << 16)
    autos, comms, params, opts = warm_local_job(2, 1e6, comm=SlowProbe)
    train_local(autos, comms, params, 3, [0.05, 0.05], optimizers=opts)
    d = autos[0].decision
    assert d is not None and d.step == 2, d
    assert 0.5e6 < d.rate <= 1.3e6, d.rate  # the probe alone: 0.25e6


def test_a_state_taken_in_the_warm_window_goes_on_bit_for_bit():
    """A checkpoint after step 0 of a warm window of three steps (warm-up 2, then the probe
    step): the restored run holds the window's anchors, times the arithmetic, probes,
    syncs and decides at the same steps, and goes on bit for bit as the one that was not
    interrupted."""
    autos, comms, params, opts = warm_local_job(2, 1e6, warmup=2)
    train_local(autos, comms, params, 1, [0.05, 0.05], optimizers=opts)
    states = [a.state_dict() for a in autos]
    assert states[0]["auto"]["warm_window"] and states[0]["auto"]["phase"] == 1
    kept = [[p.clone() for p in ps] for ps in params]
    straight = train_local(autos, comms, params, 7, [0.05, 0.05], start=1, optimizers=opts)
    again, comms2, _, _ = warm_local_job(2, 1e6, warmup=2, attached=[False, False])
    opts2 = [torch.optim.SGD(p, lr=0.1) for p in kept]
    for r in range(2):
        again[r].attach(kept[r], comm=comms2[r], optimizer=opts2[r])
        again[r].load_state_dict(states[r])
    resumed = train_local(again, comms2, kept, 7, [0.05, 0.05], start=1, optimizers=opts2)
    assert [h for h, _ in straight[0]] == [3, 3] + [4] * 5
    for s_rank, r_rank in zip(straight, resumed):
        for (s_h, s_params), (r_h, r_params) in zip(s_rank, r_rank):
            assert s_h == r_h
            assert all(torch.equal(a, b) for a, b in zip(s_params, r_params))
    assert [d.short() for d in again[0].history] == [d.short() for d in autos[0].history]
    # Mid-window again (the decision's), but not the warm-up's.
    assert [a.state_dict()["auto"]["warm_window"] for a in (autos[0], again[0])] == [False] * 2


@pytest.mark.parametrize("options", [LOCAL, QUANTIZED], ids=["float32", "int8"])
@pytest.mark.parametrize("stop", [4, 7])
def test_local_sgd_survives_a_state_dict(stop, options):
    """A checkpoint where a window starts (after step 3: the anchors are the parameters
    then) and mid-window (after step 6: the anchors of step 4): the restored run goes on bit
    for bit as the one that was not interrupted, across the window's sync (with int8 syncs,
    their residuals too). Rank 0's state is loaded before its parameters are attached,
    rank 1's after."""
    autos, comms, _, params = local_job(2, 1e6, **options)
    train_local(autos, comms, params, stop, [0.05, 0.05])
    states = [a.state_dict() for a in autos]
    kept = [[p.clone() for p in ps] for ps in params]
    straight = train_local(autos, comms, params, 8, [0.05, 0.05], start=stop)
    again, comms2, _, _ = local_job(2, 1e6, attach=False, **options)
    again[0].load_state_dict(states[0])
    again[0].attach(kept[0], comm=comms2[0])
    again[1].attach(kept[1], comm=comms2[1])
    again[1].load_state_dict(states[1])
    resumed = train_local(again, comms2, kept, 8, [0.05, 0.05], start=stop)
    for s_rank, r_rank in zip(straight, resumed):
        for (s_h, s_params), (r_h, r_params) in zip(s_rank, r_rank):
            assert s_h == r_h
            assert all(torch.equal(a, b) for a, b in zip(s_params, r_params))
    assert again[0].state_dict()["auto"]["phase"] == autos[0].state_dict()["auto"]["phase"]


class _Beside:
    """Each rank's compute per step: ``alone`` seconds, and ``extra`` more in a step that
    begins with a local SGD sync in flight (the contention of a sync behind)."""

    def __init__(self, autos, alone: float, extra: float):
        self.autos, self.alone, self.extra = autos, alone, extra

    def __getitem__(self, r: int) -> float:
        return self.alone + (self.extra if self.autos[r].in_flight() else 0.0)


def test_what_a_sync_behind_costs_its_steps_is_measured_and_weighed():
    """The slow sync of the test above, two steps behind at H = 8, but each step it runs
    beside takes 0.1 s more (its arithmetic and sockets on the steps' cores): the drift check
    after the first window measures 0.2 s a sync (the median step beside it less the median
    step alone, times the two steps behind; the compute is the steps' alone, 50 ms), a drift
    from the 0 the decision assumed, and decides again with it (the model's choice for those
    numbers: the sync no longer pays to run behind). The checks wait for steps with no sync
    in flight; a state taken with a check owed keeps it."""
    autos, comms, link = job(2, 1e6, local_sgd=8, local_overlap=2, **LOCAL)
    params = [[torch.zeros(s) for shapes in SHAPES.values() for s in shapes]
              for _ in range(2)]
    syncs = ThreadGroup(2)
    for r, (a, p) in enumerate(zip(autos, params)):
        a.attach(p, comm=LinkComm(syncs, r, Clock(), link))
    checked: list = [[], []]
    for r, a in enumerate(autos):
        check = a._check
        a._check = lambda comm, r=r, a=a, check=check: (
            checked[r].append((a._step, a.in_flight())), check(comm))[1]
    train_local(autos, comms, params, 24, _Beside(autos, 0.05, 0.1))
    first, d = autos[0].history[0], autos[0].decision
    assert (first.period, first.overlap, first.contention) == (8, 2, 0.0), first.summary()
    assert d.reason.startswith("drift: a sync behind adds 0 -> 200 ms"), d.summary()
    assert d.contention == pytest.approx(0.2, rel=1e-6) and d.compute == pytest.approx(0.05)
    assert "a sync behind adds 200 ms to the steps beside it" in d.summary()
    inputs = m.Inputs(tuple(autos[0]._options(autos[0]._agreed)), d.rate, d.latency, 0.05,
                      periods=m.periods_upto(8), local_steps=autos[0].local_steps, overlap=2,
                      contention=0.2, margin=autos[0].tolerance)
    assert (d.period, d.sync_option, d.overlap) == m.choose_period(inputs, m.decide(inputs))
    assert (d.period, d.overlap) != (8, 2)
    # Checks every 4 steps: at steps 4 and 8, then 12's waits for the first window's sync
    # (started after step 10, landing after step 12): at step 13, where it decided again.
    assert checked[0] == checked[1] and [s for s, _ in checked[0]][:3] == [4, 8, 13], checked
    assert not any(flying for _, flying in checked[0]) and d.step == 13


def test_contention_in_the_model():
    """The worked bucket at 25 Mbit/s (test_overlap_in_the_model): an int4 sync two steps
    behind at H = 4 is free in the model until it costs the steps beside it something; at
    0.1 s a sync at once is faster, as the module docstring's step says."""
    inputs = m.Inputs((WORKED,), 3.125e6, 1e-3, 0.2, periods=m.periods_upto(16), overlap=2)
    costly = dataclasses.replace(inputs, contention=0.1)
    assert m.period_step_time(costly, (), 4, "int4", 2) == pytest.approx(0.2 + 0.1 / 4)
    assert m.period_step_time(costly, (), 4, "int4", 0) == pytest.approx(
        m.period_step_time(inputs, (), 4, "int4", 0))  # at once: nothing runs beside
    assert m.choose_period(inputs, m.decide(inputs)) == (4, "int4", 2)
    assert m.choose_period(costly, m.decide(costly)) == (4, "int4", 0)
    with pytest.raises(ValueError, match="contention"):
        dataclasses.replace(inputs, contention=-0.1)


def _span(compute, beside=False, started=0, local=True):
    return {"compute": compute, "beside": beside, "started": started, "local": local}


def test_a_check_reads_the_steps_alone_and_what_a_sync_behind_adds_to_the_others():
    """``read_steps``: 16 steps of H = 4 with syncs two behind, as ``gradsync bench
    compress`` ran them at 25 Mbit/s (each window: the step that starts a sync, two with it
    in flight, one alone), compute 0.18 s alone, 0.06 s more beside a sync, and its
    evaluation falling in two of the four steps alone (2 s each: left out). Compute 0.18 s,
    each sync 3 x 0.06 = 0.18 s."""
    from gradsync.compress.auto_policy import read_steps

    window = []
    for w in range(4):
        window += [_span(0.24, beside=True), _span(0.24, beside=True),
                   _span(0.18 + (2.0 if w % 2 else 0.0)), _span(0.24, True, started=1)]
    compute, measured, contention = read_steps(window, agreed=0.2)
    assert compute == pytest.approx(0.18) and measured
    assert contention == pytest.approx(0.18)
    # Per-step exchanges (no local SGD): the median of the steps, the evaluation left out.
    steps = [_span(0.2, local=False)] * 6 + [_span(3.0, local=False)] * 2
    assert read_steps(steps, 0.5) == (pytest.approx(0.2), False, 0.0)
    # Fewer than two steps alone: nothing measured, and the steps beside syncs are not the
    # compute (the agreed one stays); without syncs, the window's median.
    few = [_span(0.24, beside=True), _span(0.24, True, started=1), _span(0.18)]
    assert read_steps(few, 0.2) == (0.2, False, 0.0)
    assert read_steps([_span(0.3, local=False)], 0.2) == (0.3, False, 0.0)
    assert read_steps([], 0.2) == (0.0, False, 0.0)
