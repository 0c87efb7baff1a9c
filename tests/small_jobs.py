"""One job per world size for the rank scripts that check a front door or sweep the collectives.

tests/test_hvd_behaviours.py, test_negotiation.py, test_lean.py, test_torch_surface.py,
test_torch_optimizer.py, test_torch_api.py, test_collectives.py, test_arguments.py,
test_subworld.py and test_adasum_multiprocess.py each used to start ``gradsync run -np N`` for
their script at each world size: thirty-six jobs whose start-ups (interpreters, torch's import,
rendezvous) were most of their time. Now the first of their tests to run at a world size
starts one job there that runs every script of that size one after the other
(tests/ranks/suite.py), and each test reads its own script's lines of that job's output.

``result(n)`` is the job's result (``harness.Result``: its exit status and whole output), made
once per pytest process; ``output(result, script)`` the lines ``script`` printed, untagged.
``ran(result, script, n)`` says whether ``script`` ended without error on all ``n`` ranks
and the job's status is not its: what the job's exit status 0 said when it ran alone. A failed
script fails its own test with its reason and, since the scripts after it did not run, theirs
too (no check can pass unrun); the tests of the scripts before it still pass. A job that fails
after its last script (at the ranks' exit) fails every test.
"""

from __future__ import annotations

import functools

from budgets import charged_to
from harness import launch

_FRONT_DOORS = ("hvd_behaviours.py", "negotiation.py", "lean.py", "torch_surface.py")
_OPTIMIZER = ("torch_parity.py", "torch_bucket_views.py")
SCRIPTS = {1: _FRONT_DOORS + ("torch_api.py", "sweep.py", "arguments.py", "subworld.py"),
           2: _FRONT_DOORS + _OPTIMIZER + ("torch_api.py", "sweep.py", "adasum_check.py:shm",
                                           "adasum_check.py:tcp"),
           3: _FRONT_DOORS + _OPTIMIZER + ("torch_api.py", "sweep.py", "sweep.py:python",
                                           "sweep.py:tcp", "arguments.py", "subworld.py:tcp",
                                           "adasum_check.py:shm", "adasum_check.py:tcp",
                                           "pace.py", "pace.py:data", "pace.py:ddp"),
           4: ("sweep.py", "process_sets.py", "subworld.py", "adasum_check.py:shm",
               "sweep.py:hosts=aabb")}
"""The entries of each world size's job, in this order (``SCRIPT`` or ``SCRIPT:ARG``,
tests/ranks/suite.py): hvd_behaviours.py checks that shutdown leaves no thread behind, which is
strictest with no World closed before its own; pace.py (stragglers named,
tests/test_stragglers.py) comes last, three times (the NumPy API, a rank slow for its data,
DDP over the backend "gradsync"), its 40 steps of sleeps (3 s each time) after every other
check.
The scripts after the front doors' were jobs of their own in test_torch_api.py,
test_collectives.py, test_arguments.py, test_subworld.py, test_adasum_multiprocess.py and
test_negotiation.py (docs/testing.md, "Where each check lives")."""

TIMEOUT = 600
"""The job's deadline: the scripts' own (60-240 s each alone) less their start-ups, and room
for a loaded machine (the 3-rank job of fifteen entries took 119 s on the 2-core machine at a
load of 20, 2026-11-29)."""


@functools.lru_cache(maxsize=None)
def result(n: int):
    """The job of every script in ``SCRIPTS[n]`` at ``n`` ranks (run once, then remembered).
    Its time is this file's in the per-file budgets (tests/budgets.py), not that of the test
    that asked first."""
    with charged_to("small_jobs.py"):
        # Each job's scripts build optimizers (hvd_behaviours.py, process_sets.py), as a
        # training script does: its template imports what the first one imports, once
        # (docs/launch.md, "What a training script imports later").
        return launch(n, "suite.py", *SCRIPTS[n], timeout=TIMEOUT,
                      launcher_args=("--preload", "torch._dynamo"))


DONE = "suite: script done"
"""What tests/ranks/suite.py prints (tagged) once a script has returned on a rank."""


def ran(job, script: str, n: int) -> bool:
    """Whether ``script`` returned without error on all ``n`` ranks of ``job`` and the job's
    failure, if it failed, was a later script's (one that did not finish on every rank)."""
    scripts = SCRIPTS[n]
    done = {s: output(job, s).count(DONE) for s in scripts}
    if done[script] != n:
        return False
    later = scripts[scripts.index(script) + 1:]
    return job.returncode == 0 or any(done[s] < n for s in later)


def output(job, script: str) -> str:
    """The lines ``script`` printed in ``job``, without their tag."""
    tag = f"{script}| "
    return "".join(line.replace(tag, "", 1) for line in job.output.splitlines(keepends=True)
                   if tag in line)
