"""A language model fed by data servers: byte sequences of Python's own library, packed into rows.

    gradsync run -np 2 --data-servers 2 python examples/data_servers_lm.py
    gradsync run -np 3 --data-servers 2 python examples/data_servers_lm.py --epochs 3 --files 40

Every rank runs this script. The corpus is the one of ``gradsync bench compress``'s ``lm``
task (``gradsync/bench/compress_tasks.py``): the ``.py`` files of the standard library of the
Python that runs it, the training files of its fixed split. Each file is cut at line ends
into *documents* of at most ``--context`` bytes (a longer line is cut into pieces), so the
documents' lengths vary, as token sequences do. A document is a sample: its bytes are its
tokens.

The data servers pack each batch's documents end to end into rows of ``--context`` + 1
bytes, each followed by the end-of-document token 0 (a byte Python source never holds),
the rest of a row padding (``gradsync.data.Pack``; docs/data.md, "Samples of varying
shape"). The workers train a byte-level causal transformer (the bench's ``ByteLM``) on the
rows: the inputs are a row's first ``--context`` bytes, the targets the row shifted by one,
and the loss counts only the targets inside a document or its end token (the metadata that
comes with the batch, ``row``, ``start`` and ``length`` per document, says where they lie).
A row holds a few short documents or one long one, and a batch holds ``--batch-size``
documents, so the number of rows, and of tokens, varies from batch to batch.

The order is the global one (``Loader(order="global")``, docs/data.md, "The global order"):
the documents of an epoch come in the order of the epoch's permutation, step by step,
whatever the numbers of workers and data servers. ``--ids FILE`` makes every worker write the
documents of each of its steps to ``FILE.<worker>`` (one JSON line per step), and
``--check`` makes it compare each document's bytes, as unpacked, with the dataset's
(``tests/test_data_example.py`` runs both at 1, 2 and 3 workers).

Worker 0 prints each epoch's mean loss in nats per byte (ln 256 = 5.55 for a uniform
guess) and exits 1 if the last epoch's is not below ``--target``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import gradsync.data
import gradsync.torch as hvd
from gradsync.bench import compress_tasks as tasks

END = 0  # the end-of-document token, and the padding: no byte of Python source is 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="documents per batch")
    p.add_argument("--context", type=int, default=64, help="bytes the model sees at once")
    p.add_argument("--files", type=int, default=20,
                   help="the first this many training files of the library (sorted)")
    p.add_argument("--documents", type=int, default=0,
                   help="keep only the first this many documents (0: all)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ids", help="write each worker's documents, step by step, to IDS.<worker>")
    p.add_argument("--check", action="store_true",
                   help="compare every document's bytes, as unpacked, with the dataset's")
    p.add_argument("--target", type=float, default=math.log(256),
                   help="exit with status 1 if the last epoch's mean loss is not below this")
    return p.parse_args(argv)


def documents(text: bytes, most: int) -> list[bytes]:
    """``text`` cut at line ends into pieces of at most ``most`` bytes, in order (together
    they are ``text``): lines gathered while they fit, a longer line cut into pieces."""
    out, piece = [], b""
    for line in text.splitlines(keepends=True):
        while len(line) > most:
            if piece:
                out.append(piece)
                piece = b""
            out.append(line[:most])
            line = line[most:]
        if len(piece) + len(line) > most:
            out.append(piece)
            piece = b""
        piece += line
    if piece:
        out.append(piece)
    return out


class Library:
    """The corpus as a map-style dataset: document ``i`` as a uint8 array of its bytes.

    Every rank builds it (a worker takes only its length; a data server indexes it), from the
    same files in the same order, so every rank counts the same documents."""

    def __init__(self, files: int, context: int, limit: int = 0, root: str | None = None):
        import sysconfig

        root = root or sysconfig.get_path("stdlib")
        train, _ = tasks.split_files(tasks.stdlib_files(root), 10)  # the bench's split
        self.docs: list[bytes] = []
        for name in train[:files]:
            with open(os.path.join(root, name), "rb") as f:
                self.docs += documents(f.read().replace(b"\0", b""), context)
        if limit:
            self.docs = self.docs[:limit]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.frombuffer(self.docs[i], dtype=np.uint8)


def targets_mask(batch: dict, width: int) -> torch.Tensor:
    """Which targets of the packed rows the loss counts: those inside a document or on its
    end token (the padding after a row's last document, and a row's first byte, which no
    input precedes, are left out)."""
    inside = torch.zeros(batch["tokens"].shape, dtype=torch.bool)
    for r, s, n in zip(batch["row"].tolist(), batch["start"].tolist(),
                       batch["length"].tolist()):
        inside[r, s:s + n + 1] = True  # the document and its end token
    return inside[:, 1:]


def main(argv=None) -> int:
    args = parse_args(argv)
    corpus = Library(args.files, args.context, args.documents)
    # Data-server ranks serve from here on and never return; workers connect and go on.
    loader = gradsync.data.Loader(corpus, batch_size=args.batch_size, seed=args.seed,
                                  order="global",
                                  collate=gradsync.data.Pack(args.context + 1, separator=END,
                                                             value=END))
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    sizes = tasks.Sizes(lm_dim=64, lm_layers=2, lm_heads=4, lm_context=args.context)
    model = tasks.build_model("lm", sizes)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps_file = open(f"{args.ids}.{hvd.rank()}", "w") if args.ids else None
    loss_of_epoch = float("inf")
    while loader.epoch < args.epochs:
        epoch, losses = loader.epoch, []
        for batch in loader:
            if args.check:
                for i, tokens in zip(loader.ids.tolist(), gradsync.data.Pack.split(batch)):
                    if tokens.numpy().tobytes() != corpus.docs[i]:
                        raise AssertionError(f"document {i} came as {tokens.numpy()[:16]}...")
            if steps_file is not None:
                steps_file.write(json.dumps({"epoch": epoch, "ids": loader.ids.tolist()}) + "\n")
            rows = batch["tokens"].long()
            x, y, mask = rows[:, :-1], rows[:, 1:], targets_mask(batch, args.context + 1)
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out[mask], y[mask])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        hvd.join()  # the workers' numbers of batches differ by at most one
        mean = float(np.mean(losses)) if losses else float("nan")
        loss_of_epoch = float(hvd.allreduce(torch.tensor([mean]), name=f"loss{epoch}")[0])
        if hvd.rank() == 0:
            print(f"epoch {epoch}: mean loss {loss_of_epoch:.3f} nats per byte, "
                  f"{len(losses)} steps on worker 0, {len(corpus)} documents", flush=True)
    if steps_file is not None:
        steps_file.close()
    loader.close()
    return 0 if loss_of_epoch < args.target else 1


if __name__ == "__main__":
    sys.exit(main())
