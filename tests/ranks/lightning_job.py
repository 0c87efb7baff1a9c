"""A PyTorch Lightning job on 2 CPU processes with DDP over a given backend.

``python lightning_job.py BACKEND OUT``: trains a small float64 regression model for 2 epochs
with ``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=
BACKEND))`` (Lightning re-runs this script for the second process) and saves the final
parameters to OUT from rank 0. tests/test_ecosystem.py runs it with gradsync (default tier)
and with gloo (slow tier) and compares each file with one process training on both ranks'
batches. It never imports gradsync, as a user's Lightning script would not:
the backend comes from gradsync's ``torch.backends`` entry point.
"""

import sys

import common  # noqa: F401  (deadline)
import torch  # no `import gradsync`: torch's import registers "gradsync" (its entry point)

try:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    sys.exit("this test needs Lightning: pip install 'gradsync[ecosystem]' (or pip install lightning)")

backend, out = sys.argv[1], sys.argv[2]


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
loader = torch.utils.data.DataLoader(data, batch_size=16)
L.seed_everything(0, verbose=False)
model = Regression()
trainer = L.Trainer(accelerator="cpu", devices=2, precision="64-true", max_epochs=2,
                    strategy=DDPStrategy(process_group_backend=backend), logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, loader)
used = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
if trainer.global_rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
print(f"rank {trainer.global_rank}: lightning done, backend {used}, "
      f"{trainer.global_step} steps", flush=True)
