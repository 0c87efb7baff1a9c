"""What a chaos soak's logs say: per fault its cost, over the run its goodput and samples.

``gradsync bench chaos`` (``chaos.py``) breaks an elastic job and keeps every line its
workers write (``chaos_rank.py`` documents them). This module turns those lines and the list
of faults into the report, without running anything, so the rules below are tested on
hand-written logs (tests/test_bench_chaos.py).

**Generations.** Every step line names its generation ``g``. A fault hits the generation that
was stepping when it was injected (``g0``). If some worker of ``g0`` then raised a lost peer
or a timeout (anything but ``HostsUpdatedInterrupt``: new hosts are not a fault) before the
next fault, the fault was *detected*, and the next generation with steps (``g1``) is the job
re-formed. Its *survivors* are the workers in both. Per detected fault:

- **detection**: from the fault to the last survivor's raise (every survivor knows);
- **recovery**: from that raise to the last member of ``g1`` completing its first step in
  ``g1`` (the re-formed job's first step; a joiner that arrives then is part of it);
- **steps lost**: the highest step that every rank of ``g0`` completed, minus the step
  ``g1`` resumed from;
- **params**: every step of ``g1`` has one parameter digest across its ranks.

A fault that no worker raised for was *absorbed* (a straggler, a partition shorter than the
heartbeat timeout): its cost is the longest gap between two of rank 0's steps while it
lasted (and 5 s after), beside the median gap in the 30 s before it.

**Lineage and samples.** A roll-back rewinds the step count, so a step number may be run more
than once; the run that counts is the one of the newest generation (each later generation
resumes from an earlier generation's commit and runs every step after it). These steps are
the *lineage*: the training that the final parameters come from. ``SAMPLE_RULE`` is the rule
their samples must follow; ``samples`` checks it per epoch.

**The verdict.** ``verdict`` turns the report into the soak's exit status: a list of what
failed, empty when the soak passed. It fails on a hang, a parameter mismatch, a broken sample
rule; on a fault that could not be injected (its target was gone: that fault proved nothing);
on a detected fault slower than its bounds (``Bounds``: detection 3 s, recovery 1 s by
default); on a kill that nobody noticed; on an absorbed fault that stalled the job longer than
detection and recovery together would have taken; on goodput below its bound of the
fault-free run's; and on every check that could not be made (a fault kind skipped, a fault
whose survivors logged no raise, a re-formed job of one rank whose parameters cannot differ
from anyone's, a missing fault-free goodput). A check that was not made is a failure, not a
pass. A server job's report (``chaos_server_report.py``) has the same shape, with rows for
server faults and ``checks`` made at the end (acknowledged updates lost, copies agree,
parameters against the fault-free run, samples exactly once), each of which fails the
verdict when it failed or was not made.

**A step some ranks logged and the others only began.** Each rank logs what it takes before
the exchange (a ``CHAOS take`` line) and the step after its update. A rank completes a step
only after the step's exchange, which needs every rank's gradient, so when some ranks of a
generation logged step ``s`` and each of the others logged only its take of ``s`` (it was
lost between the exchange and its line), the job completed ``s``, with the others' samples:
``complete_steps`` and ``lineage`` count it whole. A rank with neither line for ``s`` leaves
the step incomplete, as before.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = ["Step", "Raised", "Fault", "Log", "Bounds", "parse", "outcome", "mismatches",
           "lineage", "samples", "complete_steps", "rejoins", "worst", "goodput", "report",
           "verdict", "format_text", "format_markdown", "SAMPLE_RULE"]

SAMPLE_RULE = ("in the lineage (the steps the final parameters come from) every epoch uses "
               "each sample once; the last step of an epoch may pad with up to size-1 samples "
               "from the front of the epoch's permutation (ElasticSampler, as "
               "DistributedSampler pads); steps undone by a roll-back are run again, so their "
               "samples are used again by the redo, and no others")

_PREFIX = re.compile(r"^\[(\d+)\]<std(?:out|err)>:")
_FIELDS = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class Step:
    """One rank's completed step (a ``CHAOS step`` line); ``worker`` is its pid."""

    worker: str
    g: int
    r: int
    n: int
    s: int
    e: int
    wall: float
    h: str
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Raised:
    """A worker's step loop saw an exception (a ``CHAOS raised`` line)."""

    worker: str
    g: int
    wall: float
    what: str


