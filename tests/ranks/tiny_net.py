"""The tiny classifier that the compression and DiLoCo rank scripts train.

Each rank draws its own batch from a seed of its rank, so ranks drift apart unless their
gradients (or parameters) are synchronised; ``whole_loss`` is the loss over every rank's batch,
the quantity the averaged gradients descend.
"""

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def whole_loss(model, size: int) -> float:
    """The loss over the batches of ranks 0 .. size - 1."""
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(x), y)) for x, y in map(batch, range(size))) / size


def digest(tensors) -> str:
    """A short hash of the tensors' bytes: equal on two ranks only if bitwise equal."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def all_digests(d: str, group) -> list:
    """Every rank's ``d`` over torch group ``group`` (None: the default group), by rank."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, d, group=group)
    return out
