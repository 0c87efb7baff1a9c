"""Batches of samples whose shapes vary: padding, packing, or the user's own collate.

Without a collate every sample must have the first sample's shapes, and a batch is their
stack (``layout.py``). Token sequences, the data of language models, vary in length. A
``collate`` given to the ``Loader`` runs on the data servers and turns a batch of samples into
bytes of a *fixed upper size*, so that a stream's slots (``server.py``) are still set up once:
the slot holds the largest batch the collate can make, and each batch writes the part it
needs, its own description first. The worker runs the same collate's ``unpack`` on those bytes.

A collate is an object with four methods (``Collate``), all pure functions of their inputs:

- ``learn(sample)``: on the server, from the first sample as served, what every batch shares
  (dtypes, trailing shapes), as JSON: the *spec*. It travels to the workers in the hello reply.
- ``slot_bytes(spec, batch_size)``: the most bytes a batch of ``batch_size`` samples takes.
- ``pack(spec, samples, ids, out)``: writes the batch into the uint8 array ``out``; returns
  the bytes written. A sample it cannot take raises ``ValueError`` naming its id.
- ``unpack(spec, buf, count)``: on the worker, the batch as tensors (viewing ``buf`` where
  they can).

and ``describe()``: JSON that the data servers compare with every worker's (every rank must
build the same Loader).

Exactly once is the plan's (``plan.py``): a batch is ``batch_size`` samples whatever the
collate, so every sample is in one batch of one worker, and a packed batch's rows are only
how its samples lie. ``Loader.ids`` names the samples of the batch, in the order the batch's
metadata lists them.

**Pad** (``Pad(max_length)``): every leaf of a sample with a dimension is a sequence along
its first dimension, whose length is the sample's (all of a sample's sequences share it:
tokens and their labels); 0-d leaves (a class) are stacked. The batch pads each sequence to
the batch's longest with ``value`` and comes as ``(batch, lengths)``: ``batch`` in the
sample's structure, each sequence leaf ``(count, longest, *trailing)``; ``lengths`` int64
``(count,)``. ``Pad.split(batch, lengths)`` undoes it. A sample longer than ``max_length`` is
refused. Slot: ``[longest][lengths x count]`` in int64 words, then each leaf, leaf-major,
each block rounded up to 8 bytes.

**Pack** (``Pack(row_length)``): a sample is one sequence of tokens (a 1-D array, tensor or
list of ints). The batch's samples, in order, go end to end into rows of ``row_length``
tokens, each followed by ``separator`` when one is given; a sample (with its separator) that
does not fit in what is left of the row starts the next row, so a sample never spans two rows
and one longer than a row is refused (split it in the dataset or the transform). The end of a
row is filled with ``value``. The batch comes as a dict: ``tokens`` ``(rows, row_length)``,
and per sample, in the batch's order, its ``row``, ``start`` (column) and ``length`` (without
the separator), int64 ``(count,)``; ``Pack.split(batch)`` gives the samples back. An empty
sample takes no room (its separator, if any, one token) and is still listed. A batch of
``count`` samples takes at most ``count`` rows. Worked example, ``row_length`` 5, separator 0,
samples ``[1 2] [3 4 5] [] [6]``: ``[1 2 0 _ _]`` has no room for ``3 4 5 0``, which opens row
1, ``[3 4 5 0 0]`` (the empty sample's separator at column 4), and ``6 0`` opens row 2:
rows ``[1 2 0 p p] [3 4 5 0 0] [6 0 p p p]``, ``row = [0 1 1 2]``, ``start = [0 0 4 0]``,
``length = [2 3 0 1]``.
"""

from __future__ import annotations

import numpy as np

from .layout import Layout, _build, leaves_of

__all__ = ["Collate", "Pad", "Pack"]


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


class Collate:
    """The interface of a collate (module docstring). Subclass it for a collate of your own."""

    def describe(self) -> dict:
        return {"collate": type(self).__qualname__}

    def learn(self, sample) -> dict:
        raise NotImplementedError

    def slot_bytes(self, spec: dict, batch_size: int) -> int:
        raise NotImplementedError

    def pack(self, spec: dict, samples: list, ids: list[int], out: np.ndarray) -> int:
        raise NotImplementedError

    def unpack(self, spec: dict, buf: np.ndarray, count: int):
        raise NotImplementedError


