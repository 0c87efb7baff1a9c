"""A data server started again is taken back by every worker at one agreed epoch.

In an elastic job the launcher starts a data server that died again in its slot
(``run/data_servers.py``). Each process that serves as data server ``d`` has an
*incarnation*: 1 for the first to publish its address, 2 for the next, and so on (the server
counts them in the job's store, ``server.serve``). Once its address is published it writes a
*ready record*, ``data/ready/<d>``: its incarnation, host and pid.

Why not take a ready server back at once? Exactly-once within an epoch does not care where a
worker's batches come from: each worker takes its own batches of the plan, and those of a
server it does not use are handed to the others at the end of the epoch (``Loader._adopt``).
What cares is the *live state* of a recovery without roll-back (``elastic.py``): it credits a
lost worker its first ``n`` batches of the plan, which is right only if that worker took its
batches in plan order, that is, if it used every data server in that epoch. A survivor knows
whether it did itself (``LoaderState.resumable``); it can vouch for the lost worker only if
every worker of the epoch used the same servers. So the rule:

    **In epoch e, every worker takes data server d's batches from incarnation
    ``wanted(table, d, e)``, or from nobody.** ``table`` is agreed by every worker; a
    worker that cannot reach that incarnation treats ``d`` as lost for the epoch (and writes
    so in the store, as any loss: ``Loader._lose``).

The *table* holds, per server that came back, a ``Return``: the incarnation, its host and
pid, and the epoch from which it serves. Without an entry, incarnation 1 serves from epoch 0;
with one, that incarnation serves from its epoch on, and before it nobody serves ``d`` (every
older incarnation has exited: the launcher starts a new one only then).

**The agreement** (``agree``) happens inside a collective that every worker already makes,
so that it costs no message of its own and every worker computes it from the same input:

- a *commit* (``Loader.state_dict``, an allgather of every worker's position), and
- a *re-formation* (``LoaderState.sync``, a broadcast of rank 0's kept state; or
  ``sync_from``, an allgather of the survivors' positions), which is also how a new worker
  learns the table before its first epoch.

Each worker adds a *report* (``Loader.server_report``): the table as it holds it, and, for
each server it does not use, the ready record it reads in the store if that names a newer
incarnation that nobody has recorded lost (a *candidate*). ``agree`` merges them: every
entry of every report's table (the highest incarnation per server wins), then every
candidate newer than the merged entry, which serves from ``epoch``: the epoch after
the furthest any member of the collective may have started (its highest reported epoch + 1).
No worker has started it, and every worker leaves the collective knowing it, so every worker
plans that epoch with the same servers. A collective that fails part-way (a member lost in
it) may leave a new entry on some members only; the re-formation that follows makes the
tables one again before anyone iterates: ``sync_from`` merges every member's, and ``sync``
(a roll-back, which resets every member to the kept epoch) gives every member rank 0's.

A worked example: 2 workers, 2 data servers, commits every 4 steps, 11 steps per epoch.
Data server 0 dies in step 3 of epoch 0; both workers go on with server 1 alone. Its
replacement (incarnation 2) publishes during step 6; at the commit after step 8 worker 0,
which does not use server 0, reads the ready record and reports it: both workers agree on
``Return(2, host, pid, epoch=1)``. The rest of epoch 0 is served without server 0 (its
batches from server 1 at the end); at the start of epoch 1 each worker connects to
incarnation 2 and takes its plan's batches of server 0 from it, in plan order.
"""

from __future__ import annotations

import json
from typing import NamedTuple

__all__ = ["Return", "ready_key", "ready_record", "read_ready", "agree", "wanted"]


class Return(NamedTuple):
    """An agreed return: incarnation ``incarnation`` of a data server (the process ``pid``
    on ``host``) serves every worker from epoch ``epoch`` on."""

    incarnation: int
    host: str
    pid: int
    epoch: int


def ready_key(server: int) -> str:
    """The store key of data server ``server``'s latest ready record."""
    return f"data/ready/{server}"


def ready_record(incarnation: int, host: str, pid: int) -> str:
    """What a data server writes at ``ready_key`` once its address is published."""
    return json.dumps({"incarnation": incarnation, "host": host, "pid": pid})


def read_ready(text: bytes | str) -> tuple[int, str, int]:
    """The (incarnation, host, pid) of a ready record."""
    record = json.loads(text)
    return int(record["incarnation"]), str(record["host"]), int(record["pid"])


def agree(reports: list[dict], epoch: int) -> dict[int, Return]:
    """The table every member of a collective computes from the same ``reports``.

    Args:
        reports: every member's ``Loader.server_report()``, in rank order: ``{"returns":
            {server: Return}, "ready": {server: (incarnation, host, pid)}}``.
        epoch: the first epoch no member can have started: a new return serves from it.

    Returns:
        The merged table: per server, its latest return.
    """
    table: dict[int, Return] = {}
    for report in reports:
        for server, entry in report["returns"].items():
            known = table.get(server)
            if known is None or entry[0] > known.incarnation:
                table[server] = Return(*entry)
    for report in reports:
        for server, (incarnation, host, pid) in report["ready"].items():
            known = table.get(server)
            if incarnation > (1 if known is None else known.incarnation):
                table[server] = Return(incarnation, host, pid, epoch)
    return table


def wanted(table: dict[int, Return], server: int, epoch: int) -> int | None:
    """The incarnation of data server ``server`` that every worker uses in ``epoch``; None:
    none (the one that came back serves from a later epoch, and the older ones have
    exited)."""
    entry = table.get(server)
    if entry is None:
        return 1
    return entry.incarnation if epoch >= entry.epoch else None
