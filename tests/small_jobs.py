"""One job per world size for the rank scripts that check a front door at 1, 2 and 3 ranks.

tests/test_hvd_behaviours.py, test_negotiation.py, test_lean.py, test_torch_surface.py and
test_torch_optimizer.py each used to start ``gradsync run -np N`` for their script at each
world size: sixteen jobs whose start-ups (interpreters, torch's import, rendezvous) were nearly
all of their time. Now the first of their tests to run at a world size starts one job there
that runs every script of that size one after the other (tests/ranks/suite.py), and each test
reads its own script's lines of that job's output.

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

from harness import launch

_FRONT_DOORS = ("hvd_behaviours.py", "negotiation.py", "lean.py", "torch_surface.py")
SCRIPTS = {1: _FRONT_DOORS,
           2: _FRONT_DOORS + ("torch_parity.py", "torch_bucket_views.py"),
           3: _FRONT_DOORS + ("torch_parity.py", "torch_bucket_views.py", "pace.py")}
"""The scripts of each world size's job, in this order: hvd_behaviours.py checks that shutdown
leaves no thread behind, which is strictest with no World closed before its own; pace.py
(stragglers named, tests/test_stragglers.py) comes last, its 40 steps of sleeps (3 s) after
every other check."""

TIMEOUT = 360
"""The job's deadline: the scripts' own (90-150 s each alone) less their start-ups, and
room for a loaded machine (a job of six scripts takes 40-150 s on 2 busy cores)."""


@functools.lru_cache(maxsize=None)
def result(n: int):
    """The job of every script in ``SCRIPTS[n]`` at ``n`` ranks (run once, then remembered)."""
    return launch(n, "suite.py", *SCRIPTS[n], timeout=TIMEOUT)


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
