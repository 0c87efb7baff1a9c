"""An elastic training job with a fault injected; each worker prints one RESULT line at the end.

    elastic_train.py MODE VICTIM AT [EPOCHS]

MODE: none, kill (SIGKILL in the middle of a step: gradients in flight), raise (an exception
in the training code), stop (SIGSTOP), kill-sync (VICTIM is killed mid-step as in kill, then
worker VICTIM+1 SIGKILLs itself inside state.sync() of generation 1), kill-commit (SIGKILL
inside commit()), grow (the worker adds $GROW_HOST (default 127.0.0.1:1) to the discovery file
$HOSTS_FILE and training goes on until the job has one more worker), kill-grow (kill, then
worker 0 adds $GROW_HOST at step AT + 4 as in grow), shrink (worker 0 rewrites
$HOSTS_FILE as the lines of $SHRINK_HOSTS, separated by commas, at step AT and training goes
on until the job is smaller), die-all (every worker but VICTIM exits,
to fall below --min-np), interrupt (at step AT of generation 0 the worker adds $GROW_HOST to
$HOSTS_FILE as in grow, waits for the launcher's next generation and raises
HostsUpdatedInterrupt instead of starting the step's allreduces, as check_host_updates does on
a rank that learns of a newer generation while its peers still wait in an allreduce: its
re-formation abandons the generation under them).
VICTIM: the worker's first rank (GRADSYNC_RANK at its start); AT: the global step it acts at.

RESULT id=<worker> rank=<r> size=<n> gen=<g> steps=<global steps> hash=<parameters' digest>
START id=<worker> gen=<g> rank=<r> steps=<s> epoch=<e> committed=<c> pid=<p>: each
generation's start, after sync(); c is the steps value of this worker's last commit() (-1:
none yet); p the worker's process id.
LOST wall=<time.time()>: when a survivor caught the lost peer it recovered from (printed at
the next START; ``state.last_recovery.failed``).
PLAN action=<go_on|rollback> updates=<u> lost=<l>: the recovery's plan (printed at START).
$ELASTIC_ROLLBACK (default auto): the state's ``rollback``. $TRAIN_UNTIL_SIZE: see below.
FIRSTSTEP wall=<time.time()>: the first completed step after a re-formation.
DYING wall=<time.time()>: the victim, just before it fails.
PRELOADED dynamo=<bool>: at the start, whether ``torch._dynamo`` (what torch's first optimizer
imports) was there before the script built one: an elastic job's template preloads it.
"""

import os
import signal
import sys
import time

import common  # deadline, and the job
import torch

import gradsync.torch as hvd
from gradsync.elastic import worker
from gradsync.elastic.state import HostsUpdatedInterrupt

print(f"PRELOADED dynamo={'torch._dynamo' in sys.modules}", flush=True)
mode, victim, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
first_rank = int(os.environ["GRADSYNC_RANK"])
me = first_rank == victim

torch.manual_seed(1234 + first_rank)  # every worker starts different: sync must fix that
hvd.init()
BATCH = 4
dataset, model, optimizer, state = common.elastic_job(
    hvd, features=8, samples=96, target=torch.sin,
    optimizer=lambda params: torch.optim.Adam(params, lr=0.01), batch_size=BATCH, seed=7,
    epoch=0, batch=0, steps=0, shrink_below=0,
    # $TRAIN_UNTIL_SIZE: training goes on past the epochs until the job has that many workers
    # (a replacement started after a loss has joined)
    grow_to=int(os.environ.get("TRAIN_UNTIL_SIZE", "0")))
recovered = {"pending": False}


def on_reset():
    recovered["pending"] = True


state.register_reset_callbacks([on_reset])


def die(how):
    print(f"DYING wall={time.time():.6f}", flush=True)
    if how == "raise":
        raise RuntimeError(f"worker {first_rank} fails on purpose")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


committed = {"steps": -1}
_commit = state.commit


