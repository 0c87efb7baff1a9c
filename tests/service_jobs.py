"""One job for several scenarios of the data or parameter servers (tests/ranks/service_suite.py).

tests/test_data_multiprocess.py, tests/test_data_liveness.py and tests/test_ps.py each started a
job per scenario:
``gradsync run`` and its workers and servers, every one an interpreter that imports torch, for
scenarios that then ran for a second or two. Now the scenarios of one shape (as many workers
and servers) run one after the other in the same ranks, each under a job id of its own, and
each test reads its own scenario's part of the shared output, as tests/small_jobs.py does for
the front doors' scripts. A module-scoped fixture of the test file starts each such job once
per pytest process, so its time stays with its file in the budgets (tests/budgets.txt); a job
that two files read is started by tests/data_jobs.py and charged to its own line. Ranks started
as torchrun starts them (``spawn``) may run each scenario on some of them (``entry``'s
``ranks``), so that scenarios of several shapes share one job.
``DataJob`` is such a job of data servers under ``gradsync run --data-servers``, each scenario
with a directory of its own for the files its workers write (tests/ranks/data_check.py).

A scenario that fails ends its rank (the scenarios after it do not run): its test fails with
its reason, and so do those of the scenarios after it, which did not run (``ran``); the tests
of the scenarios before it pass. A scenario that ends the job (a killed server, a data server
that fails) comes last in its job, and its test reads the job's status as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness

BEGIN, DONE = "suite: begin", "suite: scenario done"
"""What tests/ranks/service_suite.py prints (tagged) when a scenario starts, and once it has
returned on a rank."""


def entry(tag: str, script: str, *args, rank_args: dict | None = None, env: dict | None = None,
          go_on: bool = False, ranks: list[int] | None = None) -> dict:
    """One scenario of a plan (tests/ranks/service_suite.py describes the fields)."""
    found: dict = {"tag": tag, "script": script, "args": [str(a) for a in args]}
    if ranks is not None:
        found["ranks"] = list(ranks)
    if rank_args:
        found["rank_args"] = {str(r): [str(a) for a in a_] for r, a_ in rank_args.items()}
    if env:
        found["env"] = dict(env)
    if go_on:
        found["go_on"] = True
    return found


def _plan(directory: Path, entries: list[dict]) -> Path:
    path = Path(directory) / "plan.json"
    path.write_text(json.dumps(entries, indent=1))
    return path


def launch(np_: int, entries: list[dict], directory: Path, *, timeout: float,
           launcher_args: tuple = (), env: dict | None = None) -> harness.Result:
    """``gradsync run -np NP LAUNCHER_ARGS service_suite.py PLAN`` (``harness.launch``), the
    plan written to ``directory``."""
    return harness.launch(np_, "service_suite.py", str(_plan(directory, entries)),
                          timeout=timeout, env=env, launcher_args=launcher_args)


def spawn(np_: int, entries: list[dict], directory: Path, *, timeout: float,
          env: dict | None = None) -> list[harness.Rank]:
    """The same ranks started as torchrun starts them (``harness.spawn``): each rank's own
    exit status and output."""
    return harness.spawn(np_, "service_suite.py", str(_plan(directory, entries)),
                         timeout=timeout, env=env)


def lines(output: str, tag: str) -> str:
    """The lines scenario ``tag`` printed on stdout (on every rank of ``output``), untagged."""
    mark = f"{tag}| "
    return "".join(line.replace(mark, "", 1) for line in output.splitlines(keepends=True)
                   if mark in line)


def section(output: str, tag: str) -> str:
    """One rank's output (``harness.spawn``'s) while scenario ``tag`` ran: from its first
    line to the next scenario's, stderr (its log lines, a traceback) included."""
    begin = output.find(f"{tag}| {BEGIN}")
    if begin < 0:
        return ""
    end = output.find(f"| {BEGIN}", begin + len(tag) + 2)
    if end >= 0:
        end = output.rfind("\n", begin, end) + 1  # the start of that line
    return output[begin:end if end > 0 else len(output)]


def done(output: str, tag: str) -> int:
    """On how many ranks scenario ``tag`` returned (every line is one rank's)."""
    return lines(output, tag).count(DONE)


def ran(result: harness.Result, tags: list[str], tag: str, ranks: int) -> bool:
    """Whether scenario ``tag`` of a launched job (``tags``: its scenarios in order) returned
    on all ``ranks`` ranks and the job's failure, if it failed, was a later scenario's: what
    the job's exit status 0 said when the scenario ran alone."""
    if done(result.output, tag) != ranks:
        return False
    later = tags[tags.index(tag) + 1:]
    return result.returncode == 0 or any(done(result.output, t) < ranks for t in later)


def data_entry(tag: str, scenario: str, *args, **kw) -> dict:
    """A scenario of tests/ranks/data_check.py (``data_check.py SCENARIO DIR ARGS``): its
    ``DIR`` is filled in by ``DataJob``, the scenario's own directory."""
    return entry(tag, "data_check.py", scenario, "DIR", *args, **kw)


class DataJob:
    """A shared job of ``workers`` workers and ``servers`` data servers (``launch`` under
    ``gradsync run --data-servers``): its result, its scenarios' tags in order, and each
    scenario's directory (``dirs``: by default ``tmp/<tag>``)."""

    def __init__(self, tmp: Path, workers: int, servers: int, scenarios: list[dict], *,
                 timeout: float, dirs: dict | None = None):
        self.workers, self.servers, self.tags = workers, servers, [e["tag"] for e in scenarios]
        self.dirs = {**{t: Path(tmp) / t for t in self.tags}, **(dirs or {})}
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        for e in scenarios:  # each scenario's directory, by tag: its files' place
            e["args"][1:2] = [str(self.dirs[e["tag"]])]
            for args in e.get("rank_args", {}).values():
                args[1:2] = [str(self.dirs[e["tag"]])]
        # -np counts the workers; --data-servers adds the servers' ranks after them.
        self.result = launch(workers, scenarios, tmp, timeout=timeout,
                             launcher_args=("--data-servers", str(servers)))

    def ran(self, tag: str) -> Path:
        """Scenario ``tag`` returned on every rank, and the job's failure is not its (its job
        alone asserted the status 0); its directory."""
        assert ran(self.result, self.tags, tag, self.workers + self.servers), \
            f"scenario {tag} did not run to its end on every rank:\n{self.result}"
        return self.dirs[tag]
