"""The agreement table of name negotiation: what every rank announced, and what is ready.

This is the pure part of ``gradsync/pipeline/negotiation.py``: no processes, sockets, threads or
tensors. The ``Controller`` there moves the announcements between ranks and runs what is
ready; this module decides, from the announcements alone, what is ready, in which order,
whether the ranks agree on it, and what has waited too long. Every rank holds one
``Agreement`` per World and feeds it the same announcements in the same cycles, so every rank
reaches the same decisions without a coordinator.

Vocabulary. A *signature* (``Signature``) is what one rank says about an operation: its kind,
dtype, shape, reduce op, root, scale factors and whether its buffer is shared. A cycle's
*announcements* are, per rank, the ``(name, signature)`` pairs that rank issued since the
last cycle. The *table* maps each name to ``{rank: signature}``; a name is *ready* when every
rank of the World has announced it. Ready names come out in *agreed order*: the order in
which names first entered the table, reading each cycle's announcements rank 0 first, then
rank 1, and so on. Since every rank reads the same announcements in the same order, every
rank computes the same order.

Example, two ranks. Rank 0 issues ``a``, ``b``; rank 1 issues ``b``, then (later) ``a``.
Cycle 1 absorbs ``[a, b]`` from rank 0 and ``[b]`` from rank 1: ``b`` is ready. Cycle 2
absorbs ``[]`` and ``[a]``: ``a`` is ready. Neither rank waits for an operation the other
has not reached.

Agreement. A ready name's signatures are the same on every rank's table, so every rank
reaches the same verdict: they agree when their ``match_key``\\ s are equal (for allgather and
alltoall every field but the first dimension, which may differ between ranks). When they
disagree the operation does not run anywhere and ``mismatch_error`` names what each rank
issued.

Join. A rank that runs out of data announces ``JOIN``. From then on a name is ready once
every rank that has not joined announced it; ``JOIN`` itself is ready when every rank has
announced it, and ``end_join`` then returns the rank that joined last and clears the joined
set for the next round.

Response cache (after Horovod's ``response_cache.cc``). Once an operation has run, every rank
stores its (name, signature) under the same *bit* (``ran`` is called in agreed order, so bits
are assigned and evicted identically everywhere). A rank that issues a cached name with an
unchanged signature does not describe it: it votes for its bit (``bit``) in the cycle's
*ballot*, a bit vector that the ranks combine with a bitwise AND (``gradsync/pipeline/ballot.py``),
and a bit that every rank voted for is ready (``voted``), with the cached signature on every rank.
A name goes in full (into the table) instead when it is not cached, when its signature
changed, when the table already holds it (some rank described it: the others must meet it
there) or while some rank has joined (the table knows who must be waited for; the ballot
does not). Unnamed operations (``allreduce.noname.7``) never repeat and are not cached; a
name that merely contains an unnamed parameter's (a ``DistributedOptimizer`` bucket's,
``gradients[0] allreduce.noname.0.0 .. allreduce.noname.0.3 (4 tensors, float32)``) repeats
every step and is.

Stalls. A name that some ranks announced and others never do would wait for ever. Rank 0 of
the World keeps the time each name entered the table (``JOIN`` excepted: a joined rank may
wait hours for the others), less the seconds a rank says it waited as a ballot bit before it
went in full (``absorb``'s ``waited``); ``stalled`` reports the names past the warning time
once (with the ranks that issued them and those still missing) and returns those past the
timeout, which rank 0 announces as expired. Every rank passes that list to ``expire`` in the
same cycle, so every rank drops the same names. The clock is a parameter, so the expiry can
be tested with a fake one.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable, NamedTuple

from ..errors import CollectiveMismatchError

__all__ = ["JOIN", "Agreement", "ResponseCache", "Signature", "Stall", "agreed", "describe",
           "mismatch_error"]

JOIN = "join"
"""The name (and kind) of the join operation (``Controller.announce_join``)."""

# Kinds whose first dimension may differ between ranks.
_RAGGED = ("allgather", "alltoall")


class Signature(NamedTuple):
    """What must agree between the ranks' requests of one name.

    Attributes:
        kind: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``,
            ``barrier`` or ``join``.
        dtype: the dtype's name (``float32``, ``bfloat16``; ``none`` for join).
        shape: the tensor's shape, as a tuple of ints.
        op: the reduce op's name (``SUM``), or None.
        root: the broadcast root (rank in the World), or None.
        prescale: the factor applied before the reduction (1.0 when none).
        postscale: the factor applied after it (1.0 when none).
        shared: the allreduce's buffer is the host's shared buffer
            (``ShmGroup.shared_buffer``): it is reduced where it is, never fused.
    """

    kind: str
    dtype: str
    shape: tuple
    op: str | None
    root: int | None
    prescale: float
    postscale: float
    shared: bool

    def match_key(self) -> tuple:
        """What must be equal on every rank: everything, but for allgather and alltoall the
        first dimension."""
        if self.kind in _RAGGED:
            return (self.kind, self.dtype, len(self.shape), self.shape[1:], *self[3:])
        return self


def describe(sig: tuple) -> str:
    """``allreduce float32[17, 17] op=SUM`` for a signature."""
    kind, dtype, shape, op, root, pre, post, shared = sig
    text = f"{kind} {dtype}{list(shape)}"
    if op is not None:
        text += f" op={op}"
    if root is not None:
        text += f" root={root}"
    if (pre, post) != (1.0, 1.0):
        text += f" prescale={pre} postscale={post}"
    if shared:
        text += " (in a shared buffer)"
    return text


def agreed(by_rank: dict[int, Signature]) -> bool:
    """Whether the ranks' signatures of one ready name match (``Signature.match_key``)."""
    return len({sig.match_key() for sig in by_rank.values()}) <= 1


