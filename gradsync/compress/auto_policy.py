"""The policy half of ``compression="auto"``: how the ranks agree on a decision, re-decide
when the numbers move, check a change against the steps, and carry a bucket's error feedback
across a change of option.

``Policy`` is a base of ``auto.Auto``, which holds the compressor: its steps, what it measures
in them, the reductions and the state (``auto.py``, whose module docstring numbers the
stages: 1, 2 and 5 there, 3, 4 and 6 here). The state a policy reads and writes is Auto's,
declared below.

3. Agreement: at the first call of the next step, every rank's numbers are averaged (one
   allreduce: the same bytes on every rank), then rank 0's decision is sent to all (a second
   allreduce, every other rank adding zeros): every rank uses rank 0's choice, even where a
   rank's own arithmetic would have rounded differently. After the probe step (``auto.py``,
   2) the rate is the probe's (at least what the warm quantizer's exchanges carried in their
   time, or its sync where the warm-up was a local SGD window), compute the step's span less the wait the front door reported (``auto.py``,
   ``_close_step``), and the hidden part at most what the warm quantizer's exchange hid; decided there only where the
   float32 exchange so predicted blocks more than ``early`` of the step, and then a change
   from the warm quantizer is a trial against the probe step (6).
4. Drift: every ``check_every`` steps the same two allreduces carry the window's numbers;
   the link's rate is measured again, and the step's compute. Beyond ``drift`` (a fraction)
   from what the decision used, the same way at two readings in a row, rank 0 decides again
   (a single slow probe, a loss episode on a slow link, is not a slower link: read as one,
   it switched a 25 Mbit/s run from int4 to PowerSGD and back, each switch costing
   steps; under local SGD a check without a sync has no new rate, and the first reading
   waits for the next sync's). Under local SGD with syncs behind the steps
   (``local_overlap``), the check also reads what a sync behind costs the steps it runs
   beside (``read_steps``: what they took beyond the median step alone, per sync; the
   compute read is the steps' alone): first measured, or moved by more than
   ``drift`` of a step's compute, it is a drift too, and the model weighs every H with it
   (``auto_model``, ``contention``). A re-decision keeps the options in force where their
   predicted time to the target comes within ``tolerance`` of the new choice's: a change
   starts error feedback (and PowerSGD's warm start) afresh and costs steps (at 25 Mbit/s
   the bench's language model went from PowerSGD to int4 at step 32, a near tie, and
   needed 112 steps, where int4 alone needed 88 and PowerSGD 152 in about the same time).
   A change of a bucket's option (a decision, an undo) sends what the old option still
   owes (each rank's residual, laid out as the bucket: PowerSGD's over its matrices; a
   quantizer's owners' too) with the new option's first exchange, as after the warm-up
   (``auto.py``, 2): nothing of the gradients is lost. Where every bucket is none, the rate
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
   exchange moved for another reason, and its time is the new measure). Under local SGD
   the syncs stand for the exchange: in float32 their time gives the rate; through a
   quantizer they are probed as a compressed exchange is, where a sync moved from its
   measure, and at the first check after the calibration's decision (whose sync becomes
   the measure), whose rate one reading gave: a link that changed since that reading (or a
   reading taken wrong) is found there, not never (the first sync alone would be measured
   on the changed link). A re-decision's rate was confirmed by two readings, or kept: its
   first sync is the measure without a probe (a probe of 1 MiB in float32 outweighs an
   int4 sync of 5 MB of parameters: 0.5-0.85 s at 25 Mbit/s, where a probe after every
   re-decision cost ``gradsync bench compress`` 1.5 s a run). Never while a sync runs behind
   the steps (``local_overlap``): it shares the link, and the probe would read it slower
   (the suspicion waits for the next check).
6. Outcome: a decision that changes a bucket's option is a trial. ``TRIAL`` steps after it
   (or at the next check, if sooner: a check that comes then, drift and all), the
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

Reports. A changed decision is logged at INFO once (rank 0; ``Decision.summary``: per tier
and bucket class, and the numbers behind it) and marked on the timeline (``AUTO`` on the
``compression`` row, every rank, when the Horovod API's timeline records). ``auto.decision``
is the current one, ``latest()`` the newest of any Auto in the process.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import auto_model as model
from .powersgd import PowerSGD

if TYPE_CHECKING:
    from .auto_local import LocalSGD

__all__ = ["Policy", "PROBE_BYTES", "HISTORY", "OUTLIER", "read_steps"]

log = logging.getLogger("gradsync")

HISTORY = 32
"""Decisions ``Auto.history`` keeps."""

OUTLIER = 3.0
"""A step's span longer than this many times its window's median is left out of the
compute and the contention a drift check reads (an evaluation, a checkpoint between steps:
in ``gradsync bench compress`` the evaluation's span fell among the few steps with no sync
behind them, and read the compute as 1852 ms for 219)."""

_TINY = 1e-6  # seconds: a floor for measured wire times (a division by them follows)


def read_steps(window: list[dict], agreed: float) -> tuple[float, bool, float]:
    """What a drift check reads of its window's steps (module docstring, 4): (the compute,
    whether a sync behind was measured, the seconds it added to the steps beside it in all:
    ``auto_model``'s ``contention``). ``agreed``: the compute the decision used.

    A step is a span from its first call to the next step's (``auto.py``). The spans in
    which a local SGD sync behind started, or that began with one in flight, are beside it:
    its share of the cores falls on them as the steps' work does. A span over ``OUTLIER``
    times the window's median is not a step's work (an evaluation, a checkpoint): left out.
    The compute is the median span alone; the median span alone is also what each span
    beside a sync would have taken, and what they took beyond it, summed, is divided among
    the syncs that started (the check runs with no sync in flight, ``auto.py``: a window
    holds whole syncs). With fewer than two spans alone, nothing is measured and the compute
    is the window's median, or, where syncs ran beside it, ``agreed`` (their spans are not
    the compute)."""
    if not window:
        return 0.0, False, 0.0
    usual = statistics.median(s["compute"] for s in window)
    kept = [s for s in window if s["compute"] <= OUTLIER * usual]
    alone = [s["compute"] for s in kept if not s.get("beside")]
    beside = [s["compute"] for s in kept if s["local"] and s.get("beside")]
    if len(alone) < 2:
        return (agreed if beside else usual), False, 0.0
    compute = statistics.median(alone)
    syncs = sum(s.get("started", 0) for s in window)
    if not beside or syncs < 1:
        return compute, False, 0.0
    return compute, True, max(0.0, sum(b - compute for b in beside)) / syncs

PROBE_BYTES = 1 << 20
"""Bytes of the float32 allreduce a drift check times where a bucket is compressed (module
docstring, 4): large enough that the wire, not the latency, is most of its time on the links
auto weighs (8 ms at 1 Gbit/s, 0.3-0.5 s at 25 Mbit/s, at the checks that need it)."""

TRIAL = 4
"""Steps after a change on trial at which its outcome is checked, where the next drift check
is later (module docstring, 6)."""

ORDER = itertools.count(1)
"""Numbers every decision made in this process, newest highest (``auto.latest``)."""


class Policy:
    """Agreement, drift checks, trials and the change of options of ``Auto`` (module
    docstring); not used alone."""

    # Auto's settings (auto.Auto.__init__).
    inner: dict[str, Any]  # the candidate compressors by name, most faithful first
    names: tuple[str, ...]  # "none", then the candidates: a bucket's choice indexes it
    warm: str  # the warm-up's option (a name in names)
    tiers: str
    margin: float
    tolerance: float
    drift: float
    early: float
    periods: tuple[int, ...]  # local SGD's candidate H (empty: not allowed)
    local_steps: float
    local_overlap: int  # the most steps a local SGD sync may run behind
    powersgd_steps: float
    clock: Callable[[], float]
    # Auto's state (auto.Auto._reset, _new_step_state): the steps and what they measured.
    _step: int
    _calib_from: int
    _probe_at: int | None  # the probe step, while it is ahead or being agreed
    _shapes: dict[str, list[tuple]]
    _last_keys: list[str]
    _window: list[dict]
    _latency: list[float]
    _probes: list[tuple[float, int]]
    _kappa: dict[str, list[float]]
    _syncs: list[float]
    _local: LocalSGD | None
    period: int
    phase: int
    # The policy's own: the decision in force and what follows it.
    _choice: dict[str, int]  # bucket -> index in names (absent: none)
    _agreed: dict | None  # the numbers of the last decision
    _target: int  # the agreed H, in force from the next window
    _target_sync: int  # the agreed sync option (index in names), with it
    _target_overlap: int  # and the steps each sync runs behind (0: at once)
    _sync: int  # the sync option of the window in force
    _trial: dict | None  # a change on trial (module docstring, 6)
    _refused: dict[tuple, float]  # options undone -> the rate they were tried at
    _suspect: tuple[int, int] | None  # the drift the last check saw
    _baseline: float | None  # the compressed exchange after the decision
    _resized: str | None
    _warned: bool
    _owed: dict[str, dict]  # an old option's residuals, for the bucket's next exchange
    decision: model.Decision | None
    history: list[model.Decision]

    # ------------------------------------------------------------------ the placement
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

    # ------------------------------------------------------------------ agreement
    def _agree(self, comm, reason: str, early: bool = False) -> None:
        """The calibration's numbers, averaged; rank 0's decision, taken by every rank.
        ``early`` (after the first calibrated step): decided only where that step spent
        more than ``self.early`` of its time in the float32 exchange, or, after the probe
        step, would have by the probe's rate (auto.py, 2); else calibration goes on."""
        keys = self._keys()
        w = self._window
        per = 1 + len(self.inner)
        local = [1.0 if w else 0.0]
        if w:
            local += [statistics.median(self._latency) if self._latency else 0.0,
                      statistics.median(s["period"] for s in w),
                      statistics.median(s["exchange"] for s in w),
                      statistics.median(s["blocked"] for s in w),
                      statistics.median(s["compute"] for s in w)]
            for k in keys:
                local.append(statistics.median(s["times"].get(k, 0.0) for s in w))
                local.extend(self._kappa.get(k, [0.0] * len(self.inner)))
        else:  # nothing timed here (a state loaded mid-calibration): the same length
            local += [0.0] * (5 + per * len(keys))
        # The warm-up as a local SGD window (auto.py, 2): its sync, through the warm
        # quantizer, carried the buckets' elements instead of their exchanges.
        local.append(1.0 if w and all(s["local"] for s in w) else 0.0)
        local.append(1.0 if self._syncs else 0.0)
        local.append(sum(self._syncs))
        local.append(1.0 if self._local is not None else 0.0)
        local.append(1.0 if self._probes else 0.0)
        local.append(statistics.median(p[0] for p in self._probes) if self._probes else 0.0)
        agreed = self._average(comm, local)
        warm_local, synced, sync_s = agreed[-6] >= 1.0, agreed[-5] >= 1.0, agreed[-4]
        probed, self._probe_at = self._probe_at is not None, None
        if probed and (agreed[0] < 1.0 or agreed[-2] < 1.0):  # not measured everywhere
            self._float32_calibration()
            return
        if early and not probed and (agreed[0] < 1.0 or self.early >= 1
                                     or not agreed[3] > self.early * agreed[2]):
            return  # calibration goes on (the same averages: the same on every rank)
        if agreed[0] < 1.0:  # some rank timed nothing: every rank calibrates again
            self._recalibrate("not every rank had timed the calibration")
            return
        latency, period, exchange, blocked, compute = agreed[1:6]
        times = {k: agreed[6 + i * per] for i, k in enumerate(keys)}
        kappa = {k: agreed[7 + i * per:6 + (i + 1) * per] for i, k in enumerate(keys)}
        units, k_local, tier, topo = self._placement(comm)
        local_s = {k: self._local_seconds(topo, 4 * self._numel(k)) for k in keys}
        compute, hidden = max(compute, 0.0), max(exchange - blocked, 0.0)
        if probed:
            # The buckets went through the warm quantizer: the probe gives the rate, and
            # the float32 exchange they would have had is predicted from it; decided here
            # only where that would have blocked the step for more than ``early`` of it
            # (auto.py, 2).
            nbytes = self._probes[0][1]  # every rank probed (agreed[-2]), the same size
            rate = nbytes / max(agreed[-1] - latency - self._local_seconds(topo, nbytes),
                                _TINY)
            # The warm quantizer's exchanges carried their bytes in their whole time (its
            # arithmetic and waits included): the link is at least that fast, whatever the
            # probe met (in gradsync bench compress at 25 Mbit/s a first probe once read
            # 8.2 Mbit/s of gradient, the drift checks' 16.2).
            warm = self.names.index(self.warm)
            options = self._options({"keys": keys, "kappa": kappa, "local": local_s,
                                     "units": units, "per_unit": k_local})
            sent = sum(b.options[warm].ratio * b.nbytes for b in options)
            # Where the warm-up was a local window, its sync carried them (every bucket's
            # elements, at once), where timed (a Comm's: not the Horovod API's).
            if not warm_local:
                rate = max(rate, sent / max(sum(times.values()), _TINY))
            elif synced:
                rate = max(rate, sent / max(sync_s, _TINY))
            float32 = sum(latency + local_s[k] + 4 * self._numel(k) / rate for k in keys)
            hidden = min(hidden, float32)
            if not float32 - hidden > self.early * (compute + float32 - hidden):
                self._float32_calibration()
                return
        else:
            busy = sum(max(times[k] - latency - local_s[k], _TINY) for k in keys)
            rate = sum(4 * self._numel(k) for k in keys) / busy
        numbers = {"keys": keys, "rate": rate, "latency": latency, "compute": compute,
                   "hidden": hidden, "kappa": kappa, "local": local_s,
                   "units": units, "per_unit": k_local, "tier": tier,
                   "attached": agreed[-3]}
        # After the probe step, the step measured went through the warm quantizer: a change
        # from it is a trial against it (module docstring, 6).
        under = (self.names.index(self.warm),) * len(keys) if probed else None
        # A local probe step exchanged nothing: its compute plus the warm sync's seconds
        # stand for such a step (none hidden), where the sync was timed; else no trial.
        before = (period + sync_s if synced else None) if probed and warm_local else period
        self._decide(comm, numbers, reason, before=before, under=under)

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
        # Under local SGD the syncs stand for the exchange; through a quantizer, their time
        # reads the link no better than a compressed exchange's (the arithmetic the model
        # takes off, timed in the warm-up beside the other ranks', is not what it costs in
        # a sync: a 100 Mbit/s link read as 101-148 Mbit/s of gradient, in gradsync bench
        # compress), so they are probed as it is: where a sync moved from its measure, and at
        # the first check after the calibration's decision, whose rate one reading gave (a
        # re-decision's rate was confirmed by two readings, or kept: its first sync is the
        # measure without a probe, which cost 0.5-0.85 s a re-decision at 25 Mbit/s).
        quantized_sync = not ex and bool(self._syncs) and self._sync != 0
        behind = self._local is not None and self._local.in_flight()  # the same everywhere
        unconfirmed = not a.get("confirmed", False)  # no probe since the calibration's
        wants = not behind and (
            (compressed and bool(ex) and (self._baseline is None or suspect_rate))
            or (quantized_sync and (suspect_rate or (self._baseline is None and unconfirmed))))
        probe = self._probe(comm, a) if wants else 0.0
        if probe > 0.0:
            a["confirmed"] = True  # (kept by the numbers of the decisions that follow)
        work_s, beside, contention = read_steps(w, a["compute"])
        local = [1.0 if w else 0.0, work_s,
                 statistics.median(s["exchange"] for s in ex) if ex else 0.0,
                 statistics.median(s["blocked"] for s in ex) if ex else 0.0]
        local += [statistics.median(s["times"].get(k, 0.0) for s in ex) if ex else 0.0
                  for k in keys]
        local += [1.0 if ex else 0.0, 1.0 if self._local is not None else 0.0,
                  statistics.median(self._syncs) if self._syncs else 0.0,
                  1.0 if self._syncs else 0.0, probe,
                  statistics.median(s["period"] for s in ex) if ex else 0.0,
                  1.0 if beside else 0.0, contention]
        agreed = self._average(comm, local)
        work, exchange, blocked = agreed[1:4]
        times = dict(zip(keys, agreed[4:4 + len(keys)]))
        (exchanged, attached, sync, synced, probe_s, step_s, beside_everywhere,
         contention) = agreed[4 + len(keys):]
        trial, self._trial = self._trial, None
        if (trial is not None and agreed[0] >= 1.0 and exchanged >= 1.0
                and step_s * trial.get("steps_new", 1.0)
                > trial["before"] * trial.get("steps_old", 1.0) * (1 + self.tolerance)):
            self._undo(comm, trial, step_s)  # (the same averages, so the same on every rank)
            return
        rate, hidden = a["rate"], a["hidden"]
        # This window's exchange: the buckets' where steps exchanged, else local SGD's syncs.
        if exchanged >= 1.0:
            measured, quantized = exchange, compressed
        elif synced >= 1.0:
            measured, quantized = sync, quantized_sync
        else:
            measured, quantized = None, False
        # A compressed exchange that moved from what it took after the decision: the
        # link's rate is suspect (the probe confirms or clears it at the next check).
        hint = 0
        if measured is not None and quantized and probe_s == 0.0 and self._baseline is not None:
            hint = -_direction(measured / max(self._baseline, _TINY) - 1, self.drift)
        if measured is not None and quantized and self._baseline is None:
            self._baseline = measured
        if measured is not None and probe_s > 0.0:  # the link itself (module docstring, 4)
            nbytes = self._probe_bytes(keys)
            _, _, _, topo = self._placement(comm)
            busy = probe_s - a["latency"] - self._local_seconds(topo, nbytes)
            rate = nbytes / max(busy, _TINY)
            if exchanged >= 1.0:
                hidden = max(exchange - blocked, 0.0)
        elif exchanged >= 1.0:  # every bucket none: their own float32 exchanges
            busy = sum(max(times[k] - a["latency"] - a["local"][k], _TINY) for k in keys)
            rate = sum(4 * self._numel(k) for k in keys) / busy
            hidden = max(exchange - blocked, 0.0)
        elif synced >= 1.0:  # one float32 allreduce of every parameter (auto_local.py)
            busy = sync - a["latency"] - sum(a["local"][k] for k in keys)
            rate = sum(4 * self._numel(k) for k in keys) / max(busy, _TINY)
        compute = max(work, 0.0)
        moved = []
        rate_moved = compute_moved = contention_moved = False
        if agreed[0] < 1.0:
            self._suspect = None  # some rank timed nothing: no drift to judge this time
        else:
            # A drift counts where the reading before saw it too, the same way (module
            # docstring, 4): one slow probe (a loss episode) is not a slower link. Under
            # local SGD a check without a sync has no new rate: the suspicion waits.
            fresh = measured is not None and (probe_s > 0.0 or not quantized)
            was = self._suspect or (0, 0)
            if fresh:
                rate_dir = _direction(rate / a["rate"] - 1, self.drift)
            elif measured is not None:  # compressed, no probe: the exchange's hint
                rate_dir = hint
            else:  # local SGD without a sync: the suspicion waits for one
                rate_dir = was[0]
            compute_dir = _direction((compute - a["compute"]) / max(a["compute"], 1e-3),
                                     self.drift)
            self._suspect = (rate_dir, compute_dir)
            if probe_s > 0.0 and not rate_dir and measured is not None:  # the link as it
                self._baseline = measured  # was: the exchange moved otherwise, its new measure
            rate_moved = bool(fresh and rate_dir and was[0] == rate_dir)
            compute_moved = bool(compute_dir and was[1] == compute_dir)
            if rate_moved:
                moved.append(f"rate {a['rate'] * 8 / 1e6:.4g} -> {rate * 8 / 1e6:.4g} Mbit/s")
            if compute_moved:
                moved.append(f"compute {a['compute'] * 1e3:.4g} -> {compute * 1e3:.4g} ms")
            if self.periods and attached >= 1.0 and a.get("attached", 0.0) < 1.0:
                moved.append("local SGD attached")
            was = a.get("contention", 0.0)
            contention_moved = bool(beside_everywhere >= 1.0 and abs(contention - was)
                                    > self.drift * max(a["compute"], _TINY))
            if contention_moved:
                moved.append(f"a sync behind adds {was * 1e3:.4g} -> {contention * 1e3:.4g} "
                             f"ms to its steps")
            if moved:
                self._suspect = None
        # Every rank runs the second allreduce, drifted or not: the agreement is rank 0's.
        # Only confirmed readings move the numbers: a rate read once waits for the next (a
        # compute drift once took a reading of 297 Mbit/s of a 100 Mbit/s link with it, in
        # gradsync bench compress).
        numbers = dict(a, rate=rate if rate_moved else a["rate"],
                       compute=compute if compute_moved else a["compute"],
                       hidden=hidden if rate_moved else a["hidden"], attached=attached,
                       contention=contention if contention_moved else a.get("contention", 0.0))
        self._decide(comm, numbers if moved else a, "drift: " + ", ".join(moved),
                     quiet=not moved, before=step_s if exchanged >= 1.0 else None)

    def _trial_due(self) -> bool:
        """A change on trial has had ``TRIAL`` steps (module docstring, 6): its outcome is
        checked now, not at the next drift check (the same on every rank: the trial is)."""
        return self._trial is not None and self._step >= self._trial.get("at", 0) + TRIAL

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
                before: float | None = None, forced: tuple | None = None,
                under: tuple | None = None) -> None:
        """Rank 0's choice for ``numbers``, taken by every rank. ``quiet``: the choice in
        force (a check that found no drift); ``forced``: these options (an undone trial);
        ``before``: the median step of the window the numbers came from, which makes a
        change a trial (module docstring, 6), from the options in force or ``under``, those
        that window's steps ran."""
        buckets = self._options(numbers)
        current = tuple(self._choice.get(k, 0) for k in numbers["keys"])
        measured = current if under is None else under
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
                              periods=periods, local_steps=self.local_steps,
                              overlap=self.local_overlap,
                              contention=numbers.get("contention", 0.0))
        if quiet:
            mine = (*current, self._target, self._target_sync, self._target_overlap)
        elif forced is not None:
            mine = (*forced, self._target, self._target_sync, self._target_overlap)
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
            h, through, behind = model.choose_period(
                dataclasses.replace(inputs, margin=self.tolerance), per_step)
            mine = (*per_step, h, self.names.index(through), behind)
        # Rank 0's choice (then H and the sync option) everywhere: the others add zeros.
        codes = torch.tensor(mine if comm.rank == 0 else [0] * len(mine), dtype=torch.float32)
        comm.allreduce_sum_(codes)
        *codes_of_buckets, period, sync, overlap = (int(round(v)) for v in codes.tolist())
        choice = tuple(codes_of_buckets)
        self._agreed = numbers
        self._window, self._latency, self._kappa, self._syncs = [], [], {}, []
        self._probes = []
        changed = (period, sync, overlap) != (
            self._target, self._target_sync, self._target_overlap) or any(
            self._choice.get(k, 0) != c for k, c in zip(numbers["keys"], choice))
        if (changed and before is not None and period == 1 and self._target == 1
                and choice != measured):
            self._trial = {"before": before, "old": list(measured), "new": list(choice),
                           "numbers": numbers, "at": self._step,
                           "steps_old": model.steps_factor(inputs, measured),
                           "steps_new": model.steps_factor(inputs, choice)}
        self._target, self._target_sync, self._target_overlap = period, sync, overlap
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
            tier=numbers["tier"], made=next(ORDER),
            choices={k: self.names[c] for k, c in zip(numbers["keys"], choice)},
            sizes={b.key: b.nbytes for b in buckets}, rate=inputs.rate,
            latency=inputs.latency, compute=inputs.compute, hidden=inputs.hidden,
            predicted=model.period_step_time(inputs, choice, period, self.names[sync],
                                             overlap),
            uncompressed=model.step_time(inputs, [0] * len(choice)), period=period,
            sync=model.sync_time(inputs, self.names[sync]) if period > 1 else 0.0,
            sync_option=self.names[sync] if period > 1 else "none",
            overlap=overlap if period > 1 else 0, contention=inputs.contention)
        if not changed and self.decision is not None and reason.startswith("drift"):
            self.decision = decision  # the same choice on new numbers: nothing to report
            return
        self._announce(comm, decision)

    # ------------------------------------------------------------------ a change of option
    def _forget(self, key: str) -> None:
        """Drops the state of ``key`` in every inner compressor: a bucket that changes option
        starts its error feedback afresh (what the old one owed goes with its next exchange:
        ``_owe``), PowerSGD its Q."""
        for c in self.inner.values():
            for k in [k for k in c.state.tensors if k == key or k.startswith(key + "@")]:
                del c.state.tensors[k]

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
        for part, value in owed.items():  # held tensors are never changed in place (state.py)
            held[part] = held[part] + value if part in held else value

    def _float32_calibration(self) -> None:
        """After the probe step, where the link is not slow enough to decide on its probe:
        ``calibrate`` float32 steps follow from this one, measured afresh (the arithmetic's
        times and the latency samples kept; what the warm quantizer still owed goes with
        their first exchanges: auto.py's step boundary)."""
        self._calib_from = self._step
        self._window, self._probes = [], []

    def _recalibrate(self, why: str) -> None:
        log.info("compression auto (step %d): %s; uncompressed until measured again",
                 self._step, why)
        self._choice, self._agreed, self._resized = {}, None, why
        self._target, self._target_sync, self._target_overlap = 1, 0, 0
        self._trial, self._refused, self._suspect = None, {}, None
        self._baseline = None
        # Mid-window, calibration starts after the window's sync (the ranks equal again).
        self._calib_from = self._step + (self.period - self.phase if self.period > 1 else 0)
        self._probe_at = None  # no warm-up before it: calibrated in float32 (auto.py, 2)
        self._window, self._latency, self._kappa, self._probes = [], [], {}, []
        self._syncs = []

    # ------------------------------------------------------------------ reports
    def _off_decision(self, comm, reason: str) -> model.Decision:
        return model.Decision(step=self._step, reason=reason, ranks=comm.size, hosts=1,
                              tier="local", made=next(ORDER))

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


def _direction(change: float, drift: float) -> int:
    """+1 or -1 where a relative ``change`` is beyond ``drift``, else 0."""
    return 0 if abs(change) <= drift else (1 if change > 0 else -1)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