@dataclass
class Fault:
    """One injected fault: its kind, its target, when (``time.time()``) it began and ended."""

    kind: str
    target: str
    wall: float
    until: float
    note: str = ""
    injected: bool = True
    """False when its target was gone before the fault reached it (a signal to a pid that had
    already exited): such a fault tested nothing, and the verdict says so."""


@dataclass(frozen=True)
class Bounds:
    """What a soak must stay within (``gradsync bench chaos``'s ``--max-*``/``--min-*``)."""

    detection_s: float = 3.0
    """From a fault to the last survivor's exception."""
    recovery_s: float = 1.0
    """From that exception to the re-formed job's first step on every member."""
    goodput: float = 0.9
    """The soak's goodput as a share of the fault-free run's."""

    def __post_init__(self):
        if self.detection_s <= 0 or self.recovery_s <= 0 or not 0 <= self.goodput <= 1:
            raise ValueError(f"bounds need detection and recovery > 0 and goodput in [0, 1]: "
                             f"{self}")


@dataclass
class Log:
    """Everything the workers wrote that the report needs."""

    steps: list[Step] = field(default_factory=list)
    raised: list[Raised] = field(default_factory=list)
    hellos: dict[str, str] = field(default_factory=dict)
    """worker (its pid) -> its emulated host."""
    takes: dict[tuple[int, int, int], Step] = field(default_factory=dict)
    """(generation, step, rank) -> what that rank took for the step, before its exchange (a
    ``Step`` whose ``wall`` and ``h`` are unknown: nan and "")."""

    def add(self, line: str) -> None:
        """Takes one line of the launcher's output; lines that are not a worker's ``CHAOS``
        line are ignored."""
        match = _PREFIX.match(line)
        body = line[match.end():] if match else ""
        if not body.startswith("CHAOS "):
            return
        kind = body.split()[1]
        values = dict(_FIELDS.findall(body))
        worker = values["p"]  # the launcher's prefix is a first rank, which joiners reuse
        if kind == "step":
            self.steps.append(Step(worker, int(values["g"]), int(values["r"]), int(values["n"]),
                                   int(values["s"]), int(values["e"]), float(values["wall"]),
                                   values["h"], tuple(int(i) for i in values["i"].split(",")
                                                      if i)))
        elif kind == "take":
            take = Step(worker, int(values["g"]), int(values["r"]), int(values["n"]),
                        int(values["s"]), int(values["e"]), float("nan"), "",
                        tuple(int(i) for i in values["i"].split(",") if i))
            self.takes[take.g, take.s, take.r] = take
        elif kind == "raised":
            self.raised.append(Raised(worker, int(values["g"]), float(values["wall"]),
                                      values["what"]))
        elif kind == "hello":
            self.hellos[worker] = values["host"]


def parse(lines: Iterable[str]) -> Log:
    """A ``Log`` of the launcher's output lines."""
    log = Log()
    for line in lines:
        log.add(line)
    return log


def _gaps(walls: Sequence[float]) -> list[float]:
    ordered = sorted(set(walls))
    return [b - a for a, b in zip(ordered, ordered[1:])]


