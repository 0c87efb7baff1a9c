"""The digits CNN of train_digits.py, trained through parameter servers, in each consistency mode.

    gradsync run -np 3 --servers 1 python examples/ps_digits.py                  # sync
    gradsync run -np 4 --servers 1 python examples/ps_digits.py --mode backup    # first 3 of 4
    gradsync run -np 4 --servers 1 python examples/ps_digits.py --mode backup --slow 3:4
    gradsync run -np 3 --servers 1 python examples/ps_digits.py --mode async
    gradsync run -np 3 --servers 1 python examples/ps_digits.py --mode ssp --staleness 2
    gradsync run -np 3 --servers 1 python examples/ps_digits.py --mode async --optimizer adam
    gradsync run -np 2 --servers 2 python examples/ps_digits.py --factor-fc

The servers are the job's last ranks; ``gradsync run`` starts them as ``python -m gradsync.ps``,
so only the workers run this script (under torchrun, srun or mpirun, with ``GRADSYNC_SERVERS``
exported, every rank runs it and ``gradsync.init()`` on a server rank serves until the workers
are done and exits). Each worker trains on its own
shard of the training set (every ``workers``-th image), reshuffled each epoch, and calls
``ps.step()`` after each backward pass: push the gradients, wait as the mode says, pull the
parameters. The servers hold the weights and run the optimizer (docs/examples.md).

Worker 0 prints, after each epoch, its mean training loss, the test accuracy of the newest
parameters and the seconds since training began; once every worker is done, the steps and
dropped gradients of each, the servers' counters (with ``--factor-fc``, the bytes it pushed per
step) and the final accuracy. It exits 1 when that is below ``--target``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import gradsync as gs
import gradsync.ps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=gradsync.ps.MODES, default="sync")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, help="default: 0.05 x gradients per update (sync, "
                   "backup), 0.1 (async, ssp), 0.001 (adam)")
    p.add_argument("--momentum", type=float, help="sgd: 0.9 (sync, backup), 0.5 (async, ssp)")
    p.add_argument("--epochs", type=int, default=8, help="passes of each worker over its shard")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--backup", type=lambda s: float(s) if "." in s else int(s), default=0.75,
                   help="backup mode: gradients per round, k or a fraction of the workers")
    p.add_argument("--staleness", type=int, default=3, help="ssp mode's bound")
    p.add_argument("--slow", metavar="WORKER:FACTOR",
                   help="that worker takes FACTOR times its compute time per step (a straggler)")
    p.add_argument("--factor-fc", action="store_true",
                   help="send the factors of large Linear gradients (factor_fc=batch size)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=0.95,
                   help="worker 0 exits 1 if the final test accuracy is below this")
    args = p.parse_args(argv)
    if args.optimizer == "adam" and args.momentum is not None:
        p.error("--momentum is for sgd; adam has betas")
    return args


def lr_and_momentum(args) -> dict:
    """The servers' optimizer settings; why they depend on the mode: docs/examples.md."""
    if args.optimizer == "adam":
        return {"lr": 1e-3 if args.lr is None else args.lr}
    if args.mode in ("sync", "backup"):  # an update averages k gradients: k x the lr of one
        k = gs.size() if args.mode == "sync" else args.backup if isinstance(args.backup, int) \
            else math.ceil(args.backup * gs.size())
        lr, momentum = 0.05 * k, 0.9
    else:  # each gradient applied alone, on parameters that others have moved since
        lr, momentum = 0.1, 0.5
    return {"lr": lr if args.lr is None else args.lr,
            "momentum": momentum if args.momentum is None else args.momentum}


def accuracy(model, x, y) -> float:
    # Worker 0 alone, not train_digits.evaluate: its allreduce would hold every worker at the
    # end of each epoch, and in backup mode deadlock (the others may wait in a round that
    # needs the push of a worker already waiting in the allreduce).
    with torch.no_grad():
        return (model(x).argmax(1) == y).sum().item() / len(y)  # exact: 324/360 is 0.9