class Pad(Collate):
    """Pads each batch's sequences to its longest (module docstring).

    Args:
        max_length: the longest sequence a sample may have (it sizes the slots).
        value: what the padding holds.
    """

    def __init__(self, max_length: int, value: float = 0):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length, self.value = int(max_length), value

    def describe(self) -> dict:
        return {"collate": "pad", "max_length": self.max_length, "value": self.value}

    def learn(self, sample) -> dict:
        tree = Layout.of(sample).describe()
        ragged = [len(s) > 0 for s in tree["shapes"]]
        return {"structure": tree["structure"], "dtypes": tree["dtypes"], "ragged": ragged,
                "trailing": [s[1:] if r else s for s, r in zip(tree["shapes"], ragged)]}

    def _rows(self, spec: dict) -> list[int]:
        """Bytes of one row (one step of a sequence, or one 0-d value) of each leaf."""
        return [int(np.prod(t, dtype=np.int64)) * np.dtype(d).itemsize
                for d, t in zip(spec["dtypes"], spec["trailing"])]

    def slot_bytes(self, spec: dict, batch_size: int) -> int:
        return 8 * (1 + batch_size) + sum(
            _round8(batch_size * (self.max_length if r else 1) * row)
            for r, row in zip(spec["ragged"], self._rows(spec)))

    def pack(self, spec: dict, samples: list, ids: list[int], out: np.ndarray) -> int:
        count = len(samples)
        batch = [leaves_of(s) for s in samples]
        lengths = np.zeros(count, dtype=np.int64)
        want = [(np.dtype(d), tuple(t)) for d, t in zip(spec["dtypes"], spec["trailing"])]
        for i, (leaves, sample_id) in enumerate(zip(batch, ids)):
            got = [(leaf.dtype, leaf.shape[1:] if r else leaf.shape)
                   for leaf, r in zip(leaves, spec["ragged"])]
            if len(leaves) != len(want) or got != want:
                raise ValueError(f"sample {sample_id} has leaves (dtype, shape without the "
                                 f"sequence's length) {got}, the first sample had {want}")
            seq = {leaf.shape[0] for leaf, r in zip(leaves, spec["ragged"]) if r}
            if len(seq) > 1:
                raise ValueError(f"sample {sample_id}'s sequences have lengths {sorted(seq)}; "
                                 "Pad needs one length per sample")
            lengths[i] = seq.pop() if seq else 0
            if lengths[i] > self.max_length:
                raise ValueError(f"sample {sample_id} is {lengths[i]} long, more than Pad's "
                                 f"max_length {self.max_length}")
        longest = int(lengths.max()) if count else 0
        words = out[:8 * (1 + count)].view(np.int64)
        words[0], words[1:] = longest, lengths
        at = 8 * (1 + count)
        for j, (ragged, row) in enumerate(zip(spec["ragged"], self._rows(spec))):
            dtype, trailing = want[j]
            nbytes = count * (longest if ragged else 1) * row
            shape = (count, longest, *trailing) if ragged else (count, *trailing)
            dst = out[at:at + nbytes].view(dtype).reshape(shape)
            if ragged:
                dst[...] = self.value
                for i, leaves in enumerate(batch):
                    dst[i, :lengths[i]] = leaves[j]
            else:
                for i, leaves in enumerate(batch):
                    dst[i] = leaves[j]
            at += _round8(nbytes)
        return at

    def unpack(self, spec: dict, buf: np.ndarray, count: int):
        import torch

        words = buf[:8 * (1 + count)].view(np.int64)
        longest, lengths = int(words[0]), words[1:]
        tensors, at = [], 8 * (1 + count)
        for d, t, ragged, row in zip(spec["dtypes"], spec["trailing"], spec["ragged"],
                                     self._rows(spec)):
            nbytes = count * (longest if ragged else 1) * row
            shape = (count, longest, *t) if ragged else (count, *t)
            tensors.append(torch.from_numpy(buf[at:at + nbytes].view(np.dtype(d))
                                            .reshape(shape)))
            at += _round8(nbytes)
        return _build(spec["structure"], tensors), torch.from_numpy(lengths)

    @staticmethod
    def split(batch, lengths) -> list:
        """The samples of a padded batch, each a list of its leaves in the layout's order,
        as NumPy arrays without the padding (a sequence cut to the sample's length)."""
        leaves = leaves_of(batch)
        return [[leaf[i, :int(n)] if leaf.ndim > 1 else leaf[i] for leaf in leaves]
                for i, n in enumerate(np.asarray(lengths))]


