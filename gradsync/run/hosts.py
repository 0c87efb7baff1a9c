"""Host lists: ``h0:2,h1:2`` — which hosts a job may use and how many ranks each holds.

Four commands read a host list, and all of them read it here, with one set of rules:
``gradsync run -H`` and ``--hostfile``, the lines an elastic job's ``--host-discovery-script``
prints, ``gradsync plan --hosts`` and the emulated cluster's ``--hosts``
(``python3 -m gradsync.testbed.netns``).

An *entry* is ``host:slots`` or ``host`` (one slot). Entries are separated by commas (by
lines in a discovery script's output); white space around an entry, its name or its slot
count is ignored, and so are empty entries (``h0:2,`` or a blank line). The slot count is
after the *last* colon, so a name may hold colons itself (an IPv6 address: ``fe80::1:2``).
An entry is refused, with a message that quotes it, when:

- the name is empty (``:2``) or holds white space (``a b:2``);
- the slot count is missing after the colon (``h0:``), is not a whole number (``h0:x``) or
  is below 1 (``h0:0``, ``h0:-1``);
- its host was named by an earlier entry (``h0:1,h0:1``): each host is given once, with its
  total number of slots, so that the order of the list is the order of the hosts.

A list with no entry at all is refused too, except where no host is a valid answer (a
discovery script that finds no host now).

The ranks of a job are numbered over its hosts in one of two orders (``rank_hosts``): host
by host (all of the first host's slots, then the next's), as ``gradsync run`` and torchrun
number them, or alternately (round robin over the hosts with slots left).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["Host", "parse_hosts", "read_hostfile", "rank_hosts"]

_SLOTS = re.compile(r"[+-]?[0-9]+")
_FORM = "expected 'host:slots' or 'host'"


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run."""

    name: str
    slots: int


def parse_hosts(text: str, *, source: str = "-H", separator: str = ",",
                allow_empty: bool = False) -> list[Host]:
    """Parses a host list such as ``h0:2,h1:2`` (see the module docstring for the rules).

    Args:
        text: the list.
        source: what the list is called in error messages (``-H``, ``--hosts``, ...).
        separator: what separates the entries: ``","``, or ``"\\n"`` for one entry a line.
        allow_empty: return ``[]`` for a list without entries instead of refusing it.

    Raises:
        ValueError: a bad entry (the message quotes it), a host named twice, or no host.
    """
    entries = text.splitlines() if separator == "\n" else text.split(separator)
    hosts = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        name, colon, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        where = f"{source} entry {entry!r}"
        hosts.append((_host(name.strip(), slots.strip(), bool(colon), where), where))
    return _checked(hosts, source, allow_empty)


def read_hostfile(path: str) -> list[Host]:
    """Reads a host file: one ``host slots=N``, ``host:N`` or ``host`` per line; ``#`` comments.

    Raises:
        ValueError: a line in another form or a bad entry (the message names the file and
            line number), a host named twice, or a file that names no host.
    """
    hosts = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{path}:{number} {line.strip()!r}"
            if len(words) == 1 and ":" in words[0]:
                name, _, slots = words[0].rpartition(":")
                hosts.append((_host(name, slots, True, where), where))
            elif len(words) == 1:
                hosts.append((_host(words[0], "1", False, where), where))
            elif len(words) == 2 and words[1].startswith("slots="):
                hosts.append((_host(words[0], words[1][len("slots="):], True, where), where))
            else:
                raise ValueError(f"{where}: expected 'host slots=N', 'host:N' or 'host'")
    return _checked(hosts, f"host file {path}", allow_empty=False)


class _Slotted(Protocol):
    name: str
    slots: int


def rank_hosts(hosts: Sequence[_Slotted], alternate: bool = False) -> list[str]:
    """The host of each rank, in rank order.

    Args:
        hosts: anything with a ``name`` and a number of ``slots``, in host order.
        alternate: round robin over the hosts that have slots left (with 2, 1 and 2 slots:
            h0 h1 h2 h0 h2) instead of host by host (h0 h0 h1 h2 h2).
    """
    if not alternate:
        return [h.name for h in hosts for _ in range(h.slots)]
    left = {h.name: h.slots for h in hosts}
    order = []
    while any(count > 0 for count in left.values()):
        for h in hosts:
            if left[h.name] > 0:
                order.append(h.name)
                left[h.name] -= 1
    return order


def _host(name: str, slots: str, colon: bool, where: str) -> Host:
    """One entry, checked; ``where`` names it in the error messages."""
    if not name:
        raise ValueError(f"{where}: no host name; {_FORM}")
    if any(c.isspace() for c in name):
        raise ValueError(f"{where}: host name {name!r} holds white space; {_FORM}")
    if colon and not slots:
        raise ValueError(f"{where}: no slot count after ':'; {_FORM}")
    if not _SLOTS.fullmatch(slots):
        raise ValueError(f"{where}: slots {slots!r} is not an integer; {_FORM}")
    if int(slots) < 1:
        raise ValueError(f"{where}: slots must be at least 1, got {int(slots)}; {_FORM}")
    return Host(name, int(slots))


def _checked(entries: list[tuple[Host, str]], source: str, allow_empty: bool) -> list[Host]:
    """The hosts of ``entries`` (each with where it was written), once each and not none
    (unless allowed)."""
    seen: set[str] = set()
    for host, where in entries:
        if host.name in seen:
            raise ValueError(f"{where}: host {host.name!r} was named before; give each host "
                             "once with its total number of slots")
        seen.add(host.name)
    if not entries and not allow_empty:
        raise ValueError(f"{source} names no host; {_FORM} entries, e.g. h0:2,h1:2")
    return [host for host, _ in entries]
