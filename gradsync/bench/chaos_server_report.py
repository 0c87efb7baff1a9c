"""What a chaos soak of a *server* job says: per server fault its cost, over the run what the
servers guarantee.

``gradsync bench chaos --servers S`` (a parameter-server job) or ``--data-servers D`` (a
data-server job) breaks a server while the workers train, and keeps every line the ranks
write (``chaos_server_rank.py`` documents them). This module turns those lines into the same
report as the elastic job's (``chaos_report.py``: its table, its summary, its ``verdict`` and
``Bounds``), with the rules below, and tests them on hand-written logs
(tests/test_bench_chaos.py).

**A server fault** (``ServerFault``: a kind, and the index of the server it hit) is *detected*
when the job drops that server:

- parameter servers: worker 0's watcher logs a view of some shard without the server (a
  worker found its primary gone or silent, or a primary its backup; docs/ps.md). **Detection**
  is from the fault to that view; **recovery** from that view to the last worker's first step
  completed after it; the row's note says when the server's replacement was back in a full
  view (the launcher starts it again and it joins with a copy);
- data servers: a worker's loader gives the server up (``dlost``). **Detection** is from the
  fault to the last worker's ``dlost`` (every worker knows; each takes from every data
  server); **recovery** from there to the last worker's first batch after it.

A fault no one dropped the server for (a straggler, a stop shorter than the heartbeat) was
*absorbed*: its stall, as for the elastic job.

**Steps lost.** Workers of a server job never roll back; what a server fault can lose is what
the workers had already done. Parameter servers: every push names the version its shard's
primary acknowledged, and a push begun after another was acknowledged must get a newer
version (in ``sync`` the next round, in ``async`` a later update); the versions that went back
across the fault (the highest acknowledged before it, against the lowest acknowledged by a
push begun after all of those) are acknowledged updates the new primary lacks: **steps lost**,
0 when replication kept its promise. Data servers: batches received after the fault whose
samples had already reached a worker in the same epoch.

**Parameters.** ``sync``: the workers' digests of each step agree, and each equals the
fault-free reference run's digest of the same step (the same job, the same seeds, run to the
soak's last step without faults): per fault, every step from it to the next fault; at the
end, every step and every shard's parameters on the servers. ``async`` (the order of updates
depends on timing, so no two runs are equal): every live copy of each shard holds the same
version, counters and bits at the end, which each fault's row shows. Data servers hold no
parameters: their rows compare none.

**Checks at the end** (``checks``; each fails the verdict when it fails or could not be made):

- parameter servers: per shard, *acknowledged updates lost*: the pushes the workers had
  acknowledged minus the gradients the shard's primary applied, 0 (neither lost nor applied
  twice); the copies agree; in ``sync``, the final parameters (workers' and servers') equal the
  reference run's;
- data servers: in every epoch that every worker finished, every sample of the data set
  reached exactly one worker exactly once (``EXACTLY_ONCE``).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from . import chaos_report as cr

__all__ = ["ServerFault", "ServerLog", "parse", "outcome", "checks", "exactly_once",
           "report", "EXACTLY_ONCE"]

EXACTLY_ONCE = ("data-server job: in every epoch that every worker finished, every sample "
                "of the data set reaches exactly one worker exactly once (docs/data.md: a lost "
                "data server's share is served by the others)")
_PS_RULE = ("parameter-server job: each worker's batch is fixed by (worker, step); no sample "
            "rule, the checks below instead")


@dataclass
class ServerFault(cr.Fault):
    """A fault on a server: ``server`` is its index among the job's parameter servers (0 ..
    S-1) or data servers (0 .. D-1)."""

    server: int = -1


@dataclass(frozen=True)
class Push:
    """A parameter-server worker's step: its push began at ``t0``, the step ended at ``wall``,
    and each shard's primary acknowledged ``versions``."""

    worker: str
    s: int
    t0: float
    wall: float
    versions: tuple[int, ...]


