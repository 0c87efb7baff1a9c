"""The names of the Horovod API's unnamed operations, counted per kind and process set.

As in Horovod, an operation's name is its kind and the caller's name (``allreduce.grad.fc1``);
a call without a name gets ``<kind>.noname.<n>``, where ``n`` counts this rank's unnamed calls
of that kind in that process set. Ranks that issue the same unnamed calls (in whatever order
relative to other kinds and sets) so agree on their names.

Two writers keep the counts: ``requests.py`` names each call as it is issued, and a set's
controller (``process_sets.py``, ``Controller.on_stand_in``) counts the unnamed operations
this rank took part in without issuing them (while joined). Both sit above this file, which
imports nothing of theirs. ``reset`` starts the counts again for a new ``init`` or an elastic
generation, as every rank does at the same point.
"""

from __future__ import annotations

import collections

__all__ = ["name", "skip", "reset"]

_unnamed: dict[tuple, int] = collections.defaultdict(int)  # (kind, process set id) -> next n


def name(kind: str, given: str | None, process_set_id: int) -> str:
    """The full name of an operation of ``kind`` called ``given`` (None: the next unnamed)."""
    if given is None:
        key = (kind, process_set_id)
        n, _unnamed[key] = _unnamed[key], _unnamed[key] + 1
        return f"{kind}.noname.{n}"
    return f"{kind}.{given}"


def skip(full_name: str, process_set_id: int) -> None:
    """Counts an unnamed operation that this rank did not issue but took part in, or was
    excused from, while joined, so that its next unnamed call gets the same name as the
    other ranks' next one."""
    kind, sep, n = full_name.partition(".noname.")
    if sep and n.isdigit():
        key = (kind, process_set_id)
        _unnamed[key] = max(_unnamed[key], int(n) + 1)


def reset() -> None:
    """Restarts the counts (a new ``init``)."""
    _unnamed.clear()
