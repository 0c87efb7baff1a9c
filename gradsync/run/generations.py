"""The launcher's side of an elastic job's control plane: the generations it publishes.

An elastic job's workers agree on who is in the job through a few keys in the launcher's
store, ``gradsync/<job>/elastic/...`` (their schema, and the workers' side of them:
``gradsync/elastic/membership.py``, ``Control``). Only the launcher writes them, and only
through this module, so everything it ever tells the workers about membership happens here:

- **publish** generation ``g``: ``members/<g>`` (the workers in rank order), then ``gen``;
- **abort** the generations a loss replaces: a ``PeerLostError`` posted into the abort record
  of each generation still *open* (published and not aborted), so that survivors waiting in
  one stop at once. A generation that only new workers replaced stays open once it has
  formed: its workers train on in it until their next ``commit()`` sees the newer ``gen``.
  One not yet formed is aborted too (its members might wait for each other in two
  generations);
- **read** the abort records of the generations workers may still train in (the newest, the
  one before it, every open one): what a worker's heartbeat or a failed collective reported;
- **exclude** a worker (``excluded/<id>``: why it is out, for it to raise if it comes back),
  **ask** whether a new worker is ready (``ready/<id>``), whether the newest generation has
  formed (its World's address table, ``peers``, is out), and **give up** (``failed``).

What it remembers is what those answers need: the newest generation and its members, the
members of each generation published (a record names a lost worker by its rank *there*), and
which generations are open. The members are the launcher's own records of its workers (any
object with an ``id`` and a ``host``); when to publish, whom to list and what to do about a
record are the elastic policy's (``elastic.py``), which starts and stops the processes.

Example: generation 0 is ``[a, b, c]``. ``b`` dies; the policy publishes ``[a, c]`` as
generation 1 with ``now=True``: generation 0's abort record gets the loss and 0 is closed.
Then a new worker ``d`` is ready; the policy publishes ``[a, c, d]`` as generation 2 with
``now=False``: generation 1 has formed (``a`` and ``c`` train in it), so nothing is aborted,
1 and 2 are open, and a silent worker reported in either record is seen. Had ``d`` been ready
before 1 formed, 1 would have been aborted, and ``a`` and ``c`` would form 2 with ``d``.

The store is the launcher's own, so a failed request is unlikely; a read that fails is said
once per distinct error and the client replaced (one whose call failed midway may stay out of
step with the server), so that the next poll reads again.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Generic, Protocol, TypeVar

from ..elastic.membership import Control

__all__ = ["Generations", "Member"]


class Member(Protocol):
    """What a generation lists of a worker."""

    id: str
    host: str


M = TypeVar("M", bound=Member)


class Generations(Generic[M]):
    """An elastic job's generations, as its launcher publishes them (see the module docstring).

    Args:
        say: where messages go (``Output.message``).

    Attributes:
        control: the job's control keys (``host`` makes it; a test may give its own).
        gen: the newest generation published (-1 before the first).
        members: its members, in rank order.
        open: the generations published and not aborted, oldest first.
    """

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.control: Control | None = None
        self.gen = -1
        self.members: list[M] = []
        self.open: list[int] = []
        self._of: dict[int, list[M]] = {}
        self._port = 0
        self._warned = ""

    def host(self, base, job_id: str, port: int) -> None:
        """Uses the store the launcher hosts (``base``, listening on ``port``)."""
        self.control = Control(base, job_id, 30.0)
        self._port = port

    @property
    def _control(self) -> Control:
        assert self.control is not None  # made by host(), before any generation
        return self.control

    def of(self, gen: int) -> list[M]:
        """The members of generation ``gen`` in rank order (none if never published)."""
        return self._of.get(gen, [])

    # ------------------------------------------------------------------ writing
    def publish(self, members: list[M], now: bool) -> int:
        """Publishes ``members`` as the next generation and returns its number. ``now``: it
        replaces the open generations after a loss, whose abort records get it."""
        gen = self.gen + 1
        self._control.publish(gen, [{"id": m.id, "host": m.host} for m in members])
        if now:
            self.abort_older(f"the job was re-formed as generation {gen} of {len(members)} "
                             "workers")
        else:
            self._abort_unformed(gen)
        self.gen, self.members = gen, members
        self.open.append(gen)
        self._of[gen] = members
        return gen

    def _abort_unformed(self, gen: int) -> None:
        """Aborts the open generations that generation ``gen`` replaces before they formed.

        Only a formed generation trains on until its workers' next ``commit()``. One whose
        World has not formed may have members that read the newest generation on either side
        of ``gen``'s publication: one waits for the others in the old generation, they wait
        for it in ``gen``, each for the whole connect timeout (a CI run's survivors of a kill
        split so between generation 1, the two of them, and 2, where the new worker came in).
        Aborted, its members stop waiting and join ``gen``. A generation that forms between
        the look and the abort fails its first collective and recovers into ``gen``, as
        after a loss; one whose state the store did not give is left open."""
        for old in list(self.open):
            if self.formed(old) is False:
                self._control.abort(old, f"generation {old} was replaced by generation {gen} "
                                         "before it formed", None)
                self.open.remove(old)

    def abort_older(self, message: str) -> None:
        """Tells the workers of the open generations to stop waiting; closes them."""
        for gen in self.open:
            self._control.abort(gen, message, None)
        self.open.clear()

    def exclude(self, worker: str, why: str) -> None:
        """Fencing: a worker the launcher could not stop in time (a partitioned host, a kill
        that did not arrive) may come back; it finds itself out of the next generation and
        raises ``ExcludedError`` with this reason (``elastic/membership.py``)."""
        try:
            self._control.exclude(worker, f"excluded from the job at generation {self.gen}: "
                                          f"{why}")
        except (RuntimeError, OSError) as exc:  # the store is ours: unlikely, and not fatal
            self.say(f"cannot record why worker {worker} left: {exc}")

    def give_up(self, reason: str) -> None:
        """Tells waiting workers why the job ends (``failed``).

        Raises:
            RuntimeError, OSError: the store did not take it.
        """
        self._control.give_up(reason)

    # ------------------------------------------------------------------ reading
    def watched(self) -> list[int]:
        """The generations whose abort records a turn reads, oldest first: the newest, the
        one before it, and every open one (workers may still train in a generation that
        only new workers replaced, and its heartbeats may report a silent worker too)."""
        return [gen for gen in sorted({self.gen - 1, self.gen, *self.open}) if gen >= 0]

    def read_abort(self, gen: int) -> dict | None:
        """Generation ``gen``'s abort record (None: none, or it could not be read). A read
        that fails is reported and the client of the launcher's store replaced: a client
        whose call failed midway may stay out of step with the server, and an abort record
        the launcher cannot read would leave a silent worker in the job for good."""
        try:
            return self._control.world_store(gen).read_abort()
        except Exception as exc:  # noqa: BLE001 (reported; the next poll tries again)
            if str(exc) != self._warned:
                self._warned = str(exc)
                self.say(f"cannot read the abort record of generation {gen} from the "
                         f"launcher's store ({exc}); reconnecting to it")
            try:
                from torch.distributed import TCPStore

                client = TCPStore("127.0.0.1", self._port, None, False, timedelta(seconds=30))
                self.control = Control(client, self._control.job, 30.0)
            except (RuntimeError, OSError) as again:
                self.say(f"cannot reconnect to the launcher's store: {again}")
            return None

    def is_ready(self, worker: str) -> bool:
        """Whether new worker ``worker`` has said it is ready (False when the store did not
        answer: the next poll asks again)."""
        try:
            return self._control.is_ready(worker)
        except (RuntimeError, OSError):
            return False

    def formed(self, gen: int | None = None) -> bool | None:
        """Whether generation ``gen``'s (default the newest) World has published its address
        table (a member that trained in it has read it); None when the store did not
        answer."""
        try:
            return self._control.world_store(self.gen if gen is None else gen).check("peers")
        except (RuntimeError, OSError):
            return None