@dataclass
class ServerLog:
    """Everything the ranks of a server job wrote that the report needs."""

    base: cr.Log = field(default_factory=cr.Log)
    """The step lines, as the elastic job's (``chaos_report.Log``)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """pid -> launcher rank, from the hellos (a restarted server has a new pid)."""
    views: list[tuple[float, int, int, tuple[int, ...]]] = field(default_factory=list)
    """(wall, shard, epoch, members) per view worker 0 saw."""
    lost: list[tuple[float, str, int]] = field(default_factory=list)
    """(wall, worker, data server) per data server a worker gave up."""
    epochs: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    """epoch -> the workers whose loop over it ended."""
    pushes: list[Push] = field(default_factory=list)
    finals: list[dict] = field(default_factory=list)
    """worker 0's ``psfinal`` lines, one per shard."""

    @property
    def steps(self) -> list[cr.Step]:
        return self.base.steps

    @property
    def hellos(self) -> dict[str, str]:
        return self.base.hellos

    @property
    def takes(self) -> dict:
        return self.base.takes

    def add(self, line: str) -> None:
        self.base.add(line)
        match = cr._PREFIX.match(line)
        body = line[match.end():] if match else ""
        if not body.startswith("CHAOS "):
            return
        kind = body.split()[1]
        v = dict(cr._FIELDS.findall(body))
        if kind == "hello" and v.get("rank", "?").isdigit():
            self.ranks[v["p"]] = int(v["rank"])
        elif kind == "step" and "v" in v:
            self.pushes.append(Push(v["p"], int(v["s"]), float(v["t0"]), float(v["wall"]),
                                    tuple(int(x) for x in v["v"].split(","))))
        elif kind == "view":
            self.views.append((float(v["wall"]), int(v["shard"]), int(v["epoch"]),
                               tuple(int(m) for m in v["members"].split(",") if m)))
        elif kind == "dlost":
            self.lost.append((float(v["wall"]), v["p"], int(v["d"])))
        elif kind == "epoch":
            self.epochs[int(v["e"])].add(v["p"])
        elif kind == "psfinal":
            self.finals.append({k: (val if k == "digest" else int(val))
                                for k, val in v.items() if k not in ("p", "wall")})


def parse(lines) -> ServerLog:
    log = ServerLog()
    for line in lines:
        log.add(line)
    return log


def _step_digests(log: ServerLog) -> dict[int, set[str]]:
    digests = defaultdict(set)
    for st in log.base.steps:
        digests[st.s].add(st.h)
    return digests


def _after(log: ServerLog, wall: float, end: float) -> dict[str, float]:
    """Each worker's first step completed in ``(wall, end)``."""
    first: dict[str, float] = {}
    for st in log.base.steps:
        if wall < st.wall < end:
            first[st.worker] = min(st.wall, first.get(st.worker, st.wall))
    return first


def _versions_lost(log: ServerLog, fault: cr.Fault, end: float) -> int | None:
    """Acknowledged versions that went back across ``fault`` (module docstring), or None when
    no push was acknowledged before it or begun after those."""
    before = [p for p in log.pushes if p.wall < fault.wall]
    if not before:
        return None
    acked = max(p.wall for p in before)
    after = [p for p in log.pushes if p.t0 > acked and p.wall < end]
    if not after:
        return None
    shards = range(len(before[0].versions))
    return max(0, max(max(p.versions[k] for p in before) - min(p.versions[k] for p in after)
                      + 1 for k in shards))


def _batches_again(log: ServerLog, fault: cr.Fault, end: float) -> int:
    """Batches received in ``[fault, end)`` holding a sample already delivered in their
    epoch."""
    seen: dict[int, set[int]] = defaultdict(set)
    again = 0
    for st in sorted(log.base.steps, key=lambda st: st.wall):
        if fault.wall <= st.wall < end and seen[st.e] & set(st.rows):
            again += 1
        seen[st.e].update(st.rows)
    return again