def recording_commit():
    committed["steps"] = state.steps
    _commit()


state.commit = recording_commit
state.rollback = os.environ.get("ELASTIC_ROLLBACK", "auto")
if mode == "kill-sync" and first_rank == victim + 1:
    original, original_from = state.sync, state.sync_from

    def sync():
        if worker.generation() == 1:
            die("kill")
        original()

    def sync_from(root):
        if worker.generation() == 1:
            die("kill")
        original_from(root)

    state.sync, state.sync_from = sync, sync_from
if mode == "kill-commit" and me:
    original_commit = state.commit

    def commit():
        if state.steps >= at:
            state.save()
            die("kill")
        original_commit()

    state.commit = commit


@hvd.elastic.run
def train(state):
    print(f"START id={os.environ['GRADSYNC_ELASTIC_ID']} gen={worker.generation()} "
          f"rank={hvd.rank()} steps={state.steps} epoch={state.epoch} "
          f"committed={committed['steps']} pid={os.getpid()}", flush=True)
    if state.last_recovery is not None and state.last_recovery.generation == worker.generation():
        plan = state.last_recovery.plan
        print(f"LOST wall={state.last_recovery.failed:.6f}", flush=True)
        print(f"PLAN action={plan.action} updates={plan.updates} lost={plan.lost}", flush=True)
    while state.epoch < epochs or hvd.size() < state.grow_to or \
            hvd.size() >= state.shrink_below > 0:
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=state.sampler)
        for batch, (xb, yb) in enumerate(loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            if me and state.steps == at and mode == "interrupt" and worker.generation() == 0:
                with open(os.environ["HOSTS_FILE"], "a") as hosts:
                    hosts.write(os.environ.get("GROW_HOST", "127.0.0.1:1") + "\n")
                while not worker.newer_generation():
                    time.sleep(0.05)  # (the test's deadline bounds it)
                raise HostsUpdatedInterrupt(False)
            if me and state.steps == at and mode in ("kill", "raise", "stop", "kill-sync",
                                                     "kill-grow"):
                loss.backward()  # the hooks have launched the allreduces: die with them in flight
                die(mode if mode in ("raise", "stop") else "kill")
            loss.backward()
            optimizer.step()
            state.steps += 1
            if recovered["pending"]:
                recovered["pending"] = False
                print(f"FIRSTSTEP wall={time.time():.6f} size={hvd.size()}", flush=True)
            state.sampler.record_batch(batch, BATCH)
            state.batch = batch
            grow_at = at + 4 if mode == "kill-grow" else at
            grower = me if mode == "grow" else first_rank == 0
            if mode in ("grow", "kill-grow") and grower and state.steps == grow_at:
                with open(os.environ["HOSTS_FILE"], "a") as hosts:
                    hosts.write(os.environ.get("GROW_HOST", "127.0.0.1:1") + "\n")
            if mode in ("grow", "kill-grow") and state.steps == grow_at:
                state.grow_to = hvd.size() + 1  # train until the new worker has joined
            if mode == "shrink" and state.steps == at and state.shrink_below == 0:
                if first_rank == 0:
                    fresh = os.environ["HOSTS_FILE"] + ".new"
                    with open(fresh, "w") as hosts:
                        hosts.write(os.environ["SHRINK_HOSTS"].replace(",", "\n") + "\n")
                    os.replace(fresh, os.environ["HOSTS_FILE"])
                state.shrink_below = hvd.size()  # train until the job is smaller
            if mode == "die-all" and state.steps == at and not me:
                print(f"DYING wall={time.time():.6f}", flush=True)
                os._exit(3)
            if state.steps % 2 == 0:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.batch = 0
        state.commit()


train(state)
print(f"RESULT id={os.environ['GRADSYNC_ELASTIC_ID']} rank={hvd.rank()} size={hvd.size()} "
      f"gen={worker.generation()} steps={state.steps} hash={common.digest(model)}",
      flush=True)
