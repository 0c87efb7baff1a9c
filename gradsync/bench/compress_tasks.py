"""The training tasks of ``gradsync bench compress``: data every machine has, small models.

**lm**: a byte-level transformer language model on the text of CPython's standard library,
the ``Lib`` directory of the Python that runs the bench (``sysconfig.get_path("stdlib")``;
``site-packages`` and ``dist-packages`` are left out, they hold whatever was installed). Each
``.py`` file is *validation* or *training* by a hash of its path relative to ``Lib`` (CRC32
of the POSIX path, modulo 100, below ``val_percent``): the same split on every machine and
every run, and never a validation file trained on, not even a line of one. The model
predicts the next byte (256 classes) from the ``context`` bytes before it; its quality is
the validation loss in nats per byte (ln 256 = 5.55 for a uniform guess). On CPython 3.11's
``Lib`` the split is 1,790 files, 31.5 MB.

**cnn**: a small convolutional network on scikit-learn's handwritten digits (1,797 images of
8 x 8 pixels, shipped inside scikit-learn, so nothing is downloaded), split the same way by
a hash of each image's index (20% for validation); its quality is the validation accuracy
(and loss).

The driver (``compress.py``) prepares a task's data once into a folder (``prepare``), and
every rank of every mode loads it from there (``load``), so all modes train on the same bytes.
Each rank draws its batches from a generator seeded by the bench's seed and its rank alone:
every mode sees the same batches in the same order, step for step.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["TASKS", "stdlib_files", "is_validation", "split_files", "prepare", "load", "Task",
           "Sizes", "build_model"]

TASKS = ("lm", "cnn")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def is_validation(name: str, val_percent: int) -> bool:
    """Whether the file (or item) ``name`` is kept for validation: a hash of the name, the
    same in every process (``hash(str)`` is salted per process, so it cannot be used)."""
    return zlib.crc32(name.encode()) % 100 < val_percent


def split_files(names, val_percent: int) -> tuple[list[str], list[str]]:
    """``names`` -> (training, validation), each sorted; every name in exactly one."""
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be 1 to 99, got {val_percent}")
    names = sorted(set(names))
    val = [n for n in names if is_validation(n, val_percent)]
    held = set(val)
    return [n for n in names if n not in held], val


def stdlib_files(root: str | None = None) -> list[str]:
    """The ``.py`` files under the standard library's directory, as POSIX paths relative to
    it, sorted; installed packages and byte-code caches left out."""
    root = root or sysconfig.get_path("stdlib")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for f in files:
            if f.endswith(".py"):
                found.append(os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/"))
    return sorted(found)


# ------------------------------------------------------------------------ preparing
def prepare(task: str, folder: str, *, val_percent: int | None = None,
            root: str | None = None) -> dict:
    """Writes ``task``'s training and validation data into ``folder``; returns its summary
    (also written there as ``meta.json``). ``val_percent``: the share kept for validation
    (default: 10 for lm, 20 for cnn, whose 1,797 images would leave 180 to measure accuracy
    by, in steps of 0.6 points)."""
    if val_percent is None:
        val_percent = 20 if task == "cnn" else 10
    if task == "lm":
        meta = _prepare_lm(folder, val_percent, root)
    elif task == "cnn":
        meta = _prepare_digits(folder, val_percent)
    else:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _prepare_lm(folder: str, val_percent: int, root: str | None) -> dict:
    root = root or sysconfig.get_path("stdlib")
    train, val = split_files(stdlib_files(root), val_percent)
    if not train or not val:
        raise ValueError(f"{root}: {len(train)} training and {len(val)} validation files; "
                         "the language model needs both")
    sizes = {}
    for part, names in (("train", train), ("val", val)):
        with open(os.path.join(folder, f"lm.{part}.bin"), "wb") as out:
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    out.write(f.read())
                out.write(b"\n")  # files never run into each other without a break
        sizes[part] = os.path.getsize(os.path.join(folder, f"lm.{part}.bin"))
    return {"task": "lm", "source": root, "val_percent": val_percent,
            "train_files": len(train), "val_files": len(val),
            "train_bytes": sizes["train"], "val_bytes": sizes["val"]}


def _prepare_digits(folder: str, val_percent: int) -> dict:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError("the cnn task trains on scikit-learn's digits (shipped with it, no "
                         "download): install scikit-learn, or run --task lm") from None
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # pixels are 0..16
    labels = digits.target.astype(np.int64)
    is_val = np.array([is_validation(f"digit{i}", val_percent) for i in range(len(labels))])
    np.savez(os.path.join(folder, "digits.npz"), train_x=images[~is_val],
             train_y=labels[~is_val], val_x=images[is_val], val_y=labels[is_val])
    return {"task": "cnn", "source": "sklearn.datasets.load_digits", "val_percent": val_percent,
            "train_items": int((~is_val).sum()), "val_items": int(is_val.sum())}


# ------------------------------------------------------------------------ models
@dataclass(frozen=True)
class Sizes:
    """The models' sizes (the bench's ``--lm-*`` and ``--cnn-width`` options)."""

    lm_dim: int = 160
    lm_layers: int = 4
    lm_heads: int = 4
    lm_context: int = 64
    cnn_width: int = 32


def build_model(task: str, sizes: Sizes):
    """The task's model, its weights drawn from torch's global generator (seed it first, the
    same on every rank)."""
    import torch
    from torch import nn

    if task == "cnn":
        w = sizes.cnn_width
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * 16, 4 * w), nn.ReLU(), nn.Linear(4 * w, 10))

    class ByteLM(nn.Module):
        """A pre-norm causal transformer over bytes (no dropout: the runs are short)."""

        def __init__(self):
            super().__init__()
            d, t = sizes.lm_dim, sizes.lm_context
            self.embed = nn.Embedding(256, d)
            self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, sizes.lm_heads, 4 * d, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, sizes.lm_layers,
                                                enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, 256)
            # A plain attribute, not a buffer: DDP would broadcast a buffer every step.
            self.mask = nn.Transformer.generate_square_subsequent_mask(t)

        def forward(self, x):
            t = x.shape[1]
            h = self.embed(x) + self.pos[:t]
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(h))

    return ByteLM()


# ------------------------------------------------------------------------ loading
class Task:
    """A task's data on one rank: ``batch(gen)`` for training, ``evaluate(model)`` for this
    rank's share of the validation set."""

    def __init__(self, name: str, folder: str, sizes: Sizes, batch: int, rank: int, size: int,
                 val_items: int):
        import torch

        self.name, self.sizes, self.batch_size = name, sizes, batch
        self.rank, self.size = rank, size
        if name == "lm":
            t = sizes.lm_context
            self.train = torch.from_numpy(np.fromfile(os.path.join(folder, "lm.train.bin"),
                                                      dtype=np.uint8))
            val = torch.from_numpy(np.fromfile(os.path.join(folder, "lm.val.bin"),
                                               dtype=np.uint8))
            # Fixed windows spread evenly over the validation text, each rank a share.
            starts = torch.linspace(0, len(val) - t - 2, val_items).long()
            mine = starts[rank::size]
            self.val_x, self.val_y = self._windows(val, mine)
        elif name == "cnn":
            data = np.load(os.path.join(folder, "digits.npz"))
            self.train_x = torch.from_numpy(data["train_x"]).unsqueeze(1)
            self.train_y = torch.from_numpy(data["train_y"])
            self.val_x = torch.from_numpy(data["val_x"]).unsqueeze(1)[rank::size]
            self.val_y = torch.from_numpy(data["val_y"])[rank::size]
        else:
            raise ValueError(f"unknown task {name!r}")

    def _windows(self, text, starts):
        import torch

        idx = starts.unsqueeze(1) + torch.arange(self.sizes.lm_context + 1)
        w = text[idx].long()
        return w[:, :-1], w[:, 1:]

    def batch(self, gen):
        """A training batch drawn with ``gen`` (this rank's generator)."""
        import torch

        if self.name == "lm":
            starts = torch.randint(0, len(self.train) - self.sizes.lm_context - 1,
                                   (self.batch_size,), generator=gen)
            return self._windows(self.train, starts)
        pick = torch.randint(0, len(self.train_y), (self.batch_size,), generator=gen)
        return self.train_x[pick], self.train_y[pick]

    def loss(self, model, x, y):
        import torch.nn.functional as F

        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model) -> tuple[float, int, int]:
        """(summed loss, items, correct) over this rank's share of the validation set; an
        item is a byte for lm, an image for cnn."""
        import torch
        import torch.nn.functional as F

        was = model.training
        model.eval()
        loss, count, correct = 0.0, 0, 0
        with torch.no_grad():
            for i in range(0, len(self.val_x), 64):
                x, y = self.val_x[i:i + 64], self.val_y[i:i + 64]
                out = model(x)
                out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
                loss += float(F.cross_entropy(out, y, reduction="sum"))
                count += y.numel()
                correct += int((out.argmax(1) == y).sum())
        model.train(was)
        return loss, count, correct


def load(task: str, folder: str, sizes: Sizes, batch: int, rank: int, size: int,
         val_items: int = 256) -> Task:
    """This rank's view of the data ``prepare`` wrote into ``folder``."""
    return Task(task, folder, sizes, batch, rank, size, val_items)
