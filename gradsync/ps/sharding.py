"""How a model's parameters are spread over the servers: equal slices of one flat vector.

All parameters, in the model's order, are laid end to end in one flat float32 vector; server
``s`` of ``S`` owns the contiguous slice ``[bounds[s], bounds[s+1])``, each about ``n / S``
elements (cut at multiples of 16 elements, 64 bytes). A large tensor is thereby split across
servers and small ones are packed together, so every server stores, receives and updates the
same number of bytes whatever the tensor sizes. Example, tensors of 10, 1000 and 6 elements
on 2 servers (n = 1016)::

    flat:      [ w0: 0..10 | w1: 10..1010 | w2: 1010..1016 ]
    servers:   [ server 0: 0..512         | server 1: 512..1016 ]

Server 0 holds ``w0`` and the first 502 elements of ``w1``; server 1 the rest of ``w1`` and
``w2``. A worker pushes ``grad[0:512]`` to server 0 and ``grad[512:1016]`` to server 1.
"""

from __future__ import annotations

__all__ = ["bounds", "offsets", "ALIGN"]

ALIGN = 16


def offsets(numels: list[int]) -> list[int]:
    """Start of each tensor in the flat vector, and the total at the end."""
    out = [0]
    for n in numels:
        if n < 0:
            raise ValueError(f"a tensor cannot have {n} elements")
        out.append(out[-1] + n)
    return out


def bounds(total: int, servers: int) -> list[int]:
    """``servers + 1`` cut points: server ``s`` owns ``[b[s], b[s+1])`` of ``total`` elements.

    Raises:
        ValueError: no server, or a negative total.
    """
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    cuts = [min(total, round(total * s / servers / ALIGN) * ALIGN) for s in range(servers)]
    return cuts + [total]
