"""One epoch of elastic training, a worker lost mid-step, checked against a replay.

    elastic_redo.py MODE VICTIM AT FIRST

MODE: redo (worker VICTIM SIGKILLs itself after the forward of the step that would be update
AT + 1: the others wait in that step's gradient allreduce, never completed), ahead (the step
after AT updates is synchronized on every worker, then VICTIM dies; worker 1 applies it, the
others fail inside ``optimizer.step()`` before applying it, in a collective of a step
pre-hook: the survivors differ by one update), metric (VICTIM dies after update AT + 1; the
others fail in an allreduce of their own between that update and ``record_batch``: no resume
point), stale (fencing: VICTIM SIGSTOPs itself after the forward of the step after AT updates
and is SIGCONTed once the others went on without it, as the survivors' generation begins its
collectives (``wake_once_gone_on``). The launcher's process for VICTIM is only a parent that
waits for the worker, which runs in a session of its own, so the launcher's SIGKILL for a
silent worker reaches the parent only: as
a kill that cannot arrive (a partitioned host). The woken worker prints and writes to
$STALE_MARK ``EXCLUDED <its error>``; the survivors run collectives (no state) until that
file exists, then train on), partition (as stale, but VICTIM runs on a host of its own, a
network namespace, and cuts its link instead of stopping: ``ip link set $PART_DEV down`` at
the same point, up again with its default route via $PART_GW at the same moment as stale's
SIGCONT; it goes on running meanwhile). VICTIM: the worker's first rank. No commit is
ever made: the only save is the TorchState's at its construction.

FIRST: the run the job must equal is FIRST updates at size 4, then the rest of the epoch at
size 3 (``ElasticSampler``'s split). Each worker replays it in one process (SGD on
the mean of every rank's batch gradient: the DistributedOptimizer's average) and prints

RESULT id=<worker> size=<n> updates=<u> hash=<parameters' digest> refdiff=<max |p - ref|>
PLAN action=<go_on|rollback> updates=<u> lost=<l>: the recovery's plan (survivors).
$ELASTIC_ROLLBACK (default auto): the state's ``rollback``.
"""

import os
import signal
import subprocess
import sys
import time
import types

import common  # deadline, and the job
import torch

import gradsync.torch as hvd
from gradsync.elastic import worker
from gradsync.torch.elastic import sampler as sampler_module

mode, victim, at, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
first_rank = int(os.environ["GRADSYNC_RANK"])
me = first_rank == victim
BATCH, LR = 4, 0.05
if mode == "stale" and me and "STALE_CHILD" not in os.environ:
    worker_process = subprocess.Popen([sys.executable, *sys.argv], start_new_session=True,
                                      env={**os.environ, "STALE_CHILD": "1"})
    sys.exit(worker_process.wait())

torch.manual_seed(1234 + first_rank)  # every worker starts different: the first sync fixes it
hvd.init()
dataset, model, optimizer, state = common.elastic_job(
    hvd, features=8, samples=96, target=torch.sin,
    optimizer=lambda params: torch.optim.SGD(params, lr=LR), batch_size=BATCH, seed=7)
state.rollback = os.environ.get("ELASTIC_ROLLBACK", "auto")
probe = {"armed": False}


def probe_hook(opt, args, kwargs):
    """Fails (the victim is dead) inside optimizer.step(), before the update."""
    if probe["armed"]:
        probe["armed"] = False
        hvd.allreduce(torch.zeros(1), name="elastic_redo.probe")


optimizer.register_step_pre_hook(probe_hook)
GONE_ON = os.environ.get("STALE_MARK", "") + ".gone-on"


def wake_once_gone_on(command: str) -> None:
    """(stale, partition.) Runs shell ``command``, which wakes this worker or joins its host
    again, once the survivors have gone on without it: rank 0 of the next generation makes the
    file GONE_ON as they begin their collectives (polled every 0.1 s; after 60 s without it,
    the command runs anyway and the test fails on what follows). A fixed delay (8 and 10 s
    until 2026-11-30) had to cover the heartbeat's timeout and the re-formation on a loaded
    machine, and was idle time on every other. The poll runs in a session of its own: it
    outlives the launcher's kill, which reaches only this worker's parent or ssh."""
    wait = (f'i=0; while [ ! -e "{GONE_ON}" ] && [ $i -lt 600 ]; do sleep 0.1; '
            f'i=$((i + 1)); done; ')
    subprocess.Popen(["sh", "-c", wait + command], start_new_session=True)