def mismatch_error(name: str, by_rank: dict[int, Signature],
                   ranks: list[int]) -> CollectiveMismatchError:
    """The error every rank raises for a name whose signatures disagree.

    Args:
        name: the operation's name.
        by_rank: each announcing rank's signature (ranks of the World).
        ranks: the global rank of each rank of the World (for the message).
    """
    groups: dict[str, list[int]] = {}
    for r in sorted(by_rank):
        groups.setdefault(describe(by_rank[r]), []).append(ranks[r])
    lines = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {what}"
                      for what, rs in groups.items())
    return CollectiveMismatchError(
        f"operation '{name}' was issued differently by the ranks, so it did not run ({lines}); "
        f"the ranks can go on with other operations")


class ResponseCache:
    """Names and signatures of operations that ran, each under a bit every rank agrees on.

    Args:
        capacity: entries kept; the least recently used one is evicted beyond it.
    """

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._bits: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._entries: dict[int, tuple[str, Signature]] = {}
        self._free: list[int] = []
        self.span = 0
        """Bit positions ever assigned (the highest plus one): the ballot's width, the same
        on every rank."""

    def __len__(self) -> int:
        return len(self._bits)

    def bit(self, name: str, sig: Signature) -> int | None:
        """The bit of ``name`` if it is cached with exactly ``sig``."""
        bit = self._bits.get(name)
        if bit is not None and self._entries[bit][1] == sig:
            return bit
        return None

    def entry(self, bit: int) -> tuple[str, Signature]:
        """The ``(name, signature)`` cached under ``bit``."""
        return self._entries[bit]

    def put(self, name: str, sig: Signature) -> None:
        """Records that ``name`` ran with ``sig`` (every rank calls this in agreed order)."""
        _, unnamed, count = name.partition(".noname.")
        if unnamed and count.isdigit():  # <kind>.noname.<n>: the next call gets n + 1
            return
        bit = self._bits.get(name)
        if bit is not None:
            self._bits.move_to_end(name)
            self._entries[bit] = (name, sig)
            return
        if len(self._bits) >= self.capacity:
            _, old = self._bits.popitem(last=False)
            del self._entries[old]
            self._free.append(old)
        bit = self._free.pop() if self._free else len(self._bits)
        self.span = max(self.span, bit + 1)
        self._bits[name] = bit
        self._entries[bit] = (name, sig)


class Stall(NamedTuple):
    """A name that has waited past the warning time (reported once by ``stalled``).

    Attributes:
        name: the operation's name.
        waited: seconds since it entered the table.
        issued: the global ranks that announced it.
        missing: the global ranks it still waits for.
    """

    name: str
    waited: float
    issued: list[int]
    missing: list[int]


Announcement = tuple[str, Signature]


