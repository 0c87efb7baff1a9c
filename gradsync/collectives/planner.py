"""Which allreduce algorithm to use for a message: a size-based rule for now.

Small messages are latency-bound, so recursive doubling (log2 n steps, whole message each
step) wins; medium ones use halving-doubling (log2 n steps, half the bytes each step);
large ones the ring (2(n-1) steps, but each rank sends only 2(n-1)/n of the message, the
minimum). When every rank is on one host, the shared-memory algorithm beats all three: each
byte crosses memory a few times and never a socket.
"""

from __future__ import annotations

__all__ = ["ALGORITHMS", "choose_allreduce"]

ALGORITHMS = ("ring", "doubling", "halving_doubling", "shm")


def choose_allreduce(nbytes: int, size: int, requested: str, config, has_shm_group: bool) -> str:
    """Returns the algorithm name for an allreduce of ``nbytes`` over ``size`` ranks.

    Raises:
        ValueError: an unknown algorithm, or ``shm`` when the ranks span several hosts.
    """
    if requested == "auto":
        requested = config.algorithm
    if requested == "auto":
        if has_shm_group:
            return "shm"
        if nbytes < config.small_bytes:
            return "doubling"
        if nbytes < config.medium_bytes:
            return "halving_doubling"
        return "ring"
    if requested not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {requested!r}; choose from "
                         f"{('auto',) + ALGORITHMS}")
    if requested == "shm" and not has_shm_group and size > 1:
        raise ValueError("the shm allreduce needs every rank on one host with shared memory "
                         "(transport not forced to tcp)")
    return requested
