"""The tiers on several pytest workers (pytest-xdist): which tests must meet in one worker.

Most of a tier's wall-clock time is waiting, not computing: ranks blocked on a heartbeat's
bound, a deadline, a rendezvous, a shaped link, a peer's start-up. scripts/test.sh therefore
runs a tier on a few workers at once (``-n``, docs/testing.md says how many and what it saved),
and the machine's cores take turns at what the waits leave.

Tests that share a job must still meet in one worker, or each worker starts the job for itself
and the sharing saves nothing: the tests of one file (its module-scoped fixtures and caches),
and the files that read a job started once per pytest process for several of them
(``SHARED``: tests/small_jobs.py, data_jobs.py, scale_jobs.py). Each test is given
``xdist_group(NAME)``, NAME its file or, for the files that read a shared job, that job's
module (files that read two are joined into one group), and the tier runs with
``--dist loadgroup``: a group's tests go to one worker, the groups spread over the workers.
Run with no ``-n`` (or ``-n 0``), nothing here changes anything.

**Longest first.** The groups are handed to the workers in the order of their cost, the largest
first: a group's cost is the sum of its files' budgets in the tier (tests/budgets.txt, with
the shared jobs' own lines). xdist's own order (``--loadscope-reorder``, its default: the groups
with the most tests first) handed the one-test files of 15-35 s each (an example trained to
its target, a Lightning job) out last, and the tier ended with one worker still running them
and the other two idle (the last 13-26 s of default tiers of 380-466 s, measured 2026-11-30;
docs/testing.md, "The largest groups first"). Within a group the tests keep their order.

A test that looks at the whole machine, not at its own job (every segment in /dev/shm, every
process), must not mistake another worker's job for its own: such a test names its job's
segments and processes (harness.MARK, the job id), never "whatever appeared meanwhile".
"""

from __future__ import annotations

from types import ModuleType

import pytest

from budgets import BUDGETS, read_budgets, tier_of

SHARED = ("small_jobs", "data_jobs", "scale_jobs")
"""Modules of tests/ whose jobs are started once per pytest process and read by several files."""


def _uses(module) -> set[str]:
    """The modules of ``SHARED`` that a test module imported, or imported names from."""
    found = set()
    for value in vars(module).values():
        name = getattr(value, "__name__" if isinstance(value, ModuleType) else "__module__",
                       None)
        if name in SHARED:
            found.add(name)
    return found


def groups(files: dict[str, set[str]]) -> dict[str, str]:
    """Each file's group: ``files`` maps a file to the ``SHARED`` modules it uses; files joined
    by a module they share (directly or through another file) get one group, named by the
    first of their modules; a file that uses none is a group of its own, named by itself."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for used in files.values():
        names = sorted(used)
        for other in names[1:]:  # join every module a file uses into one group
            a, b = sorted((root(names[0]), root(other)))
            parent[b] = a
    return {f: root(min(used)) if used else f for f, used in files.items()}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups in the worker
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # each worker collects; the controller schedules
        return
    files: dict[str, set[str]] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        if file not in files:
            module = getattr(item, "module", None)
            files[file] = _uses(module) if module is not None else set()
    group = groups(files)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item.nodeid.split("::", 1)[0]]))
    budgets = read_budgets(BUDGETS)[tier_of(config) or "both"]
    items[:] = longest_first(items, group, costs(files, group, budgets))


def costs(files: dict[str, set[str]], group: dict[str, str],
          budgets: dict[str, float]) -> dict[str, float]:
    """Each group's budget: its files' lines and those of the shared jobs its files read (each
    once), by base name (``small_jobs.py``)."""
    cost: dict[str, float] = {}
    jobs: dict[str, set[str]] = {}
    for name, used in files.items():
        cost[group[name]] = cost.get(group[name], 0.0) + budgets.get(name.rsplit("/", 1)[-1], 0.0)
        jobs.setdefault(group[name], set()).update(used)
    for name, used in jobs.items():
        cost[name] += sum(budgets.get(f"{module}.py", 0.0) for module in used)
    return cost


def longest_first(items: list, group: dict[str, str], cost: dict[str, float]) -> list:
    """``items`` with the groups of the largest cost first (ties in the order they came),
    each group's items in their own order (``group`` maps each item's file to its group)."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(group[item.nodeid.split("::", 1)[0]], index)

    def key(item) -> tuple[float, int]:
        name = group[item.nodeid.split("::", 1)[0]]
        return (-cost.get(name, 0.0), first[name])
    return sorted(items, key=key)


def pytest_configure(config):
    """xdist hands out the groups in the collected order (``longest_first``), not its own."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