class Pack(Collate):
    """Packs each batch's token sequences into rows (module docstring).

    Args:
        row_length: tokens per row.
        separator: a token written after each sample (None: none).
        value: what fills the end of a row.
    """

    def __init__(self, row_length: int, separator: int | None = None, value: int = 0):
        if row_length < 1:
            raise ValueError(f"row_length must be >= 1, got {row_length}")
        self.row_length, self.separator, self.value = int(row_length), separator, value

    def describe(self) -> dict:
        return {"collate": "pack", "row_length": self.row_length,
                "separator": self.separator, "value": self.value}

    @staticmethod
    def _tokens(sample, sample_id) -> np.ndarray:
        leaves = leaves_of(sample)
        tokens = leaves[0] if len(leaves) == 1 and leaves[0].ndim == 1 else np.asarray(sample)
        if tokens.ndim != 1:
            raise ValueError(f"sample {sample_id} is not one sequence of tokens (shape "
                             f"{tokens.shape}): Pack takes 1-D samples")
        return tokens

    def learn(self, sample) -> dict:
        tokens = self._tokens(sample, 0)
        if tokens.size == 0 and tokens.dtype == np.float64:  # an empty list: no dtype said
            tokens = tokens.astype(np.int64)
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"Pack packs tokens (integers), the first sample holds "
                            f"{tokens.dtype}")
        return {"dtype": tokens.dtype.str}

    def slot_bytes(self, spec: dict, batch_size: int) -> int:
        itemsize = np.dtype(spec["dtype"]).itemsize
        return 8 * (1 + 3 * batch_size) + _round8(batch_size * self.row_length * itemsize)

    def pack(self, spec: dict, samples: list, ids: list[int], out: np.ndarray) -> int:
        count, dtype, width = len(samples), np.dtype(spec["dtype"]), self.row_length
        extra = 0 if self.separator is None else 1
        meta = out[:8 * (1 + 3 * count)].view(np.int64)
        row_of, start_of, length_of = (meta[1 + k * count:1 + (k + 1) * count]
                                       for k in range(3))
        tokens = out[8 * (1 + 3 * count):].view(dtype)[:count * width].reshape(count, width)
        rows, used = 0, width  # no row open yet: the first sample opens one
        for i, (sample, sample_id) in enumerate(zip(samples, ids)):
            seq = self._tokens(sample, sample_id)
            need = len(seq) + extra
            if need > width:
                raise ValueError(f"sample {sample_id} has {len(seq)} tokens"
                                 f"{' and a separator' if extra else ''}, more than a row of "
                                 f"{width}: Pack never splits a sample (split it in the "
                                 "dataset or the transform)")
            if need > width - used or rows == 0:
                tokens[rows] = self.value
                rows, used = rows + 1, 0
            row = tokens[rows - 1]
            row[used:used + len(seq)] = seq  # casts to the first sample's dtype
            if extra:
                row[used + len(seq)] = self.separator
            row_of[i], start_of[i], length_of[i] = rows - 1, used, len(seq)
            used += need
        meta[0] = rows
        return 8 * (1 + 3 * count) + _round8(rows * width * dtype.itemsize)

    def unpack(self, spec: dict, buf: np.ndarray, count: int):
        import torch

        meta = buf[:8 * (1 + 3 * count)].view(np.int64)
        rows, dtype = int(meta[0]), np.dtype(spec["dtype"])
        at = 8 * (1 + 3 * count)
        tokens = buf[at:at + rows * self.row_length * dtype.itemsize].view(dtype)
        out = {"tokens": torch.from_numpy(tokens.reshape(rows, self.row_length))}
        for k, name in enumerate(("row", "start", "length")):
            out[name] = torch.from_numpy(meta[1 + k * count:1 + (k + 1) * count])
        return out

    @staticmethod
    def split(batch: dict) -> list:
        """The samples of a packed batch, in its order, each a 1-D tensor of its tokens."""
        return [batch["tokens"][r, s:s + n] for r, s, n in
                zip(batch["row"].tolist(), batch["start"].tolist(), batch["length"].tolist())]
