"""Data servers in an elastic job: ``data_elastic.py MODE EPOCHS [VICTIM AT]``.

Every rank runs this script under ``gradsync run -np W --min-np m --data-servers D``; the
data servers serve inside ``gradsync.data.Loader``. The workers train a *counter*: one float64
parameter per sample, and each step's gradient is -1 at the ids of the worker's batch,
summed over the workers (``op=hvd.Sum``) and applied by SGD with learning rate 1. So the
parameters count how often each sample has been trained on: the job's surviving history,
with every roll-back (the model rolls back too) and every step redone. A run where every
sample is trained exactly once per epoch ends with every count equal to EPOCHS.

The Loader is part of the elastic state (``TorchState(model, optimizer, loader=loader)``);
a commit every 4 steps. Every worker takes as many steps as the worker with the most batches
of the (rest of the) epoch: one with fewer steps with a zero gradient, so that the steps stay
in lockstep without ``hvd.join()``.

MODE: fixed (no failure); kill (the worker whose first rank is VICTIM SIGKILLs itself after
the forward of step AT + 1 of generation 0: the others wait in that step's gradient
allreduce); killserver (the worker whose first rank is VICTIM SIGKILLs data server 0 in step
AT + 1); both (a data server and a worker lost in the same epoch: the worker whose first rank
is VICTIM SIGKILLs data server 0 in step AT + 1 and finds it lost at once, by ``stats()``,
while the others still read the batches it had published; then itself in step AT + 4 of
generation 0); workerfirst (the same two losses the other way round: the worker whose first
rank is VICTIM SIGKILLs itself in step AT + 1 of generation 0, then rank 0 of the next
generation SIGKILLs data server 0 in step AT + 4, the same epoch); stopboth (as both, with
data server 0 SIGSTOPped, not killed: the worker gives it up at once, as its liveness watch
would after the heartbeat timeout, and no survivor can see it gone; rank 0 of the next
generation SIGCONTs it once the recovery is done, so that it ends when told); join (worker 0 appends
$GROW_HOST, default ``127.0.0.1:1``, to $HOSTS_FILE after step AT of generation 0: the
launcher starts a new worker there; worker 0 holds the next commit until the launcher has
listed it, so it joins there).
killgrow (killserver, then a new worker served by data server 0's replacement: after step
AT + 1 the worker that killed it waits until the launcher's replacement has published its
address, then appends $GROW_HOST to $HOSTS_FILE and holds the next commit, as join does).
return (the worker whose first rank is VICTIM SIGKILLs data server 0 in step AT + 1, finds it
lost at once by ``stats()``, and holds that step until the launcher's replacement has written
its ready record: the next commit's gather agrees that it serves every worker from the next
epoch on).
$ELASTIC_ROLLBACK (default auto): the state's ``rollback``.

Every rank first prints ``HOST rank=<launch rank> host=<GRADSYNC_HOSTNAME>``: where the
launcher started it (the data servers' too).

Lines: ``TRAINED id=<worker> gen=<g> epoch=<e> ids=<i,j,...>`` after each applied update
that used a batch; ``PLAN action=<go_on|rollback|start> updates=<u>`` after a recovery;
``FROM0 id=<worker> incarnation=<k> items=<n> planned=<m>`` at the end: which process of data
server 0 the worker is connected to, the batches it took from that process, and its batches
of data server 0 in the last epoch's plan; ``RESULT id=<worker> size=<n> gen=<g> low=<min count> high=<max count> total=<sum>
lost=<data servers this worker lost, a,b,...>`` at the end.
"""

import common  # noqa: F401  (deadline)

import os
import signal
import sys
import time

import torch

import gradsync.data
import gradsync.torch as hvd
from gradsync.data.plan import plan, worker_batches
from gradsync.data.returns import read_ready, ready_key
from gradsync.elastic import worker
from gradsync.errors import PeerLostError

# The dataset and its transform are data_check.py's (its closed form: sample i is [i, i, i]).
from data_check import BATCH, SAMPLES, SEED, Numbers, augment  # noqa: E402

EVERY = 4
mode, epochs = sys.argv[1], int(sys.argv[2])
victim = int(sys.argv[3]) if len(sys.argv) > 3 else -1
at = int(sys.argv[4]) if len(sys.argv) > 4 else -1


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(SAMPLES, dtype=torch.float64))


print(f"HOST rank={os.environ['GRADSYNC_RANK']} host={os.environ['GRADSYNC_HOSTNAME']}",
      flush=True)
loader = gradsync.data.Loader(Numbers(), batch_size=BATCH, transform=augment, seed=SEED)
hvd.init()
name = os.environ["GRADSYNC_ELASTIC_ID"]
me = int(os.environ["GRADSYNC_RANK"]) == victim
model = Counter()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                     named_parameters=model.named_parameters(), op=hvd.Sum)
state = hvd.elastic.TorchState(model, optimizer, loader=loader, steps=0)
state.rollback = os.environ.get("ELASTIC_ROLLBACK", "auto")


