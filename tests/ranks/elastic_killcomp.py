"""Compression and DiLoCo in an elastic job: a worker killed mid-training, then one joining.

    elastic_killcomp.py MODE

MODE ``int8`` or ``powersgd``: a DistributedOptimizer whose two buckets (``groups=2``) are
reduced by that compressor, held in the ``TorchState`` (``compressor=``); ``diloco``: streaming
DiLoCo over the Horovod API (H = 8, 4 fragments landing a step after they start, int8 on the
outer gradient), held in the ``TorchState`` (``diloco=``) with the inner optimizer.

The job starts with 3 workers: localhost[0], localhost[1] and 127.0.0.1[2], the *victim*, on a
host of its own in the discovery file, so that after its death the launcher (with
``--blacklist-cooldown 0``) starts a new worker in its slot: 127.0.0.1[3], the *joiner*.

- int8, powersgd: the victim SIGKILLs itself inside the compressor, as the second bucket of
  the round of update KILL + 1 starts: the first bucket was reduced everywhere (the
  compressor's state moved on every rank) and no update was applied. The survivors fail in
  that round, go on from update KILL (no roll-back) and redo the round in flight.
- diloco: the victim SIGKILLs itself before step KILL's outer step (even: the others start a
  fragment's sync there that can never complete). The survivors fail at its landing (step
  KILL + 1), roll back to their save at step KILL - 1 (``state.save()`` at every step with no
  sync in flight) and redo steps KILL and KILL + 1: the fragment in flight.

At update (step) GROW every worker waits until the launcher has listed the joiner (it polls
the newest generation, with a deadline), then commits: ``HostsUpdatedInterrupt`` on every
rank, the joiner takes the state from a live peer, and all three train on to TOTAL.

Lines (a worker's state digest covers the compressor's whole state: residuals, PowerSGD's Q,
step counters; or DiLoCo's anchors, momenta, int8 residuals, step and syncs not landed):

RECOVERED id=<worker> gen=<g> size=<n> action=<plan> updates=<u> lost=<l> state=<digest now>
    before=<this worker's digest when it was at update u (``none``: it never was)>: each time
    ``train`` starts in a generation after the first (the joiner's plan fields are ``-``)
RESULT id=<worker> size=<n> updates=<applied> begun=<steps begun by this process>
    model=<parameters' digest> shared=<DiLoCo's anchors and momenta (``-``)>
    landed=<DiLoCo's landings, step:fragment,... (``-``)>
"""

import os
import signal
import sys
import time

import common  # deadline, and the job
import torch
import torch.nn.functional as F

import gradsync.torch as hvd
from gradsync.compress import DiLoCo, Int8, PowerSGD
from gradsync.elastic import worker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import digests  # noqa: E402  (tests/digests.py, which the test compares with)

MODE = sys.argv[1]
KILL, GROW, TOTAL = (10, 15, 24) if MODE == "diloco" else (5, 10, 16)
ME = os.environ["GRADSYNC_ELASTIC_ID"]
VICTIM = ME == "127.0.0.1[2]"
JOIN_DEADLINE = 90.0

torch.set_num_threads(1)
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
reduces = {"count": 0, "armed": False}


def killing(base):
    """``base`` (a compressor class) whose reduction SIGKILLs the victim when armed, at the
    second bucket of the round."""

    class Killing(base):
        def reduce(self, flat, shapes, comm, key, average):
            reduces["count"] += 1
            if reduces["armed"] and reduces["count"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().reduce(flat, shapes, comm, key, average)

    return Killing


if MODE == "diloco":
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = DiLoCo(model, inner, sync_every=8, fragments=4, delay=1, compressor=Int8(block=32),
                   comm="horovod", name="killcomp")
    state = hvd.elastic.TorchState(model, inner, diloco=outer)
else:
    compressor = (killing(Int8)(block=16) if MODE == "int8" else
                  killing(PowerSGD)(rank=2, min_compression_rate=1.0))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(),
                                         compression=compressor, groups=2)
    state = hvd.elastic.TorchState(model, optimizer, compressor=compressor)


def digest(values) -> str:
    """A short hash of nested dicts and lists of tensors and numbers (tests/digests.py)."""
    return digests.digest(values, 16)


def state_digest() -> str:
    if MODE == "diloco":
        s = outer.state_dict()
        return digest([s["step"], s["anchors"], s["momenta"], s["pending"], s["compressor"]])
    return digest(compressor.state_dict())


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(8, 16, generator=g)
    return x, torch.sin(x[:, :4] * 2.0)


def wait_for_joiner() -> None:
    """Polls until the launcher has formed the generation that lists the joiner."""
    deadline = time.monotonic() + JOIN_DEADLINE
    while not worker.newer_generation():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ME}: no new generation within {JOIN_DEADLINE} s")
        time.sleep(0.02)


begun = 0
after = {}  # update (step) -> this worker's state digest there


def compressed_steps() -> None:
    global begun
    while state.applied_updates() < TOTAL:
        u = state.applied_updates()
        begun += 1
        reduces["count"], reduces["armed"] = 0, VICTIM and u == KILL
        x, y = batch(u)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        after[u + 1] = state_digest()
        if u + 1 == GROW and hvd.size() < 3:
            wait_for_joiner()
            state.commit()


def diloco_steps() -> None:
    global begun
    while outer.step_count < TOTAL:
        t = outer.step_count
        begun += 1
        x, y = batch(t)
        outer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if VICTIM and t == KILL - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before it starts step KILL's sync
        outer.step()
        if not outer.pending:  # no sync in flight: a point to roll back to
            after[outer.step_count] = state_digest()
            if outer.step_count == GROW and hvd.size() < 3:
                wait_for_joiner()
                state.commit()
            else:
                state.save()


@hvd.elastic.run
def train(state):
    gen, rec = worker.generation(), state.last_recovery
    if gen > 0:  # a survivor's recovery, or the joiner's start (no plan: it had no state)
        plan = rec.plan if rec is not None and rec.generation == gen else None
        print(f"RECOVERED id={ME} gen={gen} size={hvd.size()} "
              f"action={plan.action if plan else '-'} updates={plan.updates if plan else '-'} "
              f"lost={plan.lost if plan else '-'} state={state_digest()} "
              f"before={after.get(plan.updates, 'none') if plan else 'none'}", flush=True)
    (diloco_steps if MODE == "diloco" else compressed_steps)()


train(state)
shared, landed = "-", "-"
if MODE == "diloco":
    outer.finish()
    shared = digest([outer.anchors, outer.momenta])
    landed = ",".join(f"{step}:{fragment}" for step, fragment in outer.landed)
print(f"RESULT id={ME} size={hvd.size()} updates={state.applied_updates()} begun={begun} "
      f"model={common.digest(model)} shared={shared} landed={landed}", flush=True)