class Agreement:
    """The table of one World's announced operations (see the module docstring).

    Args:
        rank: this rank in the World (only rank 0 times stalls).
        ranks: the global rank of each rank of the World (for messages).
        clock: seconds, monotonic; tests pass a fake one.
        capacity: entries of the response cache.
    """

    def __init__(self, rank: int, ranks: list[int], *,
                 clock: Callable[[], float] = time.monotonic, capacity: int = 1024):
        self.rank, self.ranks, self.size = rank, list(ranks), len(ranks)
        self.clock = clock
        self.cache = ResponseCache(capacity)
        self.joined: list[int] = []
        """The ranks that announced ``JOIN`` since the last join ended, in agreed order."""
        self._table: dict[str, tuple[int, dict[int, Signature]]] = {}
        self._since: dict[str, float] = {}  # rank 0: when each name in the table first appeared
        self._warned: set[str] = set()
        self._order = 0

    def __contains__(self, name: str) -> bool:
        return name in self._table

    # ------------------------------------------------------------------ the cache's bits
    def bit(self, name: str, sig: Signature) -> int | None:
        """The ballot bit this rank votes for to announce ``name`` with ``sig``, or None when
        it must go in full: not cached with ``sig``, already in the table, or some rank has
        joined (see the module docstring)."""
        if self.joined or name in self._table:
            return None
        return self.cache.bit(name, sig)

    def voted(self, bits: Iterable[int]) -> list[tuple[str, dict[int, Signature]]]:
        """The names every rank voted for (the AND of the ballots' bits), lowest bit first,
        each with its cached signature for every rank, as ``absorb`` returns ready names.
        Call it before anything of the cycle runs: running changes the cache."""
        entry, ranks = self.cache.entry, range(self.size)
        ready = []
        for b in bits:
            name, sig = entry(b)
            ready.append((name, dict.fromkeys(ranks, sig)))
        return ready

    def ran(self, name: str, sig: Signature) -> None:
        """Records that ``name`` ran (in agreed order, on every rank), for the cache."""
        self.cache.put(name, sig)

    # ------------------------------------------------------------------ the table
    def absorb(self, announced: list[list[Announcement]],
               waited: list[dict[str, float]] | None = None) -> tuple[list[tuple[str, dict]], bool]:
        """Adds one cycle's announcements and returns what became ready.

        Args:
            announced: per rank of the World, its announcements of the cycle in full.
            waited: per rank, the seconds it waited as a ballot bit for each name it now
                announces in full (absent: none); rank 0's stall clock starts that much
                earlier, so a cached name stalls and expires on the documented times.

        Returns:
            ``(ready, any)``: the ready names with their ``{rank: signature}``, in agreed
            order, removed from the table; and whether any rank announced anything.
        """
        touched, anything = [], False
        joined_before = len(self.joined)
        table, timed = self._table, self.rank == 0
        for r, pairs in enumerate(announced):
            for name, sig in pairs:
                anything = True
                if name == JOIN:
                    self.joined.append(r)
                entry = table.get(name)
                if entry is None:
                    entry = table[name] = (self._order, {})
                    self._order += 1
                if timed and name != JOIN:  # a joined rank may wait for hours
                    since = self.clock() - (waited[r].get(name, 0.0) if waited else 0.0)
                    self._since[name] = min(self._since.get(name, since), since)
                entry[1][r] = sig
                touched.append(name)
        if len(self.joined) != joined_before:
            touched = list(table)  # fewer ranks to wait for: anything may be ready now
        size, joined = self.size, set(self.joined)
        active = size - len(self.joined)
        ready = sorted({(table[n][0], n) for n in touched
                        if n in table and (
                            len(table[n][1]) == size if n == JOIN else
                            len(set(table[n][1]) - joined) == active)})
        for _, n in ready:
            self._since.pop(n, None)
            self._warned.discard(n)
        return [(n, table.pop(n)[1]) for _, n in ready], anything

    def end_join(self) -> int:
        """Ends the join round once ``JOIN`` is ready; returns the rank that joined last."""
        last, self.joined = self.joined[-1], []
        return last

    def who(self, name: str) -> tuple[list[int], list[int]]:
        """The global ranks that announced ``name`` and those it still waits for."""
        by_rank = self._table[name][1]
        issued = sorted(self.ranks[r] for r in by_rank)
        missing = sorted(self.ranks[r] for r in range(self.size)
                         if r not in by_rank and r not in self.joined)
        return issued, missing

    # ------------------------------------------------------------------ stalls
    def stalled(self, warning: float, timeout: float) -> tuple[list[Stall], tuple[str, ...]]:
        """Rank 0: the names newly past ``warning`` seconds (each reported once), and those
        past ``timeout``, to be announced as expired. Other ranks: nothing."""
        if self.rank != 0 or not self._since:
            return [], ()
        now = self.clock()
        stalls, expired = [], []
        for name, since in self._since.items():
            waited = now - since
            if waited > timeout:
                expired.append(name)
            elif waited > warning and name not in self._warned:
                self._warned.add(name)
                stalls.append(Stall(name, waited, *self.who(name)))
        return stalls, tuple(expired)

    def expire(self, names: Iterable[str]) -> list[tuple[str, tuple[list[int], list[int]]]]:
        """Drops the names rank 0 announced as expired (the same cycle on every rank).

        Returns:
            For each name still in the table: ``(name, (issued, missing))`` as ``who``.
        """
        dropped = []
        for name in names:
            if name in self._table:
                dropped.append((name, self.who(name)))
                self._table.pop(name)
            self._since.pop(name, None)
            self._warned.discard(name)
        return dropped
