"""An elastic job of many workers that loses one mid-step; recovery timed as the bench does.

    scale_elastic.py VICTIM AT

Run by tests/test_scale.py under ``gradsync run -np N --min-np 2 -H 127.0.0.1:4,...`` (hosts by
name: a failed worker's host leaves the job with it). Each step is one allreduce of 1,000 floats
(every worker contributes its first rank + 1); the state (``ObjectState``: the step and a
running total of the allreduces) is committed every 5 steps. Worker VICTIM (its first rank)
prints ``DYING wall=<time.time()>`` and SIGKILLs itself at step AT, after starting that step's
allreduce; every survivor rolls back to the last commit, the job re-forms without it, and each
survivor prints ``FIRSTSTEP wall=<time.time()>`` when its first step of the new generation
completes, as ``gradsync bench elastic`` measures recovery (from the victim's death to the last
survivor's first step). Each worker ends with ``RESULT id=<first rank> rank=<r> size=<n> gen=<g>
step=<s> total=<t>``; the totals follow from the steps in closed form, so all must agree.
"""

import os
import signal
import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
import gradsync.elastic as elastic
from gradsync.elastic import worker

victim, at = int(sys.argv[1]), int(sys.argv[2])
first = int(os.environ["GRADSYNC_RANK"])
gs.init()
state = elastic.ObjectState(gs.broadcast_object, gs.rank, step=0, total=0.0)
reset = {"pending": False}
state.register_reset_callbacks([lambda: reset.update(pending=True)])


@elastic.run
def train(state):
    while state.step < at + 10:
        contribution = np.full(1000, first + 1, dtype=np.float64)
        if first == victim and state.step == at:
            handle = gs.allreduce_async(contribution, op=gs.Sum, name="step")
            print(f"DYING wall={time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            gs.synchronize(handle)
        got = gs.allreduce(contribution, op=gs.Sum, name="step")
        state.total += float(got[0])
        state.step += 1
        if reset["pending"]:
            reset["pending"] = False
            print(f"FIRSTSTEP wall={time.time():.6f}", flush=True)
        if state.step % 5 == 0:
            state.commit()


train(state)
print(f"RESULT id={first} rank={gs.rank()} size={gs.size()} gen={worker.generation()} "
      f"step={state.step} total={state.total:.1f}", flush=True)
gs.shutdown()
