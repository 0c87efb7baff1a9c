"""Starts N ranks of a rank script as forks of one process that has imported torch once.

    forked.py N PER_HOST LOGS SCRIPT [ARGS...]

A rank started on its own pays about 150 MiB of private memory for ``import torch`` (gradsync's
store is torch's TCPStore) and 70 MiB more for its first ``torch.optim`` optimizer (which
imports ``torch._dynamo``): 128 such ranks need about 28 GiB, more than this 2-core, 24 GiB
machine has, and take a minute and a half only to start. Here one process imports all of it,
then forks the ranks, which share those pages copy-on-write: each rank is still a process of
its own, with its own gradsync runtime, connections and shared memory, found through the
store like any other; only the interpreter's start-up is shared.

Rank r gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR
and MASTER_PORT come from this process's environment, a store the caller hosts) and plays
host ``h<r // PER_HOST>`` (``GRADSYNC_HOSTNAME``): shared memory among the ranks of one host,
TCP between hosts. Its stdout and stderr go to ``LOGS/<r>.log``, and it runs SCRIPT as
``__main__`` with ARGS. Every rank arms its own deadline (GS_TEST_DEADLINE: a stack dump of
every thread, then exit), since a fork does not inherit the parent's watchdog thread.

With ``GS_TEST_RANKS_ENV`` (a JSON list of N objects) the i-th fork's variables are updated
with the i-th object after the above, so that one process per emulated host can fork that
host's ranks, whatever their numbers (tests/netns.py's ``run_forked``); its log is then named
by the RANK it was given. ``GS_TEST_FORK_LEAN=1`` imports only torch, NumPy and gradsync
first, for scripts that train nothing.

Prints ``EXIT rank=<r> status=<s>`` per rank as it ends (``s`` negative: killed by signal
``-s``) and exits 0 when every rank exited 0, else 1. Ranks stay in this process's group and
environment, so the caller's deadline (``harness.run_job``) reaches them.
"""

import faulthandler
import gc
import json
import os
import runpy
import sys
import time

started = time.monotonic()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # checks.py, common.py

import numpy  # noqa: F401,E402  (imported once, shared by every rank)
import torch  # noqa: E402
import torch.distributed  # noqa: F401,E402

import gradsync  # noqa: F401,E402

torch.set_num_threads(1)
if not os.environ.pop("GS_TEST_FORK_LEAN", ""):
    # The Horovod API and the first optimizer's torch._dynamo: 1.5 s of CPU more than the
    # imports above (3.0 s and 1.5 s here), paid once for every rank that trains, but wasted
    # by one per host of ranks that only run collectives (tests/netns.py's run_forked).
    import gradsync.torch  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).zero_grad()

n, per_host, logs, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
args = sys.argv[5:]
deadline = float(os.environ.get("GS_TEST_DEADLINE", "0"))
given = json.loads(os.environ.pop("GS_TEST_RANKS_ENV", "null")) or [{}] * n
gc.freeze()  # the collector would touch, and so copy, every shared object in every rank


def rank_main(rank: int) -> None:
    """The child's side: identity, output, deadline, then the script."""
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank % per_host),
        "LOCAL_WORLD_SIZE": str(min(per_host, n - rank // per_host * per_host)),
        "GRADSYNC_HOSTNAME": f"h{rank // per_host}", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    os.environ.update(given[rank])
    rank = int(os.environ["RANK"])
    log = os.open(os.path.join(logs, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if deadline > 0:  # counted from this process's start, as the caller counts its own
        left = max(1.0, deadline - (time.monotonic() - started))
        os.environ["GS_TEST_DEADLINE"] = str(left)  # for the script's own common.py
        faulthandler.dump_traceback_later(left, exit=True)
    sys.argv = [script, *args]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        status = exc.code if isinstance(exc.code, int) else (exc.code is not None)
    except BaseException:  # reported in the rank's log, as an uncaught exception would be
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # never return into the parent's loop or run its exit handlers


children = {}
for r in range(n):
    pid = os.fork()
    if pid == 0:
        rank_main(r)
    children[pid] = int(given[r].get("RANK", r))
failed = False
while children:
    pid, status = os.wait()
    code = os.waitstatus_to_exitcode(status)
    failed |= code != 0
    print(f"EXIT rank={children.pop(pid)} status={code}", flush=True)
sys.exit(1 if failed else 0)