def main(args) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # worker 0's initial weights are the ones the servers keep
    x_train, y_train, x_test, y_test = load(args.seed)
    model = Net()
    hyper = lr_and_momentum(args)
    ps = gradsync.ps.ParameterClient(model, optimizer=args.optimizer, mode=args.mode,
                                     backup=args.backup, staleness=args.staleness,
                                     factor_fc=args.batch_size if args.factor_fc else None,
                                     **hyper)
    who, factor = (args.slow or "-1:1").split(":")
    slow = float(factor) if int(who) == ps.rank else 1.0  # --slow: steps take FACTOR x compute
    x_mine, y_mine = x_train[ps.rank::ps.workers], y_train[ps.rank::ps.workers]
    shuffle = torch.Generator().manual_seed(args.seed * 1000 + ps.rank)
    if ps.rank == 0:
        print(f"digits: {len(y_train)} train / {len(y_test)} test images, {ps.workers} workers, "
              f"{ps.servers} servers, mode {args.mode}, {args.optimizer} "
              f"{' '.join(f'{k} {v:g}' for k, v in hyper.items())}, batch "
              f"{args.batch_size}{', fc factors' if args.factor_fc else ''}", flush=True)

    start, steps, dropped = time.perf_counter(), 0, 0
    for epoch in range(1, args.epochs + 1):
        order, loss_sum = torch.randperm(len(y_mine), generator=shuffle), 0.0
        batches = order.split(args.batch_size)
        for idx in batches:
            t = time.perf_counter()
            loss = F.cross_entropy(model(x_mine[idx]), y_mine[idx], label_smoothing=0.1)
            loss.backward()
            if slow > 1:  # emulate a slower machine: wait (FACTOR - 1) x this step's compute
                time.sleep((slow - 1) * (time.perf_counter() - t))
            dropped += not ps.step()  # False: backup mode closed this round without us
            steps += 1
            loss_sum += loss.item()
        if ps.rank == 0:
            ps.pull()  # the newest parameters: others may have pushed since our last step
            print(f"epoch {epoch:>2}  loss {loss_sum / len(batches):.4f}  test accuracy "
                  f"{accuracy(model, x_test, y_test):.4f}  {time.perf_counter() - start:5.1f} s",
                  flush=True)

    # Workers finish at different times (and shards may differ by a batch). leave() first: one
    # that waited in the barrier while still counted in the rounds (sync, backup) or in the
    # slowest clock (ssp) would block the others' pushes, and they would never reach it.
    ps.leave()
    counts = gs.allgather_object((steps, dropped))  # also a barrier: every worker is done
    if ps.rank != 0:
        ps.close()
        return 0
    ps.pull()  # the final parameters: nobody pushes any more
    acc = accuracy(model, x_test, y_test)
    print(f"all workers done after {time.perf_counter() - start:.1f} s: steps "
          f"{[c[0] for c in counts]}, dropped {[c[1] for c in counts]}", flush=True)
    for s in ps.stats():
        print(f"server {s['server']}: version {s['version']}  applied {s['applied']}  "
              f"dropped {s['dropped']}  max_staleness {s['max_staleness']}  "
              f"max_clock_gap {s['max_clock_gap']}", flush=True)
    if args.factor_fc:
        dense = 4 * sum(p.numel() for p in model.parameters())
        print(f"worker 0 pushed {ps.bytes_pushed / steps:,.0f} bytes per step (dense "
              f"gradients: {dense:,})", flush=True)
    ps.close()
    verdict = "ok" if acc >= args.target else "BELOW TARGET"
    print(f"final test accuracy {acc:.4f} (target {args.target}): {verdict}", flush=True)
    return 0 if acc >= args.target else 1


if __name__ == "__main__":
    args = parse_args()
    gs.init()  # on a server rank of a foreign launcher: serve until the workers are done, exit
    # Only workers get here. Importing scikit-learn (through train_digits) takes seconds of
    # CPU, which a server would otherwise take from the workers sharing its cores.
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_digits import Net, load  # the model and the train/test split, shared

    sys.exit(main(args))
