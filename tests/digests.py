"""A digest of a state: nested dicts, lists and tuples of tensors and numbers (dict keys
sorted), the same bytes in a test and in a rank script (tests/ranks/ put this folder on their
path to import it), so that two processes' states compare by one string."""

from __future__ import annotations

import hashlib


def digest(values, length: int | None = None) -> str:
    """The SHA-256 of ``values``'s keys, tensors' bytes and other items' ``repr``, in hex
    (its first ``length`` characters if given)."""
    import torch

    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, dict):
            for k in sorted(v):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().numpy().tobytes())
        else:
            h.update(repr(v).encode())

    walk(values)
    return h.hexdigest()[:length]
