"""An elastic job's hosts: which are listed, which are blacklisted or unreachable, and how
many worker slots each has free.

A static job's hosts are fixed and checked once before its ranks start (``launcher.py``). An
elastic job's come and go while it runs (``elastic.py``), and a host is *usable* for a new
worker when all three hold:

- **listed**: by the latest good answer of ``--host-discovery-script`` (``discovery.py``),
  else by ``-H`` (or this machine alone), and not a data host (``--data-hosts``: its slots are
  the data servers');
- **not blacklisted**: a host whose worker failed stays out ``--blacklist-cooldown`` seconds
  (for good by default), or by horovodrun's backoff rule (``--blacklist-cooldown-range``, at
  the host's n-th failure: ``ElasticSpec.cooldown``); it comes back once that time is past;
- **reachable**: this machine, or a remote host whose ssh check (``ssh host true``,
  ``processes.Ssh.probe``) passed. The check runs in the background when the host is first
  listed; a host that fails it is blacklisted like a failed worker's, and checked again once
  that blacklisting ends.

Its free slots are its listed slots minus the workers that hold one there (``free``). When
discovery lists a host with fewer slots, or no longer lists it, the workers beyond its slots
(the last ones placed) must go (``beyond``).

Example: discovery lists ``a:2, b:2, d:1`` with ``--data-hosts d:1``; ``a`` has passed its
check, ``b``'s has not finished; one worker runs on ``a``. Free: ``["a"]``. ``b`` passes its
check: ``["a", "b", "b"]``. A worker on ``b`` fails: ``b`` is blacklisted (and its other
workers stopped, by the policy), and free is ``["a"]`` again.

This module decides nothing about workers: the elastic policy counts who holds a slot, starts
and stops the workers, and asks the pool where there is room.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Protocol, Sequence, TypeVar

from .discovery import Discovery
from .hosts import Host
from .ranks import is_local
from .processes import HostChecks, Output, Ssh

__all__ = ["HostPool"]

_POLL = 0.05  # how often the start looks at the first hosts' ssh checks


class _Placed(Protocol):
    host: str


W = TypeVar("W", bound=_Placed)


class HostPool:
    """An elastic job's hosts (see the module docstring).

    Args:
        static_hosts: the hosts of ``-H`` (or this machine), used when there is no discovery.
        data_hosts: ``--data-hosts``: checked like the others, never offering a worker slot.
        cooldown: seconds a host stays blacklisted at its n-th failure; None: for good.
        output: where messages go.

    Attributes:
        discovery: the running discovery script, when the job has one (set by its start).
        blacklist: host -> ``time.monotonic()`` when it may come back (``math.inf``: never).
        reachable: the remote hosts whose ssh check passed.
    """

    def __init__(self, static_hosts: Sequence[Host], data_hosts: Sequence[Host],
                 cooldown: Callable[[int], float | None], output: Output):
        self.static_hosts, self.data_hosts = list(static_hosts), list(data_hosts)
        self.cooldown, self.output = cooldown, output
        self.discovery: Discovery | None = None
        self.blacklist: dict[str, float] = {}
        self.reachable: set[str] = set()
        self._failures: dict[str, int] = {}  # per host: how often it was blacklisted
        self._checks: HostChecks | None = None  # the ssh checks, made at the first probe
        self._seen_version = 0  # the discovery script's answer last looked at

    def listed(self) -> list[Host]:
        """The workers' hosts now: discovery's latest good answer, else the static ones."""
        if self.discovery is not None:
            return self.discovery.hosts or []
        return self.static_hosts

    def news(self) -> bool:
        """True when discovery has a new answer since the last call."""
        if self.discovery is None or self.discovery.version == self._seen_version:
            return False
        self._seen_version = self.discovery.version
        return True

    # ------------------------------------------------------------------ slots
    def free(self, held: Sequence[str]) -> list[str]:
        """One entry per free slot of a usable host, hosts in listed order; ``held``: the
        host of each worker that holds a slot."""
        now = time.monotonic()
        data_hosts = {h.name for h in self.data_hosts}
        free = []
        for host in self.listed():
            if self.blacklist.get(host.name, 0) > now or host.name in data_hosts:
                continue  # (a data host's slots are its data servers')
            if not is_local(host.name) and host.name not in self.reachable:
                continue  # its ssh check has not passed (yet)
            used = sum(1 for h in held if h == host.name)
            free += [host.name] * max(0, host.slots - used)
        return free

    def beyond(self, placed: Sequence[W]) -> list[W]:
        """The workers of ``placed`` (in placement order) whose host discovery no longer
        lists, or that are beyond the slots it now lists for their host: the last ones on
        the host; none without a discovery answer."""
        if self.discovery is None or self.discovery.hosts is None:
            return []
        slots = {h.name: h.slots for h in self.discovery.hosts}
        seen: dict[str, int] = {}
        out = []
        for worker in placed:
            seen[worker.host] = seen.get(worker.host, 0) + 1
            if seen[worker.host] > slots.get(worker.host, 0):
                out.append(worker)
        return out

    # ------------------------------------------------------------------ the blacklist
    def ban(self, host: str, what: str) -> None:
        """Blacklists ``host`` (``what``: why, for the message) for its cooldown."""
        self._failures[host] = self._failures.get(host, 0) + 1
        cooldown = self.cooldown(self._failures[host])
        self.blacklist[host] = math.inf if cooldown is None else time.monotonic() + cooldown
        self.output.message(f"{what}; host {host} is blacklisted"
                            + ("" if cooldown is None else f" for {cooldown:g}s"))

    def banned(self) -> list[str]:
        """The hosts blacklisted now."""
        now = time.monotonic()
        return [h for h, until in self.blacklist.items() if until > now]

    def cooled_down(self) -> bool:
        """True once when a blacklisted host's cooldown has passed."""
        now = time.monotonic()
        expired = [h for h, until in self.blacklist.items() if until <= now]
        for host in expired:
            del self.blacklist[host]
            self.output.message(f"host {host} is no longer blacklisted")
        return bool(expired)

    # ------------------------------------------------------------------ remote hosts
    def check_first(self, ssh: Ssh, interrupted: Callable[[], bool]) -> None:
        """Checks the remote hosts known at the start before the first generation, so that
        it can place workers on them; an unreachable one is blacklisted."""
        self.probe(ssh)
        while self._checks and not interrupted():
            time.sleep(_POLL)
            self.probe(ssh)

    def probe(self, ssh: Ssh) -> bool:
        """Starts the ssh check (``Ssh.probe``) of each listed remote host not yet checked,
        and collects the finished ones: a reachable host may take workers; an unreachable one
        is blacklisted (for ``--blacklist-cooldown``). True when a host became reachable."""
        if self._checks is None:
            self._checks = HostChecks(ssh)
        checks, now = self._checks, time.monotonic()
        for host in [*self.listed(), *self.data_hosts]:
            name = host.name
            if is_local(name) or name in self.reachable or name in checks or \
                    self.blacklist.get(name, 0) > now:
                continue
            checks.start(name)
        added = False
        for name, error, _ in checks.collect():
            if error is None:
                self.reachable.add(name)
                added = True
            else:
                self.ban(name, error)
        return added

    def end(self) -> None:
        """Stops the discovery script and the ssh checks still running."""
        if self.discovery is not None:
            self.discovery.stop()
        if self._checks is not None:
            self._checks.end()
