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

A test that looks at the whole machine, not at its own job (every segment in /dev/shm, every
process), must not mistake another worker's job for its own: such a test names its job's
segments and processes (harness.MARK, the job id), never "whatever appeared meanwhile".
"""

from __future__ import annotations

from types import ModuleType

import pytest

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
