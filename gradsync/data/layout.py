"""How a batch of samples lies in a data server's slot, and how a worker turns it into tensors.

A sample is what the dataset and the transform return: a tensor or NumPy array, a Python
number, or a tuple, list or dict of those (nested). Its *leaves* are its arrays, each with a
dtype and shape that every sample of the dataset must share (as ``torch.stack`` in a
``DataLoader``'s collate requires). The layout is learnt once from the first sample and sent
to the workers as JSON (``tree``), so that a batch travels as raw bytes, never pickled.

A batch of ``count`` samples is packed *leaf-major*: all of leaf 0 (``count`` rows), then all
of leaf 1, and so on, so that each leaf of the batch is one contiguous array. For two leaves of
12 and 8 bytes and ``count`` 3 the slot holds ``[x0 x1 x2 | y0 y1 y2]``: 36 bytes, then 24. A
worker reads those ``count * sample_bytes`` bytes into one fresh buffer and each leaf of the
batch is a tensor viewing it, so the read is the only copy on the worker.

Python numbers become 0-d leaves (``int`` as int64, ``float`` as float64, ``bool`` as bool),
as ``default_collate`` makes them; a NumPy scalar keeps its dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Layout", "leaves_of"]


def _leaf(value) -> np.ndarray | None:
    """``value`` as a NumPy array when it is a leaf, else None."""
    kind = type(value)
    if kind is np.ndarray:  # the usual leaves, first: this runs for every sample
        return value
    if kind is int:
        return np.asarray(value, dtype=np.int64)
    if kind is float:
        return np.asarray(value, dtype=np.float64)
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)  # a NumPy scalar keeps its dtype
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    return None


def _tree(value, leaves: list) -> dict:
    leaf = _leaf(value)
    if leaf is not None:
        leaves.append(leaf)
        return {"leaf": len(leaves) - 1}
    if isinstance(value, dict):
        return {"dict": [[k, _tree(v, leaves)] for k, v in value.items()]}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list":
                [_tree(v, leaves) for v in value]}
    raise TypeError(f"a sample may hold tensors, arrays, numbers and tuples, lists or dicts of "
                    f"them; got {type(value).__name__}")


def _collect(value, leaves: list) -> None:
    """``_tree``'s walk without the tree: the leaves only, in the same order."""
    leaf = _leaf(value)
    if leaf is not None:
        leaves.append(leaf)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, leaves)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, leaves)
    else:
        _tree(value, leaves)  # raises the TypeError that names the type


def leaves_of(sample) -> list[np.ndarray]:
    """The leaves of ``sample`` as NumPy arrays, in the layout's order."""
    leaves: list[np.ndarray] = []
    _collect(sample, leaves)
    return leaves


class Layout:
    """The shape of one sample: its tree of containers and its leaves' dtypes and shapes.

    Args:
        tree: the JSON-able tree (``Layout.of(sample).describe()`` makes one).
    """

    def __init__(self, tree: dict):
        self.tree = tree
        self.dtypes = [np.dtype(d) for d in tree["dtypes"]]
        self.shapes = [tuple(s) for s in tree["shapes"]]
        self.leaf_bytes = [int(np.prod(s, dtype=np.int64)) * d.itemsize
                           for d, s in zip(self.dtypes, self.shapes)]
        self.sample_bytes = sum(self.leaf_bytes)
        self._want = list(zip(self.dtypes, self.shapes))

    @classmethod
    def of(cls, sample) -> "Layout":
        """The layout of ``sample`` (what every other sample must match)."""
        leaves: list[np.ndarray] = []
        structure = _tree(sample, leaves)
        for leaf in leaves:
            if leaf.dtype.hasobject:
                raise TypeError("a sample's arrays must hold numbers, not Python objects")
        return cls({"structure": structure, "dtypes": [leaf.dtype.str for leaf in leaves],
                    "shapes": [list(leaf.shape) for leaf in leaves]})

    def describe(self) -> dict:
        return self.tree

    def check(self, leaves: list[np.ndarray], sample_id: int) -> None:
        """Raises ValueError, naming the sample, if ``leaves`` do not fit the layout."""
        got = [(leaf.dtype, leaf.shape) for leaf in leaves]
        want = self._want
        if got != want:
            raise ValueError(f"sample {sample_id} has leaves (dtype, shape) {_show(got)} but "
                             f"the first sample had {_show(want)}: every sample must have the "
                             "same structure, dtypes and shapes (pad or crop in the transform)")

    def pack(self, samples: list[list[np.ndarray]], out: np.ndarray) -> int:
        """Writes the samples' leaves leaf-major into the uint8 array ``out``; returns bytes."""
        count, at = len(samples), 0
        for j, (dtype, shape, nbytes) in enumerate(zip(self.dtypes, self.shapes,
                                                       self.leaf_bytes)):
            dst = out[at:at + count * nbytes].view(dtype).reshape((count, *shape))
            for i, leaves in enumerate(samples):
                dst[i] = leaves[j]
            at += count * nbytes
        return at

    def unpack(self, buf: np.ndarray, count: int):
        """The batch in ``buf`` (``count`` samples, as ``pack`` wrote them) as tensors that
        view ``buf``, in the sample's structure."""
        import torch

        tensors, at = [], 0
        for dtype, shape, nbytes in zip(self.dtypes, self.shapes, self.leaf_bytes):
            array = buf[at:at + count * nbytes].view(dtype).reshape((count, *shape))
            tensors.append(torch.from_numpy(array))
            at += count * nbytes
        return _build(self.tree["structure"], tensors)


def _build(node: dict, tensors: list):
    if "leaf" in node:
        return tensors[node["leaf"]]
    if "dict" in node:
        return {k: _build(v, tensors) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_build(v, tensors) for v in node["tuple"])
    return [_build(v, tensors) for v in node["list"]]


def _show(pairs) -> str:
    return "[" + ", ".join(f"({d}, {tuple(s)})" for d, s in pairs) + "]"