def outcome(fault: Fault, log: Log, window_end: float) -> dict:
    """The cost of ``fault`` (see the module docstring); ``window_end``: when the next fault
    began (or the run ended)."""
    row = {"fault": fault.kind, "target": fault.target, "note": fault.note,
           "detected": False, "detection_s": None, "recovery_s": None, "steps_lost": None,
           "params_identical": None, "stall_s": None, "steady_gap_s": None,
           "injected": fault.injected}
    before = [st for st in log.steps if st.wall < fault.wall]
    if not before:
        return row
    g0 = max(st.g for st in before)
    raises = [x for x in log.raised if x.g == g0 and fault.wall <= x.wall < window_end
              and x.what != "HostsUpdatedInterrupt"]
    steady = _gaps([st.wall for st in before if st.wall >= fault.wall - 30 and st.r == 0])
    row["steady_gap_s"] = statistics.median(steady) if steady else None
    if not raises:
        during = _gaps([st.wall for st in log.steps if st.r == 0
                        and fault.wall - 1 <= st.wall <= min(window_end, fault.until + 5)])
        row["stall_s"] = max(during) if during else None
        return row
    later = sorted({st.g for st in log.steps if st.g > g0})
    if not later:
        row["note"] = (row["note"] + "; " if row["note"] else "") + "no step after it"
        return row
    g1 = later[0]
    old = {st.worker for st in log.steps if st.g == g0}
    new_steps = [st for st in log.steps if st.g == g1]
    members = {st.worker for st in new_steps}
    survivors = old & members
    first_raise = {}
    for x in sorted(raises, key=lambda x: x.wall):
        first_raise.setdefault(x.worker, x.wall)
    row["detected"] = True
    if survivors and survivors <= set(first_raise):
        known = max(first_raise[w] for w in survivors)
        first_step = {w: min(st.wall for st in new_steps if st.worker == w) for w in members}
        row["detection_s"] = known - fault.wall
        row["recovery_s"] = max(first_step.values()) - known
    else:
        row["note"] = (row["note"] + "; " if row["note"] else "") + \
            f"survivors {sorted(survivors - set(first_raise))} logged no raise"
    row["steps_lost"] = max(complete_steps(log, g0), default=0) - \
        (min(st.s for st in new_steps) - 1)
    # One rank has nobody to differ from: that check cannot fail, so it is not made (None).
    if len({st.r for st in new_steps}) > 1:
        row["params_identical"] = not any(g == g1 for g, _ in mismatches(log))
    return row


def rejoins(log: Log) -> list[dict]:
    """Each re-formation that new hosts caused (``HostsUpdatedInterrupt``, not a fault): the
    generation formed and its *pause*, from the first survivor's raise to the last member's
    first step in it (the survivors wait there while the joiners start)."""
    first_raise: dict[int, float] = {}
    for x in log.raised:
        if x.what == "HostsUpdatedInterrupt":
            first_raise[x.g] = min(x.wall, first_raise.get(x.g, x.wall))
    rows = []
    for g, wall in sorted(first_raise.items()):
        later = [st for st in log.steps if st.g > g]
        if later:
            g1 = min(st.g for st in later)
            first = defaultdict(lambda: float("inf"))
            for st in later:
                if st.g == g1:
                    first[st.worker] = min(first[st.worker], st.wall)
            rows.append({"generation": g1, "pause_s": max(first.values()) - wall})
    return rows


def _completed(log: Log, lines: Sequence[Step]) -> list[Step]:
    """``lines`` (one step of one generation, as logged) with the take of each rank that
    only began it added, if every missing rank has one (module docstring); else as given."""
    n, g, s = lines[0].n, lines[0].g, lines[0].s
    logged = {st.r for st in lines}
    takes = [log.takes.get((g, s, r)) for r in range(n) if r not in logged]
    return list(lines) + takes if all(takes) else list(lines)


def complete_steps(log: Log, g: int) -> set[int]:
    """The steps of generation ``g`` that every one of its ranks completed (a step some rank
    did not finish was not completed by the job; one it only began, after the exchange, was:
    module docstring)."""
    runs = defaultdict(list)
    for st in log.steps:
        if st.g == g:
            runs[st.s].append(st)
    return {s for s, lines in runs.items()
            if len({st.r for st in _completed(log, lines)}) == lines[0].n}