def outcome(fault: ServerFault, log: ServerLog, window_end: float, *, job: str,
            reference: ServerLog | None = None, replicas: int = 1) -> dict:
    """One row of the report for a server fault (module docstring), with ``chaos_report``'s
    keys: ``job`` is ``"ps-sync"``, ``"ps-async"`` or ``"data"``."""
    row = {"fault": fault.kind, "target": fault.target, "note": fault.note, "role": "server",
           "detected": False, "detection_s": None, "recovery_s": None, "steps_lost": None,
           "params_identical": None, "stall_s": None, "steady_gap_s": None,
           "injected": fault.injected}
    before = [st.wall for st in log.base.steps if st.wall < fault.wall and st.r == 0]
    steady = cr._gaps([w for w in before if w >= fault.wall - 30])
    row["steady_gap_s"] = statistics.median(steady) if steady else None
    if job == "data":
        row["role"] = "data server"
        row["params_rule"] = "none"
        seen: dict[str, float] = {}
        for wall, worker, d in sorted(log.lost):
            if d == fault.server and fault.wall <= wall < window_end:
                seen.setdefault(worker, wall)
        known = max(seen.values()) if seen else None
        row["steps_lost"] = _batches_again(log, fault, window_end)
    else:
        drop = [(wall, shard, members) for wall, shard, _, members in log.views
                if fault.wall <= wall < window_end and fault.server not in members]
        known = min(wall for wall, _, _ in drop) if drop else None
        if known is not None:
            shard = min(drop)[1]
            back = [wall for wall, k, _, members in log.views
                    if k == shard and wall > known and len(members) >= replicas]
            if back:
                row["note"] = _join(row["note"], f"copy back in {back[0] - known:.1f} s")
        row["steps_lost"] = _versions_lost(log, fault, window_end)
        row["params_identical"] = _params(log, fault, window_end, job, reference)
        if row["params_identical"] is None:
            row["params_note"] = "parameters not compared (no fault-free reference run)" \
                if job == "ps-sync" else "copies not compared (no final counters)"
    if known is None:
        during = cr._gaps([st.wall for st in log.base.steps if st.r == 0
                           and fault.wall - 1 <= st.wall <= min(window_end, fault.until + 5)])
        row["stall_s"] = max(during) if during else None
        return row
    row["detected"] = True
    row["detection_s"] = known - fault.wall
    first = _after(log, known, window_end)
    workers = {st.worker for st in log.base.steps if st.wall < fault.wall}
    if workers and workers <= set(first):
        row["recovery_s"] = max(first[w] for w in workers) - known
    else:
        row["note"] = _join(row["note"], f"workers {sorted(workers - set(first))} made no step "
                                         f"after it")
    return row


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def _params(log: ServerLog, fault: cr.Fault, end: float, job: str,
            reference: ServerLog | None) -> bool | None:
    if job == "ps-async":
        if not log.finals:
            return None
        return all(f["agree"] and f["copies"] == f["view"] for f in log.finals)
    if reference is None:
        return None
    mine, theirs = _step_digests(log), _step_digests(reference)
    steps = {st.s for st in log.base.steps if fault.wall <= st.wall < end}
    if not steps or not steps <= set(theirs):
        return None
    return all(len(mine[s]) == 1 and mine[s] == theirs[s] for s in steps)


def exactly_once(log: ServerLog, dataset: int) -> dict:
    """``EXACTLY_ONCE`` per epoch that every worker finished: ``epochs`` (epoch, batches,
    samples received, distinct, missing, repeated) and ``violations``."""
    workers = {st.worker for st in log.base.steps}
    by_epoch = defaultdict(list)
    for st in log.base.steps:
        by_epoch[st.e].append(st)
    rows, violations = [], []
    for epoch in sorted(by_epoch):
        if not workers or not workers <= log.epochs.get(epoch, set()):
            continue
        used = Counter(i for st in by_epoch[epoch] for i in st.rows)
        missing = dataset - len(used)
        repeated = sum(n - 1 for n in used.values())
        rows.append({"epoch": epoch, "steps": len(by_epoch[epoch]), "used": sum(used.values()),
                     "distinct": len(used), "missing": missing, "repeats": repeated})
        if missing or repeated:
            violations.append({"epoch": epoch, "why": f"{missing} samples missing, {repeated} "
                                                      f"received more than once"})
    return {"epochs": rows, "violations": violations}


