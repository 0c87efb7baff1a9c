"""DDP and Lightning fed by data servers through ``gradsync.data.as_dataloader``.

``data_ddp.py ddp|lightning DIR SAMPLES``: every rank runs it; data-server ranks serve inside
the ``Loader`` and exit. The workers train a linear model with DDP over the "gradsync"
backend (``ddp``: a plain loop; ``lightning``: ``Trainer`` with ``DDPStrategy``) for 2
epochs on batches of 4, sample i being (4 copies of ``i % 7``, label ``i``). Each worker writes
``DIR/<mode>-<rank>.json``: per epoch the labels it trained on in order and the loader's
``len()`` before the epoch, and its final parameters (DDP keeps them equal on every worker).
"""

import common  # noqa: F401  (deadline)

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import gradsync.data

BATCH, SEED, EPOCHS = 4, 3, 2
mode, out, samples = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Sevens:
    def __len__(self):
        return samples

    def __getitem__(self, i):
        return np.full(4, i % 7, np.float32), i


loader = gradsync.data.Loader(Sevens(), BATCH, seed=SEED)
# Only workers get here.
train = gradsync.data.as_dataloader(loader)
assert isinstance(train, torch.utils.data.DataLoader)
record = {"epochs": {}, "lengths": []}


def check(x, y):
    assert torch.equal(x, (y % 7).float().reshape(-1, 1).expand(-1, 4)), (x, y)


def save(rank, model):
    record["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump(record, f)


if mode == "ddp":
    dist.init_process_group("gradsync")  # WORLD_SIZE counts the workers only
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        record["lengths"].append(len(train))
        ids = record["epochs"].setdefault(str(epoch), [])
        for x, y in train:
            check(x, y)
            ids.extend(y.tolist())
            opt.zero_grad()
            model(x).square().mean().backward()  # DDP's allreduce: every worker must step
            opt.step()
    save(dist.get_rank(), model)
    dist.destroy_process_group()
elif mode == "lightning":
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Linear(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def train_dataloader(self):
            return train

        def on_train_epoch_start(self):
            record["lengths"].append(len(train))

        def training_step(self, batch, _):
            x, y = batch
            check(x, y)
            record["epochs"].setdefault(str(self.current_epoch), []).extend(y.tolist())
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    model = Linear()
    trainer = L.Trainer(accelerator="cpu", devices=loader.workers, max_epochs=EPOCHS,
                        strategy=DDPStrategy(process_group_backend="gradsync"), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    save(trainer.global_rank, model)
else:
    sys.exit(f"unknown mode {mode}")
