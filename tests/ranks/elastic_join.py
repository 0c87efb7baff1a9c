"""An elastic job that a new worker joins while it trains; the new worker is slow to start,
dies before joining, or never becomes ready.

    elastic_join.py MODE [STEPS]

The job starts on the hosts of the discovery file $HOSTS_FILE; worker 0 appends $GROW_HOST
(default ``127.0.0.1:1``; several hosts separated by commas) to it at step 5, so the launcher
starts a new worker there. The new worker (the one whose host is not the first worker's),
before ``hvd.init()``:

- MODE slow: sleeps $JOIN_SLEEP seconds (default 5), as a worker whose start is slow;
- MODE die: exits with status 1;
- MODE hang: sleeps for good (the launcher's ready timeout must end it);
- MODE diehang: both in one job: the new worker on host 127.0.0.1 dies, any other hangs (run
  with ``GROW_HOST=127.0.0.1:1,127.0.0.2:1``, so that two new workers start at once).

Training (20 ms of emulated compute a step, a commit every 5 steps) ends when the job has had
3 workers for 10 steps (MODE slow), or after STEPS steps (default 150: die, hang).

Lines: ``JOINER start wall=<t>`` and ``JOINER ready wall=<t>`` (the new worker, before and
after its slow part), ``STEP id=<worker> gen=<g> size=<n> steps=<s> wall=<t>`` after every
step, and ``RESULT id=<worker> rank=<r> size=<n> gen=<g> steps=<s> hash=<digest>`` at the end.
"""

import os
import sys
import time

joiner = os.environ["GRADSYNC_HOSTNAME"] != os.environ.get("FIRST_HOST", "localhost")
mode = sys.argv[1]
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 150
if joiner:
    print(f"JOINER start wall={time.time():.6f}", flush=True)
    if mode == "diehang":
        mode = "die" if os.environ["GRADSYNC_HOSTNAME"] == "127.0.0.1" else "hang"
    if mode == "die":
        sys.exit(1)
    time.sleep(float(os.environ.get("JOIN_SLEEP", "5")) if mode == "slow" else 3600)

import common  # noqa: E402  (deadline; after the joiner's start, to keep a dying one quick)
import torch  # noqa: E402

import gradsync.torch as hvd  # noqa: E402
from gradsync.elastic import worker  # noqa: E402

if joiner:
    print(f"JOINER ready wall={time.time():.6f}", flush=True)
hvd.init()
name = os.environ["GRADSYNC_ELASTIC_ID"]
dataset, model, optimizer, state = common.elastic_job(
    hvd, features=8, samples=96, target=torch.sin,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01), batch_size=4, seed=7,
    steps=0, grown=0)


@hvd.elastic.run
def train(state):
    while True:
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=state.sampler)
        for batch, (xb, yb) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()
            time.sleep(0.02)
            state.steps += 1
            state.grown += hvd.size() == 3
            state.sampler.record_batch(batch, 4)
            print(f"STEP id={name} gen={worker.generation()} size={hvd.size()} "
                  f"steps={state.steps} wall={time.time():.6f}", flush=True)
            if state.steps == 5 and hvd.rank() == 0 and worker.generation() == 0:
                with open(os.environ["HOSTS_FILE"], "a") as hosts:
                    hosts.write(os.environ.get("GROW_HOST", "127.0.0.1:1").replace(",", "\n")
                                + "\n")
            if (mode == "slow" and state.grown >= 10) or (mode != "slow" and
                                                          state.steps >= limit):
                return
            if state.steps % 5 == 0:
                state.commit()
        state.sampler.set_epoch(state.sampler.epoch + 1)


train(state)
print(f"RESULT id={name} rank={hvd.rank()} size={hvd.size()} gen={worker.generation()} "
      f"steps={state.steps} hash={common.digest(model)}", flush=True)
