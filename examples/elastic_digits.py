"""The digits CNN of train_digits.py, trained elastically: a worker is killed and the job goes on.

    gradsync run -np 3 --min-np 2 python examples/elastic_digits.py --kill-rank 1 --kill-epoch 3

The model, data split and evaluation are train_digits.py's. The training loop is Horovod's
elastic recipe: the model, the optimizer, an ``ElasticSampler`` and the epoch live in a
``hvd.elastic.TorchState``, committed every ``--commit-every`` batches; ``@hvd.elastic.run``
rolls back to the last commit when a worker is lost, and the job goes on with the survivors
(new ranks, new size), their state synced from the new rank 0. A reset callback rescales the
learning rate to the new size (lr x size, the large-batch rule of train_digits.py).

``--kill-rank R --kill-epoch E``: the worker that started as rank R SIGKILLs itself in the
middle of epoch E, with its gradients in flight. Rank 0 prints one line per epoch (loss, test
accuracy, size) and the final accuracy; the exit status is 1 below ``--target``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F

import gradsync.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import Net, evaluate, load  # noqa: E402  (the same model, data and test)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank")
    p.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    p.add_argument("--kill-rank", type=int, default=-1,
                   help="the worker that started as this rank kills itself (default: none)")
    p.add_argument("--kill-epoch", type=int, default=3, help="... in the middle of this epoch")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=0.97)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    first_rank = hvd.rank()
    x_train, y_train, x_test, y_test = load(args.seed)
    dataset = torch.utils.data.TensorDataset(x_train, y_train)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, seed=args.seed, batch_size=args.batch_size)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1)

    def rescale_lr():  # after a re-formation: the global batch changed with the size
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([rescale_lr])

    @hvd.elastic.run
    def train(state):
        while state.epoch <= args.epochs:
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size,
                                                 sampler=state.sampler)
            steps, loss_sum = len(loader), torch.zeros(())
            for batch, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                loss.backward()  # the gradients' allreduces start here
                if (first_rank == args.kill_rank and state.epoch == args.kill_epoch
                        and batch == steps // 2):
                    print(f"worker {first_rank} (rank {hvd.rank()}) kills itself in epoch "
                          f"{state.epoch}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.step()
                loss_sum += loss.detach()
                state.sampler.record_batch(batch)
                if (batch + 1) % args.commit_every == 0:
                    state.commit()
            loss = hvd.allreduce(loss_sum / max(1, steps), name="train_loss").item()
            accuracy = evaluate(model, x_test, y_test)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:>3}  loss {loss:.4f}  test accuracy {accuracy:.4f}  "
                      f"size {hvd.size()}", flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return evaluate(model, x_test, y_test)

    accuracy = train(state)
    if hvd.rank() == 0:
        verdict = "ok" if accuracy >= args.target else "BELOW TARGET"
        print(f"final test accuracy {accuracy:.4f} on {hvd.size()} workers (target "
              f"{args.target}): {verdict}", flush=True)
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