def mismatches(log: Log) -> list[tuple[int, int]]:
    """``(generation, step)`` of every step whose ranks logged different parameter digests."""
    digests = defaultdict(set)
    for st in log.steps:
        digests[st.g, st.s].add(st.h)
    return sorted(key for key, found in digests.items() if len(found) > 1)


def lineage(log: Log) -> dict[int, list[Step]]:
    """Step number -> the lines of its run in the newest generation that ran it."""
    runs = defaultdict(list)
    for st in log.steps:
        runs[st.s, st.g].append(st)
    newest: dict[int, int] = {}
    for s, g in runs:
        newest[s] = max(g, newest.get(s, g))
    return {s: _completed(log, runs[s, g]) for s, g in sorted(newest.items())}


def samples(log: Log, dataset: int) -> dict:
    """Checks ``SAMPLE_RULE`` on the lineage, per epoch.

    Returns:
        ``epochs`` (one row each: epoch, steps, samples used, distinct, missing (complete
        epochs only), repeats, allowed padding) and ``violations`` (rows that break the rule;
        an incomplete step, one that not every rank of its generation logged, is one too).
    """
    by_epoch = defaultdict(list)
    violations = []
    for s, lines in lineage(log).items():
        if len(lines) != lines[0].n or len({st.r for st in lines}) != lines[0].n:
            violations.append({"step": s, "generation": lines[0].g,
                               "why": f"{len(lines)} of {lines[0].n} ranks logged it"})
        by_epoch[lines[0].e].append(lines)
    rows = []
    last = max(by_epoch, default=-1)
    for epoch in sorted(by_epoch):
        used = [i for lines in by_epoch[epoch] for st in lines for i in st.rows]
        distinct = set(used)
        padding = by_epoch[epoch][-1][0].n - 1
        row = {"epoch": epoch, "steps": len(by_epoch[epoch]), "used": len(used),
               "distinct": len(distinct),
               "missing": dataset - len(distinct) if epoch < last else None,
               "repeats": len(used) - len(distinct), "allowed_padding": padding}
        rows.append(row)
        if row["repeats"] > padding or (row["missing"] or 0) > 0:
            violations.append({"epoch": epoch, "why": f"{row['missing'] or 0} samples missing, "
                                                      f"{row['repeats']} repeated (rule: "
                                                      f"at most {padding})"})
    return {"epochs": rows, "violations": violations}


def goodput(log: Log, start: float, end: float) -> float | None:
    """Samples per second of the lineage's steps completed between ``start`` and ``end``."""
    used = sum(len(st.rows) for lines in lineage(log).values() for st in lines
               if start <= lines[0].wall <= end)
    return used / (end - start) if end > start else None


def worst(rows: Sequence[dict]) -> dict[str, dict]:
    """Per fault kind, the worst (largest) detection, recovery, steps lost and stall of
    ``rows`` (``outcome``'s), and how many faults of that kind were detected; the issue's
    bounds are about the worst of a soak."""
    kinds: dict[str, dict] = {}
    for row in rows:
        entry = kinds.setdefault(row["fault"], {"faults": 0, "detected": 0})
        entry["faults"] += 1
        entry["detected"] += bool(row["detected"])
        for key in ("detection_s", "recovery_s", "steps_lost", "stall_s"):
            if row[key] is not None:
                entry[key] = max(row[key], entry.get(key, row[key]))
    return kinds


