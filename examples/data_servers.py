"""Training fed by data servers: the digits, augmented on the data servers, cached there.

    gradsync run -np 2 --data-servers 1 python examples/data_servers.py
    gradsync run -np 3 --data-servers 2 python examples/data_servers.py --epochs 6
    gradsync run -np 2 --data-servers 1 python examples/data_servers.py --checkpoint /tmp/ck.pt

Every rank runs this script. The ``gradsync.data.Loader`` call is where the roles part: on the
job's last ranks (the data servers) it serves and ends the process; on the workers it returns
an iterable of batches. The data servers hold the training images (scikit-learn's bundled
digits, 8x8 grey), keep them decoded in memory after the first epoch, and apply a random
contrast and pixel noise to every image each time they serve it (``augment``), seeded by
(seed, epoch, image): the workers only train. The workers train a small MLP with Horovod's recipe
(``gradsync.torch``); an epoch gives the workers numbers of batches that differ by at most
one, so a worker that runs out calls ``hvd.join()`` and keeps the others' allreduces going.

With ``--checkpoint PATH`` the model, the optimizer and the loader's position are saved after
every epoch and at ``--stop-after`` steps, and a job started again with the same path goes on
from there: the rest of an interrupted epoch is served without repeating a sample.

Worker 0 prints each epoch's mean loss and test accuracy, then the data servers' counters
(batches prepared, cache hits and misses), and exits 1 if the final accuracy is below
``--target``. ``examples/data_servers_elastic.py`` trains the same in an elastic job that
loses a worker.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradsync.data
import gradsync.torch as hvd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="images per batch")
    p.add_argument("--lr", type=float, default=0.1, help="per worker: x workers in all")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint", help="save here after each epoch; resume from it if present")
    p.add_argument("--stop-after", type=int,
                   help="save the checkpoint and stop after this many steps (a resume demo)")
    p.add_argument("--target", type=float, default=0.9,
                   help="exit with status 1 if the final test accuracy is below this")
    return p.parse_args(argv)


class Digits:
    """The training images as a map-style dataset: ``(image[1, 8, 8], label)``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


def augment(sample, rng: np.random.Generator):
    """Random contrast (x0.8 to x1.2) and pixel noise; a new array, the cached image untouched."""
    image, label = sample
    noise = rng.normal(0.0, 0.05, size=image.shape).astype(np.float32)
    return image * np.float32(rng.uniform(0.8, 1.2)) + noise, label


def split(seed: int):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # pixels are 0..16
    return train_test_split(images, digits.target, test_size=0.2, random_state=seed,
                            stratify=digits.target)


def main(argv=None) -> int:
    args = parse_args(argv)
    x_train, x_test, y_train, y_test = split(args.seed)
    # Data-server ranks serve from here on and never return; workers connect and go on.
    loader = gradsync.data.Loader(Digits(x_train, y_train), batch_size=args.batch_size,
                                  transform=augment, seed=args.seed)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["data"])
        if hvd.rank() == 0:
            print(f"resumed from {args.checkpoint} in epoch {loader.epoch}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def save() -> None:
        state = loader.state_dict()  # a collective: every worker calls it at the same step
        if args.checkpoint and hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "data": state}, args.checkpoint)

    steps, accuracy = 0, 0.0
    while loader.epoch < args.epochs:
        epoch, losses = loader.epoch, []
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            steps += 1
            if steps == args.stop_after:
                break
        if steps == args.stop_after:
            # Out of the loop with batches still to come: the others' steps must match.
            hvd.join()
            save()
            if hvd.rank() == 0:
                print(f"stopped after {steps} steps in epoch {epoch}; state saved")
            loader.close()
            return 0
        hvd.join()  # the workers' numbers of batches differ by at most one
        with torch.no_grad():
            correct = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
        accuracy = float(correct)
        if args.checkpoint:
            save()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: mean loss {np.mean(losses):.3f}, test accuracy "
                  f"{accuracy:.3f}, {len(losses)} steps on worker 0")
    if hvd.rank() == 0:
        for s in loader.stats():
            print(f"data server {s['server']}: batches {s['batches']} cache hits {s['hits']} "
                  f"misses {s['misses']} samples {s['samples']} bytes {s['bytes']}")
        print(f"final test accuracy {accuracy:.3f}")
    loader.close()
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
