"""An elastic script under torchrun: a worker dies, torchrun restarts the group, it resumes.

    elastic_torchrun.py CHECKPOINT VICTIM EPOCHS

Rank 0 saves the committed state to CHECKPOINT at the end of every epoch; every attempt starts
from that file if it exists. In torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0) rank
VICTIM SIGKILLs itself in the middle of epoch 2, its gradients in flight. There is no in-place
re-formation under torchrun: ``hvd.elastic.run`` re-raises the lost peer, the ranks exit and
torchrun restarts the whole group.

RESUMED restart=<n> rank=<r> epoch=<e>: where an attempt starts.
RESULT restart=<n> rank=<r> size=<s> epoch=<e> hash=<parameters' digest>: at the end.
"""

import os
import signal
import sys

import common  # deadline, and the job
import torch

import gradsync.torch as hvd

checkpoint, victim, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
hvd.init()
torch.manual_seed(99 + hvd.rank() + 10 * restart)  # different on every rank: sync must fix it
BATCH = 4
dataset, model, optimizer, state = common.elastic_job(
    hvd, features=4, samples=48, target=torch.cos,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05), batch_size=BATCH, seed=3,
    epoch=0)
if os.path.exists(checkpoint):
    saved = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(saved["model"])
    state.epoch = saved["epoch"]
    state.sampler.set_epoch(state.epoch)
    state.save()
print(f"RESUMED restart={restart} rank={hvd.rank()} epoch={state.epoch}", flush=True)


@hvd.elastic.run
def train(state):
    while state.epoch < epochs:
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=state.sampler)
        for batch, (xb, yb) in enumerate(loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if restart == 0 and hvd.rank() == victim and state.epoch == 2 and batch == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.sampler.record_batch(batch, BATCH)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "epoch": state.epoch}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)


train(state)
print(f"RESULT restart={restart} rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} "
      f"hash={common.digest(model)}", flush=True)
