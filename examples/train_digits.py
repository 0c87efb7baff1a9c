"""Data-parallel training of a small CNN on scikit-learn's handwritten digits, the Horovod way.

    gradsync run -np 2 python examples/train_digits.py [--epochs 20] [--compression fp16]

The digits (``sklearn.datasets.load_digits``: 1,797 8x8 grey images, shipped with scikit-learn,
no download) are split once into train and test sets, identically on every rank. Each epoch,
every rank trains on its own shard of the training set; ``hvd.DistributedOptimizer`` averages
the gradients over the ranks before each update, so the ranks keep identical weights and the
job trains on a global batch of ``--batch-size x hvd.size()``. The recipe, step by step, is the
one Horovod documents for PyTorch; docs/examples.md explains the learning-rate part.

Rank 0 prints one line per epoch: the training loss averaged over ranks, the test accuracy
(each rank scores a shard of the test set; the counts are summed), and samples/s for the
whole job. The exit status is 1 when the final test accuracy is below ``--target``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data.distributed import DistributedSampler

import gradsync.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.02,
                   help="learning rate of one rank; the job uses lr x size (default 0.02)")
    p.add_argument("--warmup-epochs", type=float, default=2.0,
                   help="epochs over which the lr ramps linearly from lr to lr x size")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="gradient compression on the wire")
    p.add_argument("--fp16-allreduce", action="store_const", const="fp16", dest="compression",
                   help="same as --compression fp16 (Horovod's examples spell it this way)")
    p.add_argument("--amp", action="store_true", help="forward pass under bf16 autocast")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=0.97,
                   help="exit with status 1 if the final test accuracy is below this")
    return p.parse_args(argv)


class Net(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: 8x8 in, 10 logits out."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load(seed: int):
    """The train/test split: the same on every rank, because it depends only on ``seed``."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2,
                                           random_state=seed, stratify=y.numpy())
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def evaluate(model, x_test, y_test) -> float:
    """Test accuracy over the whole test set: each rank scores every size-th sample."""
    model.eval()
    with torch.no_grad():
        mine = slice(hvd.rank(), None, hvd.size())
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
    model.train()
    counts = hvd.allreduce(torch.tensor([correct.item(), len(y_test[mine])], dtype=torch.float64),
                           op=hvd.Sum, name="test_counts")
    return (counts[0] / counts[1]).item()


def main(argv=None) -> int:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)  # one core per rank: more threads would fight the other ranks
    torch.manual_seed(args.seed)

    x_train, y_train, x_test, y_test = load(args.seed)
    # Pads the shards to equal length, so that every rank makes the same number of steps
    # (the optimizer's allreduces must match one for one); set_epoch reshuffles identically.
    sampler = DistributedSampler(range(len(y_train)), num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // args.batch_size)

    model = Net()
    # Large-batch recipe (Goyal et al. 2017): the global batch is size() times larger, so the
    # lr is too, reached by a linear ramp from the one-rank lr so that the first, large and
    # noisy steps do not throw the random initial weights far off.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, args.compression),
                                         op=hvd.Average)
    # The scheduler goes on the optimizer that training steps, the DistributedOptimizer: on
    # ranks other than 0, broadcast_optimizer_state gives it new param_groups, and a scheduler
    # on the original optimizer would then set an lr that those ranks never use.
    warmup_steps = max(1, round(args.warmup_epochs * steps_per_epoch))
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / hvd.size(),
                                          total_iters=warmup_steps),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                   T_max=max(1, total_steps - warmup_steps)),
    ], milestones=[warmup_steps])
    # Every rank starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"digits: {len(y_train)} train / {len(y_test)} test images, {hvd.size()} ranks, "
              f"batch {args.batch_size} per rank ({args.batch_size * hvd.size()} global), "
              f"lr {args.lr} x {hvd.size()} after {warmup_steps} warm-up steps, "
              f"compression {args.compression}{', bf16 autocast' if args.amp else ''}",
              flush=True)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        start, loss_sum = time.perf_counter(), torch.zeros(())
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            # Label smoothing steadies the final accuracy across splits (docs/examples.md).
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx], label_smoothing=0.1)
            loss.backward()   # the optimizer's hooks start each gradient's allreduce here
            optimizer.step()  # waits for the averaged gradients, then updates
            scheduler.step()
            loss_sum += loss.detach().float()
        elapsed = time.perf_counter() - start
        loss = hvd.allreduce(loss_sum / steps_per_epoch, name="train_loss").item()
        accuracy = evaluate(model, x_test, y_test)
        if hvd.rank() == 0:
            rate = len(order) * hvd.size() / elapsed
            print(f"epoch {epoch:>3}  loss {loss:.4f}  test accuracy {accuracy:.4f}  "
                  f"lr {scheduler.get_last_lr()[0]:.4f}  {rate:,.0f} samples/s", flush=True)
    if hvd.rank() == 0:
        verdict = "ok" if accuracy >= args.target else "BELOW TARGET"
        print(f"final test accuracy {accuracy:.4f} (target {args.target}): {verdict}", flush=True)
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