def report(faults: Sequence[Fault], log: Log, *, dataset: int, window: tuple[float, float],
           baseline: float | None, hangs: Sequence[dict], skipped: Sequence[str],
           bounds: Bounds = Bounds()) -> dict:
    """The whole report as plain data (what ``--json`` writes), its ``verdict`` included.

    Args:
        window: the soak's ``(start, end)`` (``time.time()``): goodput is measured in it.
        baseline: the fault-free run's goodput (samples/s), or None.
        hangs: one row per phase that passed its deadline.
        skipped: fault kinds left out, each with why.
        bounds: what the faults and the goodput must stay within.
    """
    ends = [f.wall for f in faults[1:]] + [window[1]]
    rows = [{"at_s": round(f.wall - window[0], 1), **outcome(f, log, end)}
            for f, end in zip(faults, ends)]
    rate = goodput(log, *window)
    data = {"faults": rows, "worst": worst(rows), "hangs": list(hangs),
            "skipped": list(skipped),
            "mismatches": [{"generation": g, "step": s} for g, s in mismatches(log)],
            "samples": samples(log, dataset), "sample_rule": SAMPLE_RULE,
            "rejoins": rejoins(log),
            "goodput": rate, "baseline_goodput": baseline,
            "goodput_ratio": rate / baseline if rate and baseline else None,
            "seconds": window[1] - window[0],
            "bounds": {"detection_s": bounds.detection_s, "recovery_s": bounds.recovery_s,
                       "goodput": bounds.goodput}}
    data["failures"] = verdict(data)
    return data


def verdict(data: dict) -> list[str]:
    """What failed in ``report``'s ``data`` against its ``bounds``, one line each; empty when
    the soak passed (the module docstring lists the rules)."""
    bounds = data["bounds"]
    failed = [f"hang: {h['phase']} passed its {h['deadline_s']:g} s deadline ({h['why']})"
              for h in data["hangs"]]
    failed += [f"parameter mismatch: generation {m['generation']} step {m['step']}"
               for m in data["mismatches"]]
    failed += [f"sample rule broken: {v}" for v in data["samples"]["violations"]]
    failed += [f"not run: {s}" for s in data["skipped"]]
    stall_bound = bounds["detection_s"] + bounds["recovery_s"]
    for row in data["faults"]:
        what = f"{row['fault']} at {row['at_s']:g} s ({row['target']})"
        if not row.get("injected", True):
            failed.append(f"{what}: not injected, its target was gone")
            continue
        if row.get("role", "worker") != "worker":  # a server's fault must lose no step
            if row["steps_lost"] is None:
                failed.append(f"{what}: steps lost not measured (no step around it)")
            elif row["steps_lost"] > 0:
                failed.append(f"{what}: {row['steps_lost']} steps lost")
        if not row["detected"]:
            if row["fault"] == "kill":
                failed.append(f"{what}: a killed {row.get('role', 'worker')} was never noticed")
            elif row["stall_s"] is None:
                failed.append(f"{what}: no step around it to measure its stall")
            elif row["stall_s"] > stall_bound:
                failed.append(f"{what}: absorbed, but stalled the job {row['stall_s']:.2f} s "
                              f"(bound {stall_bound:g} s: detection and recovery)")
            continue
        if row["detection_s"] is None or row["recovery_s"] is None:
            failed.append(f"{what}: detection and recovery not measured ({row['note']})")
        else:
            if row["detection_s"] > bounds["detection_s"]:
                failed.append(f"{what}: detection {row['detection_s']:.2f} s "
                              f"(bound {bounds['detection_s']:g} s)")
            if row["recovery_s"] > bounds["recovery_s"]:
                failed.append(f"{what}: recovery {row['recovery_s']:.2f} s "
                              f"(bound {bounds['recovery_s']:g} s)")
        if row.get("params_rule") == "none":
            continue  # a data server's fault: no parameters (its check is the samples')
        if row["params_identical"] is None:
            failed.append(f"{what}: " + row.get(
                "params_note", "parameters not compared (the re-formed job has one rank)"))
        elif not row["params_identical"]:
            failed.append(f"{what}: " + ("parameters differ across the re-formed job"
                                         if row.get("role", "worker") == "worker" else
                                         "parameters differ from the fault-free run's, or "
                                         "copies differ"))
    for check in data.get("checks", []):  # a server job's checks at the end of the run
        if check["ok"] is not True:
            failed.append(f"{check['check']}: " + ("not made: " if check["ok"] is None
                                                   else "") + check["detail"])
    ratio = data["goodput_ratio"]
    if ratio is None:
        failed.append("goodput not compared: no fault-free goodput or no step in the soak")
    elif ratio < bounds["goodput"]:
        failed.append(f"goodput {ratio:.0%} of the fault-free run (bound {bounds['goodput']:.0%})")
    return failed