@hvd.elastic.run
def train(state):
    rec = state.last_recovery
    if rec is not None and rec.generation == worker.generation():
        print(f"PLAN action={rec.plan.action} updates={rec.plan.updates} "
              f"lost={rec.plan.lost}", flush=True)
    if mode in ("stale", "partition") and worker.generation() > 0:
        # collectives in flight while the stale worker wakes up; rank 0 decides when to stop
        if hvd.rank() == 0:
            open(GONE_ON, "w").close()  # the stale worker may wake now (wake_once_gone_on)
        deadline = time.monotonic() + 60
        while not hvd.broadcast_object(os.path.exists(os.environ["STALE_MARK"]) or
                                       time.monotonic() > deadline, 0, name="stale.done"):
            hvd.allreduce(torch.ones(1000), name="stale.tick")
            time.sleep(0.1)
        print(f"FENCED wall={time.time():.6f}", flush=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=state.sampler)
    for batch, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        if me and mode == "stale" and state.applied_updates() == at:
            wake_once_gone_on(f"kill -CONT {os.getpid()}")
            os.kill(os.getpid(), signal.SIGSTOP)
            print(f"WOKE wall={time.time():.6f}", flush=True)
        if me and mode == "partition" and state.applied_updates() == at:
            dev, gateway = os.environ["PART_DEV"], os.environ["PART_GW"]
            subprocess.run(["ip", "link", "set", dev, "down"], check=True)
            wake_once_gone_on(f"ip link set {dev} up; ip route replace default via {gateway}")
            print(f"CUT wall={time.time():.6f}", flush=True)
        if me and mode == "redo" and state.applied_updates() == at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if mode == "ahead" and state.applied_updates() == at and hvd.size() == 4:
            optimizer.synchronize()  # the allreduce completes on every worker
            if me:
                os.kill(os.getpid(), signal.SIGKILL)
            probe["armed"] = first_rank != 1
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        if mode == "metric" and state.applied_updates() == at + 1 and hvd.size() == 4:
            if me:
                os.kill(os.getpid(), signal.SIGKILL)
            # a collective between the update and its bookkeeping: no resume point
            hvd.allreduce(loss.detach(), name="elastic_redo.metric")
        state.sampler.record_batch(batch, BATCH)


def replay(first: int) -> torch.nn.Module:
    """The job's run in one process: ``first`` updates at size 4, the rest at size 3."""
    torch.manual_seed(1234)  # worker 0's model, which the first sync gave everyone
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    sgd = torch.optim.SGD(ref.parameters(), lr=LR)
    sampler = hvd.elastic.ElasticSampler(dataset, batch_size=BATCH, seed=7)
    real = sampler_module.gs
    try:
        for size, steps in ((4, first), (3, None)):
            per_rank = []
            for r in range(size):
                sampler_module.gs = types.SimpleNamespace(
                    rank=lambda r=r: r, size=lambda size=size: size, is_initialized=lambda: True)
                mine = list(sampler)
                per_rank.append([mine[i:i + BATCH] for i in range(0, len(mine), BATCH)])
            count = len(per_rank[0]) if steps is None else steps
            for k in range(count):
                sgd.zero_grad()
                for r in range(size):
                    x, y = dataset[per_rank[r][k]]
                    (torch.nn.functional.mse_loss(ref(x), y) / size).backward()
                sgd.step()
                sampler.record_batch(k, BATCH)
    finally:
        sampler_module.gs = real
    return ref


try:
    train(state)
except hvd.elastic.ExcludedError as exc:
    with open(os.environ["STALE_MARK"], "w") as mark:
        mark.write(f"EXCLUDED {exc}\n")
    print(f"EXCLUDED wall={time.time():.6f} {exc}", flush=True)
    sys.exit(3)
ref = replay(first)
diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
print(f"RESULT id={os.environ['GRADSYNC_ELASTIC_ID']} size={hvd.size()} "
      f"updates={state.applied_updates()} hash={common.digest(model)} refdiff={diff:.3g}",
      flush=True)
