"""Several runs of a benchmark's ranks, one after the other in the same processes.

    bench_runs.py RUNS.json

``gradsync bench NAME -np N ARGS`` starts ``gradsync run``, which starts N ranks that each run
``python -m gradsync.bench.NAME ARGS``: three interpreters or more, each importing torch, for a
run whose checks (the rows, the table, the identical parameters) take a second or two. Here
each rank runs every run of RUNS.json in turn as that module's ``__main__`` (``runpy``), with
the run's arguments and environment: ``[{"name": ..., "module": "gradsync.bench.allreduce",
"args": [...], "env": {"GRADSYNC_TRANSPORT": "tcp", ...}}, ...]``. Each run calls ``init()``
and ``shutdown()`` itself, so each is a fresh job; each meets at a store of its own (the next
port of ``GS_TEST_STORE_PORTS``, tests/forked_jobs.py), since the benchmarks host
torch.distributed's groups on the job's store under fixed names.

A rank script of tests/ranks (on the forked ranks' path) runs the same way, by its module
name: tests/test_distributed_backend.py runs the torch backend's scripts so.

What a run prints to stdout goes to ``NAME.R.out`` beside RUNS.json (R: this rank), what the
module alone would have printed; once the run has returned, the rank prints
``bench_runs: NAME done``. A run that fails (an exception, or a non-zero exit status, as the
module's ``__main__`` gives when the parameters differ between ranks) ends the rank as it would
alone, and the runs after it do not run: their tests fail, never pass.
"""

import contextlib
import json
import os
import runpy
import sys

import common  # noqa: F401  (deadline, and the checkout on sys.path)

folder = os.path.dirname(os.path.abspath(sys.argv[1]))
with open(sys.argv[1]) as f:
    runs = json.load(f)
ports = os.environ["GS_TEST_STORE_PORTS"].split(",")
assert len(ports) >= len(runs), (ports, runs)  # a store per run
rank = os.environ["RANK"]
for run, port in zip(runs, ports):
    settings = {**run.get("env", {}), "MASTER_PORT": port}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # read by init(): the job's GRADSYNC_* and its store
    sys.argv = [run["module"], *run["args"]]
    try:
        with open(os.path.join(folder, f"{run['name']}.{rank}.out"), "w") as out, \
                contextlib.redirect_stdout(out):
            runpy.run_module(run["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise  # the rank's status and message, as the module alone would end
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    print(f"bench_runs: {run['name']} done", flush=True)
