"""A time budget per test file: what each file cost in this run, against what it may cost.

The default tier grew from minutes to a quarter of an hour one test at a time, each a few
seconds that nobody saw (issue 39, item 5). CI already printed its 40 slowest tests; a test
that adds 3 s never shows there, a file of twenty of them does here. At the end of a tier this
plugin (loaded by tests/conftest.py) prints each file's total, setup + call + teardown of its
tests, against its budget in ``tests/budgets.txt``, and with ``--budgets=enforce`` (.ci/run)
fails the run when a file is over its budget by a wide margin.

Budgets are seconds on CI's machine, idle (2 cores). Another machine is slower or faster as a
whole, and a loaded one is slower by a factor that moves during the run, so a file is judged
against its budget times the run's *machine factor*: the median, over the files of a budget
of 5 s or more that ran, of each one's total over its budget (one file that grew moves a
median of dozens by nothing), never below 1 (a fast machine does not tighten the budgets).
A file fails when its total passes both twice its scaled budget (three times when the tier
ran on several pytest workers, where a file's time also depends on what the other workers ran
beside it: in one run the median file took 1.34 times its budget, one file 2.9 times) and its
scaled budget plus 10 s: far enough that load and noise do not fail a run (measured on the
loaded 2-core machine, docs/testing.md), near enough that a file which doubled is caught. A
file over its scaled budget but within the margin is listed as over, and fails nothing. Fewer
than 8 files of 5 s or more (a file or two run by hand) give no factor: the plugin then
prints, never fails.

Time that one test pays for many, a job shared by the tests of several files
(tests/small_jobs.py), is charged with ``charged_to(NAME)`` to NAME, its own line in the
budgets, and not to the file whose test happened to run first. On several workers
(pytest-xdist, tests/parallel.py) the charge is made in the worker and travels to the
controller, which adds up the run, in the test's teardown report (``user_properties``).

    python3 -m pytest -q -m "not slow" --budgets=enforce   # CI: print, and fail on a wide miss
    python3 -m pytest -q tests/test_heartbeat.py            # print only (the default: report)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pytest

BUDGETS = Path(__file__).with_name("budgets.txt")
TIERS = {"not slow": "default", "slow": "slow", "slow and not alone": "slow",
         "slow and alone": "slow", "": "both"}
"""The ``-m`` expressions of the tiers (scripts/test.sh; .ci/run runs the slow tier's tests
marked ``alone`` apart, with nothing beside them) and their columns; no ``-m`` (or ``-m ""``,
both tiers in one run) judges each file by the sum of its two columns."""

FACTOR_FLOOR_S = 5.0  # files with a budget this large or larger set the machine factor
FACTOR_FILES = 8  # at least this many of them, or there is no factor and nothing fails
WIDE, WIDE_S = 2.0, 10.0  # a file fails past WIDE × its scaled budget and that + WIDE_S
WIDE_WORKERS = 3.0  # WIDE when the tier ran on several workers (pytest-xdist)

CHARGES = "budget_charges"  # the teardown report's user property: {name: seconds} moved
clock = time.monotonic  # charged_to's clock (a test sets its own)
_spent: dict[str, float] = defaultdict(float)  # seconds by file (or charged name), this run
_pending: dict[str, float] = defaultdict(float)  # charged by the test running now, by name


def read_budgets(path: Path = BUDGETS) -> dict[str, dict[str, float]]:
    """``{tier: {file: seconds}}`` from ``path``: ``FILE DEFAULT SLOW`` a line, ``-`` for a
    file with no test in that tier, ``#`` starts a comment; tier ``both`` sums the two."""
    budgets: dict[str, dict[str, float]] = {"default": {}, "slow": {}}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 3:
            raise ValueError(f"{path}:{number}: want 'FILE DEFAULT SLOW', got {line!r}")
        name, *columns = fields
        for tier, value in zip(("default", "slow"), columns):
            if value != "-":
                budgets[tier][name] = float(value)
    budgets["both"] = {name: budgets["default"].get(name, 0.0) + budgets["slow"].get(name, 0.0)
                       for name in budgets["default"].keys() | budgets["slow"].keys()}
    return budgets


@contextlib.contextmanager
def charged_to(name: str):
    """Charges the time spent inside to ``name`` (a line of the budgets) instead of to the
    file of the test running now."""
    start = clock()
    try:
        yield
    finally:
        _pending[name] += clock() - start


