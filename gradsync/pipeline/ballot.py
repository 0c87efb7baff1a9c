"""The ballot of a negotiation cycle: one fixed-size bit vector per rank, combined by AND.

This is the pure part of a steady-state cycle of ``gradsync/pipeline/negotiation.py`` (after
Horovod's response cache, whose bit vector is reduced with a bitwise AND). No sockets or threads:
the ``Controller`` fills a ballot, combines the ranks' ballots with one allreduce
(``negotiation_wire.vote``) and reads the result back with the functions here.

Vocabulary. A *ballot* is an array of ``uint64`` *words*: word 0 holds the *flags*, words 1..
the *bits*, one per response-cache entry (``agreement.ResponseCache``: the entry's bit ``b``
is bit ``b % 64`` of word ``1 + b // 64``). The ballot has ``words_for(span)`` words, where
``span`` is the number of bit positions the cache has ever assigned: the same on every rank
(the cache changes in agreed order), so the ballots line up. The ranks' ballots are combined
by a bitwise AND, so

- a bit survives when every rank voted for it: that cached operation is ready everywhere;
- ``STOP`` survives when every rank asks to stop;
- ``QUIET`` survives when no rank has anything to describe in full (a name not cached, or
  rank 0's expired names): only when it does not survive does the cycle gather full
  announcements (``negotiation_wire.gather``);
- ``IDLE`` survives when no rank announced anything new.

A flag that means "some rank" is sent inverted (``QUIET`` = "not me"), so one AND serves all.

Waiting bits. A rank votes for a cached request in every cycle until the others do too; the
``Ballot`` keeps those requests, with the time each was issued. One that waits too long
(``cast``'s ``demote_after``) leaves the ballot and goes in full, carrying its age, so that
rank 0's table can warn about it and expire it on time (``agreement.Agreement.absorb``): a bit
alone says nothing about which ranks are missing.

Example, two ranks, cached ``a`` (bit 0) and ``b`` (bit 1). Rank 0 issues both, rank 1 only
``b``: ballots ``[QUIET, 0b11]`` and ``[QUIET, 0b10]``, AND ``[QUIET, 0b10]``: ``b`` runs, no
gather. Next cycle rank 0 votes ``0b01`` again and rank 1, which issued ``a`` meanwhile,
``0b01``: ``a`` runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np

from .agreement import Signature

__all__ = ["IDLE", "QUIET", "STOP", "Ballot", "bits_of", "words_for"]

STOP = 1
"""Flag: this rank asks to stop (the AND: every rank has)."""
QUIET = 2
"""Flag: this rank has nothing to announce in full (the AND: no rank has)."""
IDLE = 4
"""Flag: this rank announces nothing new this cycle (the AND: no rank does; when one does,
the others stop backing off between cycles, as when they saw its announcement in full)."""


def words_for(span: int) -> int:
    """Words of a ballot over ``span`` cache bits: the flags, then the bits."""
    return 1 + (span + 63) // 64


def bits_of(words: np.ndarray) -> Iterator[int]:
    """The cache bits set in a ballot's bit words (``ballot[1:]``), lowest first."""
    for i in np.flatnonzero(words):
        word, base = int(words[i]), 64 * int(i)
        while word:
            low = word & -word
            yield base + low.bit_length() - 1
            word ^= low


class Ballot:
    """This rank's cached requests that wait for the other ranks' votes.

    Args:
        clock: seconds, monotonic; tests pass a fake one.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._waiting: dict[str, tuple[Signature, Any, float]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, name: str) -> bool:
        return name in self._waiting

    def add(self, name: str, sig: Signature, item: Any) -> None:
        """Votes for ``name`` from the next ``cast`` on; ``item`` is what ``pop`` returns."""
        self._waiting[name] = (sig, item, self.clock())

    def pop(self, name: str) -> Any:
        """Takes ``name`` out (it was voted ready); returns its item."""
        return self._waiting.pop(name)[1]

    def cast(self, bit: Callable[[str, Signature], "int | None"], span: int,
             demote_after: float) -> tuple[np.ndarray, list[tuple[str, Signature, Any, float]]]:
        """This cycle's ballot, its flags word zero, and the requests that leave it.

        Args:
            bit: ``agreement.Agreement.bit``: the bit to vote for, or None when the request
                must go in full (no longer cached, described by another rank, a join).
            span: the cache's ``span`` (the ballot's width).
            demote_after: seconds a request may wait here before it goes in full.

        Returns:
            ``(words, demoted)``: the ballot, and ``(name, sig, item, waited)`` for each
            request that left it, in the order they were added.
        """
        words = np.zeros(words_for(span), dtype=np.uint64)
        demoted = []
        now = self.clock()
        for name, (sig, item, since) in list(self._waiting.items()):
            b = bit(name, sig)
            waited = now - since
            if b is None or waited > demote_after:
                del self._waiting[name]
                demoted.append((name, sig, item, waited))
            else:
                words[1 + (b >> 6)] |= np.uint64(1 << (b & 63))
        return words, demoted