def checks(log: ServerLog, *, job: str, reference: ServerLog | None, dataset: int) -> list[dict]:
    """The end-of-run checks (module docstring): ``{"check", "ok", "detail"}`` each; ``ok``
    None when the check could not be made."""
    out = []
    if job == "data":
        got = exactly_once(log, dataset)
        whole = [e["epoch"] for e in got["epochs"]]
        out.append({"check": "samples exactly once", "ok": bool(whole) and not got["violations"],
                    "detail": (f"{len(whole)} whole epochs, {len(got['violations'])} broken"
                               if whole else "no epoch that every worker finished")})
        return out
    if not log.finals:
        out.append({"check": "no acknowledged update lost", "ok": None,
                    "detail": "no final counters (worker 0 did not reach its check)"})
    for f in log.finals:
        lost = f["acked"] - f["applied"]
        out.append({"check": f"shard {f['shard']}: no acknowledged update lost", "ok": lost == 0,
                    "detail": f"{lost} lost ({f['acked']} acknowledged, {f['applied']} applied)"})
        out.append({"check": f"shard {f['shard']}: copies agree",
                    "ok": bool(f["agree"]) and f["copies"] == f["view"],
                    "detail": f"{f['copies']} copies of the {f['view']} in the view answered, "
                              f"{'equal' if f['agree'] else 'DIFFERENT'}"})
    if job == "ps-sync":
        out.append(_against_reference(log, reference))
    return out


def _against_reference(log: ServerLog, reference: ServerLog | None) -> dict:
    name = "parameters bitwise equal to the fault-free run"
    if reference is None or not reference.base.steps or not log.base.steps:
        return {"check": name, "ok": None, "detail": "no fault-free reference run"}
    if not log.finals or not reference.finals:
        return {"check": name, "ok": None, "detail": "no final digests of the servers"}
    mine, theirs = _step_digests(log), _step_digests(reference)
    last, ref_last = max(mine), max(theirs)
    if last != ref_last:
        return {"check": name, "ok": None,
                "detail": f"the reference ran {ref_last} steps, the soak {last}"}
    differ = [s for s in sorted(mine) if len(mine[s]) != 1 or mine[s] != theirs.get(s)]
    servers = {f["shard"]: f["digest"] for f in log.finals}
    ref_servers = {f["shard"]: f["digest"] for f in reference.finals}
    same_servers = bool(servers) and servers == ref_servers
    ok = not differ and same_servers
    detail = (f"{last} steps, every step's digest and every shard's equal" if ok else
              f"steps differing: {differ[:5]}{'...' if len(differ) > 5 else ''}; servers' "
              f"final digests {'equal' if same_servers else f'{servers} against {ref_servers}'}")
    return {"check": name, "ok": ok, "detail": detail}


def report(faults, log: ServerLog, *, job: str, window: tuple[float, float],
           baseline: float | None, hangs, skipped, bounds: cr.Bounds = cr.Bounds(),
           reference: ServerLog | None = None, dataset: int = 0, replicas: int = 1) -> dict:
    """The whole report of a server soak as plain data, in ``chaos_report.report``'s shape
    (the same ``format_text``, ``format_markdown`` and ``verdict``), plus ``job`` and
    ``checks``."""
    ends = [f.wall for f in faults[1:]] + [window[1]]
    rows = [{"at_s": round(f.wall - window[0], 1),
             **outcome(f, log, end, job=job, reference=reference, replicas=replicas)}
            for f, end in zip(faults, ends)]
    rate = cr.goodput(log.base, *window)
    samples = exactly_once(log, dataset) if job == "data" else {"epochs": [], "violations": []}
    data = {"job": job, "faults": rows, "worst": cr.worst(rows), "hangs": list(hangs),
            "skipped": list(skipped),
            "mismatches": [{"generation": g, "step": s} for g, s in cr.mismatches(log.base)],
            "samples": samples, "sample_rule": EXACTLY_ONCE if job == "data" else _PS_RULE,
            "rejoins": [], "goodput": rate, "baseline_goodput": baseline,
            "goodput_ratio": rate / baseline if rate and baseline else None,
            "seconds": window[1] - window[0],
            "checks": checks(log, job=job, reference=reference, dataset=dataset),
            "bounds": {"detection_s": bounds.detection_s, "recovery_s": bounds.recovery_s,
                       "goodput": bounds.goodput}}
    data["failures"] = cr.verdict(data)
    return data
