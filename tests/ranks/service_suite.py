"""Several scenarios of a service (data servers, parameter servers) in the same ranks, one
after the other, each a job of its own: one start-up for all of them.

    service_suite.py PLAN.json

Starting a job costs an interpreter, torch's import and a rendezvous per rank (about 5 s for
a job on an idle 2-core machine, 15-45 s on a loaded one), while most scenarios of
tests/ranks/data_check.py and tests/ranks/ps_check.py train or serve for a second or two. So
tests/service_jobs.py starts one job for the scenarios of one shape (workers and servers)
and this script runs each of them in it, in order, as a fresh ``__main__`` of its script.

Why a new job id for each scenario. A data or parameter server serves one job and ends: on a
server rank ``gradsync.data.Loader(...)``, or ``gradsync.init()`` under a launcher that starts
every rank from the script (``harness.spawn``, torchrun's way, with ``GRADSYNC_SERVERS``
exported), serves until its workers are done and then raises ``SystemExit`` with its status,
which this script catches to go on to the next scenario. The service's store keys (where
each server publishes its address), its endpoints' names and its shared-memory segments are
named by the job id, so a second scenario under the same id would find the first one's
servers. Every rank therefore sets ``GRADSYNC_JOB_ID`` to ``<the job's id>.<tag>`` before each
scenario (the launch environment is read afresh by every ``detect()``), and the workers
``shutdown()`` after it: the next ``init()`` is a fresh World under the new id. The
launcher's id stays the prefix, so what ``gradsync run`` clears from /dev/shm at the end
(names that start with ``gradsync-<job id>``) covers every scenario.

PLAN.json is a list of entries, each a dict::

    tag        the scenario's name in the output and in the job id: letters, digits, '-'
    script     the rank script, in tests/ranks/
    args       its arguments (``sys.argv[1:]``)
    rank_args  optional, {rank: args}: another rank's arguments (a worker held elsewhere)
    env        optional, variables set for this scenario only (``GRADSYNC_TRANSPORT``)
    go_on      optional: a non-zero exit of the scenario (``sys.exit(3)`` after an expected
               error) ends the scenario, not the rank: ``<tag>| suite: exit STATUS``
    ranks      optional, ranks started as torchrun starts them only: the job's ranks that
               run the scenario, in its rank order (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
               and ``LOCAL_WORLD_SIZE`` set to the scenario's); the others skip it, printing
               nothing. So scenarios of several shapes (1 worker and 1 server, 4 and 2) share
               the start-up of one job of as many ranks as the largest needs

Each scenario starts with the line ``<tag>| suite: begin`` and each line it prints on stdout
is tagged ``<tag>| `` (as tests/ranks/suite.py does); on its return, ``<tag>| suite: scenario
done``. Unless ``go_on``, a scenario that exits with a non-zero status ends the rank with it,
as the script alone would (the scenarios after it do not run, and their tests fail): so a
scenario that ends its job (a killed server, a failing data server) comes last, for each of
its ranks. Every rank runs its scenarios in the plan's order, so scenarios on disjoint ranks
may run at once and none waits for a rank that is still in an earlier one of its own.
"""

import itertools
import json
import os
import re
import runpy
import sys

import common  # noqa: F401  (deadline, and the checkout on sys.path)
from tagged import Tagged  # stdout tagged per script

import gradsync as gs
from gradsync.connect import world

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, DONE = "suite: begin", "suite: scenario done"


def rank() -> str:
    """This process's rank as its launcher numbered it (gradsync run's or torchrun's)."""
    return os.environ.get("GRADSYNC_RANK", os.environ.get("RANK", "0"))


def run(entry: dict, base: str) -> None:
    tag = entry["tag"]
    if not re.fullmatch(r"[A-Za-z0-9-]+", tag):
        raise SystemExit(f"service_suite: tag {tag!r} is not letters, digits and '-'")
    script = os.path.join(HERE, entry["script"])
    args = entry.get("rank_args", {}).get(rank(), entry.get("args", []))
    settings = {"GRADSYNC_JOB_ID": f"{base}.{tag}", **entry.get("env", {})}
    if "ranks" in entry:
        if "GRADSYNC_RANK" in os.environ:
            raise SystemExit(f"service_suite: {tag}'s ranks need ranks started as torchrun "
                             "starts them (a launcher's ranks have their roles)")
        ranks = [int(r) for r in entry["ranks"]]
        if int(rank()) not in ranks:
            return
        mine, size = str(ranks.index(int(rank()))), str(len(ranks))
        settings.update(RANK=mine, WORLD_SIZE=size, LOCAL_RANK=mine, LOCAL_WORLD_SIZE=size)
    saved = {name: os.environ.get(name) for name in settings}
    real_stdout = sys.stdout
    print(f"{tag}| {BEGIN}", flush=True)
    os.environ.update(settings)
    # A worker's World takes the scenario's id as it is, as in a job alone: World.connect
    # suffixes the id with its count of this process's earlier init() calls (so that a second
    # World under one id never meets the first one's keys), and the servers, which read the
    # id as given, would then watch another abort record than the World's. The id is new.
    world._generations = itertools.count()
    sys.argv = [script, *map(str, args)]
    sys.stdout = Tagged(real_stdout, f"{tag}| ")
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            if not entry.get("go_on"):
                raise  # the rank's status and message, as the script alone would end
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr, flush=True)
            print(f"suite: exit {exc.code if isinstance(exc.code, int) else 1}", flush=True)
    finally:
        sys.stdout.flush()
        sys.stdout = real_stdout
    # A worker's World of this scenario ends here (a server rank has none): the next
    # scenario's init() is a fresh job under its own id. (A rank that ends above leaves it to
    # init()'s exit handler, as the script alone would.)
    if gs.is_initialized():
        gs.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    print(f"{tag}| {DONE}", flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    # Every rank derives the same base: the launcher's job id, or under harness.spawn (no
    # GRADSYNC_JOB_ID) one from the port of the store that the ranks share.
    base = os.environ.get("GRADSYNC_JOB_ID") or f"suite-{os.environ.get('MASTER_PORT', '0')}"
    for entry in plan:
        run(entry, base)
    print("service suite done", flush=True)


if __name__ == "__main__":
    main()
