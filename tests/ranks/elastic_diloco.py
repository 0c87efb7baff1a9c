"""Streaming DiLoCo in an elastic job: a worker killed while a fragment's sync is in flight.

    elastic_diloco.py VICTIM KILL_AT

3 workers under ``gradsync run --min-np 2``; each trains the same tiny model on batches of
its own (fixed by rank and step) with a ``DiLoCo`` over the Horovod API: H = 8 inner steps,
4 fragments (started at steps 2, 4, 6, 8 of each window, each landing a step later), int8 on
the outer gradient. The elastic ``TorchState`` holds the model, the inner optimizer and the
DiLoCo (its handler: anchors, momentum, int8 residuals, the step counter, the syncs not yet
landed); the script commits whenever no sync is in flight (odd steps).

The worker whose first rank is VICTIM SIGKILLs itself just before step KILL_AT's outer
step (an even step: the others start a fragment's sync there, which can never complete).
The others fail at that sync's landing, step KILL_AT + 1; they roll back to their commit of
step KILL_AT - 1 (the inner steps of the window up to there are kept), re-form at size 2,
take rank 0's state and go on to step TOTAL. Each survivor prints

RECOVERED id=<worker> step=<the step it went on from> outer=<digest of the whole outer state>
RESULT id=<worker> size=<n> step=<final step> outer=<digest of anchors and momenta>
PLAN action=<...> updates=<u> lost=<l>
"""

import hashlib
import os
import signal
import sys

import common  # noqa: F401  (deadline, and the job)
import torch
import torch.nn.functional as F

import gradsync.torch as hvd
from gradsync.compress import DiLoCo, Int8
from gradsync.elastic import worker

victim, kill_at = int(sys.argv[1]), int(sys.argv[2])
first_rank = int(os.environ["GRADSYNC_RANK"])
me = first_rank == victim
TOTAL = 24

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8),
                            torch.nn.Tanh(), torch.nn.Linear(8, 1))
inner = torch.optim.SGD(model.parameters(), lr=0.05)
outer = DiLoCo(model, inner, sync_every=8, fragments=4, delay=1, compressor=Int8(block=32),
               comm="horovod", name="elastic_diloco")
state = hvd.elastic.TorchState(model, inner, diloco=outer)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def whole_state() -> list:
    s = outer.state_dict()
    residuals = [t for _, held in sorted(s["compressor"]["state"]["tensors"].items())
                 for _, t in sorted(held.items())]
    pending = [p["delta"] for p in s["pending"]]
    return s["anchors"] + s["momenta"] + residuals + pending + [torch.tensor([s["step"]])]


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * first_rank + step)
    x = torch.randn(8, 6, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


@hvd.elastic.run
def train(state):
    rec = state.last_recovery
    if rec is not None and rec.generation == worker.generation():
        print(f"PLAN action={rec.plan.action} updates={rec.plan.updates} "
              f"lost={rec.plan.lost}", flush=True)
        print(f"RECOVERED id={os.environ['GRADSYNC_ELASTIC_ID']} step={outer.step_count} "
              f"outer={digest(whole_state())}", flush=True)
    while outer.step_count < TOTAL:
        x, y = batch(outer.step_count)
        outer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if me and outer.step_count == kill_at - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before it starts step KILL_AT's sync
        outer.step()
        if not outer.pending:
            state.commit()


train(state)
outer.finish()
print(f"RESULT id={os.environ['GRADSYNC_ELASTIC_ID']} size={hvd.size()} "
      f"step={outer.step_count} outer={digest(outer.anchors + outer.momenta)}", flush=True)