def judge(spent: dict[str, float], budgets: dict[str, float], wide: float = WIDE):
    """The run's machine factor (None when too few files set it) and, for each file that ran,
    ``(file, seconds, budget, verdict)``, verdict ``ok``, ``over``, ``FAIL`` (past ``wide``
    times its scaled budget and WIDE_S more) or ``no budget``, largest first."""
    ratios = [spent[f] / b for f, b in budgets.items() if f in spent and b >= FACTOR_FLOOR_S]
    factor = max(1.0, statistics.median(ratios)) if len(ratios) >= FACTOR_FILES else None
    rows = []
    for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        budget = budgets.get(name)
        if budget is None:
            verdict = "no budget"
        else:
            scaled = budget * (factor or 1.0)
            if factor is not None and seconds > max(wide * scaled, scaled + WIDE_S):
                verdict = "FAIL"
            elif seconds > scaled:
                verdict = "over"
            else:
                verdict = "ok"
        rows.append((name, seconds, budget, verdict))
    return factor, rows


# --- pytest's side ---------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--budgets", choices=("report", "enforce", "off"), default="report",
                     help="per-file time budgets (tests/budgets.txt): print them at the end "
                          "(report, the default), also fail on a file far over its budget "
                          "(enforce: CI), or neither (off)")
    parser.addoption("--budgets-file", default=str(BUDGETS),
                     help="the budgets to judge by (default tests/budgets.txt)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown" and _pending:  # the test's last phase carries its charges
        report.user_properties.append((CHARGES, dict(_pending)))
        _pending.clear()
    return report


def pytest_runtest_logreport(report):
    seconds = report.duration
    for key, charges in report.user_properties:
        if key == CHARGES:  # moved off the test's file to the names charged
            for name, charged in charges.items():
                _spent[name] += charged
                seconds -= charged
    _spent[report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]] += seconds


def tier_of(config) -> str | None:
    """The budgets' column of this run's ``-m`` expression, or None where it is not a tier."""
    return TIERS.get(" ".join((config.option.markexpr or "").split()))


def _wide(config) -> float:
    """WIDE, or WIDE_WORKERS for a tier on several pytest workers: there a file's time also
    depends on what the other workers ran beside it, which the run's machine factor (a
    median) does not follow (docs/testing.md, "Several workers")."""
    return WIDE_WORKERS if (getattr(config.option, "numprocesses", 0) or 0) > 1 else WIDE


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    tier = tier_of(config)
    if (config.getoption("budgets") != "enforce" or tier is None or not _spent
            or hasattr(config, "workerinput")):  # (a worker's share: its controller judges)
        return
    _, rows = judge(_spent, read_budgets(Path(config.getoption("budgets_file")))[tier],
                    _wide(config))
    if any(verdict == "FAIL" for *_, verdict in rows) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tier = tier_of(config)
    if config.getoption("budgets") == "off" or not _spent:
        return
    write = terminalreporter.write_line
    terminalreporter.section("time per test file against its budget (tests/budgets.txt)")
    if tier is None:
        write(f"-m {config.option.markexpr!r} is not a tier ('not slow', 'slow' or none for "
              "both): the files' totals, with no budget")
    budgets = read_budgets(Path(config.getoption("budgets_file")))[tier] if tier else {}
    wide = _wide(config)
    factor, rows = judge(_spent, budgets, wide)
    total, budgeted = sum(_spent.values()), sum(budgets.values())
    write(f"{tier or 'this'} run: {total:.0f} s in {len(rows)} files (budgets "
          f"{budgeted:.0f} s); machine factor "
          + (f"{factor:.2f}" if factor else f"none (fewer than {FACTOR_FILES} files of "
             f"{FACTOR_FLOOR_S:.0f} s budgets ran): nothing fails"))
    shown = [row for i, row in enumerate(rows) if i < 15 or row[3] not in ("ok",)]
    for name, seconds, budget, verdict in shown:
        budget_text = "-" if budget is None else f"{budget:.0f}"
        write(f"  {seconds:8.1f} s  budget {budget_text:>5}  {verdict:9}  {name}")
    if len(shown) < len(rows):
        write(f"  ... {len(rows) - len(shown)} more files within their budgets")
    failed = [name for name, *_, verdict in rows if verdict == "FAIL"]
    if failed:
        how = ("fails the run" if config.getoption("budgets") == "enforce"
               else "would fail with --budgets=enforce")
        write(f"over {wide:.0f}x the scaled budget and {WIDE_S:.0f} s more: {', '.join(failed)}"
              f" ({how}; a file that rightly grew gets a new budget in tests/budgets.txt, "
              "with the reason, in the same commit)", red=True, bold=True)
