"""Data servers in an elastic job: a worker is killed mid-epoch and the others train on, fed
by the same data servers, without a lost or repeated image.

    gradsync run -np 3 --min-np 2 --data-servers 2 python examples/data_servers_elastic.py \\
        --kill-rank 2 --kill-step 20

The model, data, augmentation and test are examples/data_servers.py's. The training loop is
Horovod's elastic recipe with the ``Loader`` in the state: ``hvd.elastic.TorchState(model,
optimizer, loader=loader)``, committed every ``--commit-every`` steps. When a worker is lost,
``@hvd.elastic.run`` re-forms the job; the loader goes on where training stood (or from the
commit, after a roll-back), and the rest of the epoch, the lost worker's untrained batches
included, is dealt to the workers left. The data servers run outside the workers' generations
and keep their cache. A reset callback rescales the learning rate to the new size.

Every worker takes as many steps per epoch as the worker with the most batches left, with a
zero gradient when it has none, so the steps stay in lockstep (the rule under which every
image is trained on exactly once per epoch: docs/data.md, "Elastic jobs"). Rank 0 prints one
line per epoch (its size, test accuracy), then the data servers' counters and the final
accuracy; every worker logs its recovery (``elastic recovery: ...``).

``--kill-rank R --kill-step S``: the worker that started as rank R SIGKILLs itself in step
S + 1 of the job, after its forward, with the others in that step's gradient allreduce.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import gradsync.data
import gradsync.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_servers import Digits, augment, split  # noqa: E402  (the same data and transform)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="images per batch")
    p.add_argument("--lr", type=float, default=0.1, help="per worker: x workers in all")
    p.add_argument("--commit-every", type=int, default=5, help="steps between commits")
    p.add_argument("--kill-rank", type=int, default=-1,
                   help="the worker that started as this rank kills itself (default: none)")
    p.add_argument("--kill-step", type=int, default=20, help="... after this many steps")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=0.9,
                   help="exit with status 1 if the final test accuracy is below this")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    x_train, x_test, y_train, y_test = split(args.seed)
    # Data-server ranks serve from here on and never return.
    loader = gradsync.data.Loader(Digits(x_train, y_train), batch_size=args.batch_size,
                                  transform=augment, seed=args.seed)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    first_rank = hvd.rank()  # the rank this worker started as (a new worker: its first)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, loader=loader, steps=0)

    def rescale() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([rescale])

    @hvd.elastic.run
    def train(state):
        accuracy = 0.0
        while loader.epoch < args.epochs:
            epoch = loader.epoch
            steps, mine = max(loader.lengths()), len(loader)
            batches = iter(loader)
            for k in range(steps):
                optimizer.zero_grad()
                if k < mine:
                    images, labels = next(batches)
                    loss = F.cross_entropy(model(images), labels)
                else:  # this worker's share is done: a zero gradient keeps the steps in step
                    loss = sum(p.sum() for p in model.parameters()) * 0.0
                if first_rank == args.kill_rank and state.steps == args.kill_step:
                    print(f"worker {first_rank} (rank {hvd.rank()}) kills itself in step "
                          f"{state.steps + 1}, epoch {epoch}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                optimizer.step()
                state.steps += 1
                if state.steps % args.commit_every == 0:
                    state.commit()
            for _ in batches:  # ends the epoch (its last batch is delivered)
                raise AssertionError("a batch beyond this worker's share")
            with torch.no_grad():
                accuracy = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
            if hvd.rank() == 0:
                print(f"epoch {epoch}: {hvd.size()} workers, test accuracy {accuracy:.3f}",
                      flush=True)
            state.commit()
        return float(accuracy)

    accuracy = train(state)
    if hvd.rank() == 0:
        for s in loader.stats():
            print(f"data server {s['server']}: batches {s['batches']} cache hits {s['hits']} "
                  f"misses {s['misses']}")
        print(f"final test accuracy {accuracy:.3f}")
    loader.close()
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
