"""Several rank scripts, one after the other, in the same ranks: one job start-up for all.

    suite.py SCRIPT[:ARG] [SCRIPT[:ARG] ...]

Starting a job costs an interpreter, torch's import and a rendezvous per rank (about 5 s on
an idle 2-core machine, 15-30 s on a loaded one), while the scripts that check a front door at
a world size run for well under a second. So ``tests/small_jobs.py`` starts one job per world
size and this script runs each named script in it, in order, as a fresh ``__main__`` (each
script calls ``init()`` and ``shutdown()`` itself: every ``init()`` after a ``shutdown()`` is a
fresh job, tests/ranks/reinit.py). ``SCRIPT:ARG`` runs SCRIPT with the one argument ARG (its
``sys.argv[1]``), so a script can run twice in a job with different settings
(``sweep.py:tcp``): each run's ``init()`` takes its settings as keyword arguments, since the
environment is the job's, one for all.

Each line a script prints is tagged with its entry (``lean.py| lean ok``, ``sweep.py:tcp| ...``) so that the test of
each script reads its own lines only. A script that fails ends the rank as it would alone (its
traceback or ``sys.exit`` message, a non-zero status), and the scripts after it do not run: the
tests of that script and of those after it then fail, with its reason; the tests of the
scripts before it, which printed ``<script>| suite: script done`` on every rank, still pass.

A script that patches a class or a module for good (tests/ranks/express.py) cannot run here:
the scripts after it would run patched.
"""

import os
import runpy
import sys

import common  # noqa: F401  (deadline, and the checkout on sys.path)
from tagged import Tagged  # stdout tagged per script

HERE = os.path.dirname(os.path.abspath(__file__))
DONE = "suite: script done"
"""Printed (tagged) once a script has returned without error on this rank."""


real_stdout = sys.stdout
for entry in sys.argv[1:]:
    script, _, arg = entry.partition(":")
    sys.argv = [os.path.join(HERE, script)] + ([arg] if arg else [])
    sys.stdout = Tagged(real_stdout, f"{entry}| ")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise  # the rank's status and message, as the script alone would end
    finally:
        sys.stdout.flush()
        sys.stdout = real_stdout
    print(f"{entry}| {DONE}", flush=True)
print("suite done", flush=True)