def wait_for_the_new_worker() -> None:
    """Holds the commit that follows the new host until the launcher has listed the new
    worker (it starts in seconds, the job's steps take milliseconds): so it joins at that
    commit and takes a share of epoch 0. Rank 0 alone decides (``check_host_updates``)."""
    deadline = time.monotonic() + 120
    while hvd.rank() == 0 and not worker.newer_generation() and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_for_the_replacement() -> None:
    """Holds this step until the launcher's replacement for the killed data server 0 has
    published its address in place of the old one's (it starts in seconds): a worker that
    starts after that connects to it."""
    deadline = time.monotonic() + 120
    while loader._losses.get("data/server/0") == killed and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_for_the_return() -> None:
    """Holds this step until data server 0's replacement has written its ready record (the
    launcher starts it in seconds): the worker that does not use server 0 then reports it at
    the next commit."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            loader._losses.check(ready_key(0))
            and read_ready(loader._losses.get(ready_key(0)))[0] > 1):
        time.sleep(0.05)


@hvd.elastic.run
def train(state):
    global killed
    rec = state.last_recovery
    if rec is not None and rec.generation == worker.generation():
        print(f"PLAN action={rec.plan.action} updates={rec.plan.updates}", flush=True)
        if mode == "stopboth" and hvd.rank() == 0:
            os.kill(loader.peers[0].pid, signal.SIGCONT)  # given up by now: it may end
    while loader.epoch < epochs:
        epoch = loader.epoch
        steps = max(loader.lengths())  # of the epoch's rest, for this generation
        mine = len(loader)
        batches = iter(loader)
        for k in range(steps):
            batch = next(batches) if k < mine else None
            optimizer.zero_grad()
            if batch is not None:
                ids = batch["id"]
                assert ids.tolist() == loader.ids.tolist()
                loss = -model.counts[ids].sum()
            else:
                loss = model.counts.sum() * 0.0
            if me and mode == "kill" and worker.generation() == 0 and state.steps == at:
                os.kill(os.getpid(), signal.SIGKILL)
            if me and mode in ("killserver", "killgrow") and state.steps == at and \
                    0 not in loader.lost:
                killed = loader._losses.get("data/server/0")  # its published address
                os.kill(loader.peers[0].pid, signal.SIGKILL)
            if me and mode == "return" and state.steps == at and 0 not in loader.lost:
                os.kill(loader.peers[0].pid, signal.SIGKILL)
                while 0 not in loader.lost:  # found at once by this worker's stats()
                    loader.stats()
                wait_for_the_return()
            if me and mode == "both" and worker.generation() == 0:
                if state.steps == at and 0 not in loader.lost:
                    os.kill(loader.peers[0].pid, signal.SIGKILL)
                    while 0 not in loader.lost:  # found at once by this worker's stats()
                        loader.stats()
                if state.steps == at + 3:
                    os.kill(os.getpid(), signal.SIGKILL)
            if me and mode == "stopboth" and worker.generation() == 0:
                if state.steps == at and 0 not in loader.lost:
                    os.kill(loader.peers[0].pid, signal.SIGSTOP)
                    loader._lose(0, PeerLostError("SIGSTOPped: found silent"))
                if state.steps == at + 3:
                    os.kill(os.getpid(), signal.SIGKILL)
            if mode == "workerfirst":
                if me and worker.generation() == 0 and state.steps == at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if worker.generation() > 0 and hvd.rank() == 0 and state.steps == at + 3 \
                        and 0 not in loader.lost:
                    os.kill(loader.peers[0].pid, signal.SIGKILL)
            loss.backward()
            optimizer.step()
            state.steps += 1
            if batch is not None:
                print(f"TRAINED id={name} gen={worker.generation()} epoch={epoch} "
                      f"ids={','.join(map(str, ids.tolist()))}", flush=True)
            grow = mode == "join" and state.steps == at and hvd.rank() == 0
            if me and mode == "killgrow" and state.steps == at + 1:
                wait_for_the_replacement()
                grow = True
            if grow and worker.generation() == 0:
                with open(os.environ["HOSTS_FILE"], "a") as hosts:
                    hosts.write(os.environ.get("GROW_HOST", "127.0.0.1:1") + "\n")
            if state.steps % EVERY == 0:
                if mode in ("join", "killgrow") and state.steps > at and \
                        worker.generation() == 0:
                    wait_for_the_new_worker()
                state.commit()
        for extra in batches:  # ends the epoch: its last batch is delivered
            raise AssertionError(f"a batch beyond this worker's {mine} of the epoch")


killed = None  # data server 0's published address, once this worker has killed it
train(state)
counts = model.counts.detach()
last = worker_batches(plan(SAMPLES, BATCH, SEED, epochs - 1, loader.servers, hvd.size()),
                      hvd.rank(), 0)
print(f"FROM0 id={name} incarnation={loader.incarnations[0]} items={loader._seq[0]} "
      f"planned={len(last)}", flush=True)
print(f"RESULT id={name} size={hvd.size()} gen={worker.generation()} "
      f"low={counts.min().item():g} high={counts.max().item():g} "
      f"total={counts.sum().item():g} lost={','.join(map(str, sorted(loader.lost)))}",
      flush=True)
loader.close()