_COLUMNS = [("at_s", "at s"), ("fault", "fault"), ("target", "target"),
            ("detection_s", "detection s"), ("recovery_s", "recovery s"),
            ("steps_lost", "steps lost"), ("params_identical", "params equal"),
            ("stall_s", "stall s"), ("steady_gap_s", "step s"), ("note", "note")]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 1 else f"{value:.2f}"
    return str(value)


def _summary(data: dict) -> list[str]:
    epochs = data["samples"]["epochs"]
    ratio = data["goodput_ratio"]
    lines = [f"hangs: {len(data['hangs'])}"
             + "".join(f"; {h['phase']} passed its {h['deadline_s']:g} s deadline"
                       for h in data["hangs"]),
             f"parameter mismatches: {len(data['mismatches'])}",
             f"goodput: {_cell(data['goodput'])} samples/s against "
             f"{_cell(data['baseline_goodput'])} fault-free" + (f" ({ratio:.0%})" if ratio else ""),
             f"samples: {len(epochs)} epochs, {sum(e['used'] for e in epochs)} used, "
             f"{len(data['samples']['violations'])} violations of the rule",
             f"sample rule: {data['sample_rule']}"]
    for kind, entry in data["worst"].items():
        lines.append(f"worst {kind} ({entry['detected']} of {entry['faults']} detected): "
                     + ", ".join(f"{key[:-2] if key.endswith('_s') else key} "
                                 f"{_cell(entry[key])}"
                                 for key in ("detection_s", "recovery_s", "steps_lost", "stall_s")
                                 if key in entry))
    pauses = [r["pause_s"] for r in data["rejoins"]]
    if pauses:
        lines.append(f"rejoins (a host back from its cooldown; not faults): {len(pauses)}, "
                     f"pause median {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s")
    lines += [f"rule broken: {v}" for v in data["samples"]["violations"]]
    lines += [f"skipped: {s}" for s in data["skipped"]]
    lines += [f"check: {c['check']}: {'-' if c['ok'] is None else 'yes' if c['ok'] else 'NO'} "
              f"({c['detail']})" for c in data.get("checks", [])]
    b = data["bounds"]
    lines.append(f"bounds: detection {b['detection_s']:g} s, recovery {b['recovery_s']:g} s, "
                 f"goodput {b['goodput']:.0%}")
    failures = data.get("failures", [])
    lines.append("verdict: " + ("passed" if not failures else f"FAILED ({len(failures)})"))
    lines += [f"failed: {f}" for f in failures]
    return lines


def format_text(data: dict) -> str:
    """The report as an aligned table and summary lines."""
    table = [[label for _, label in _COLUMNS]]
    table += [[_cell(row[key]) for key, _ in _COLUMNS] for row in data["faults"]]
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(out + _summary(data)) + "\n"


def format_markdown(data: dict) -> str:
    """The report as a Markdown table (docs/benchmarks.md) and a list."""
    out = ["| " + " | ".join(label for _, label in _COLUMNS) + " |",
           "|" + " --- |" * len(_COLUMNS)]
    out += ["| " + " | ".join(_cell(row[key]) for key, _ in _COLUMNS) + " |"
            for row in data["faults"]]
    return "\n".join(out + [""] + [f"- {line}" for line in _summary(data)]) + "\n"

