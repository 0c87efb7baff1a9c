"""A worker's side of an elastic job: join a generation, and re-form the world in place.

``join`` is what ``init()`` does in an elastic job (``LaunchEnv.elastic_id`` set): announce
that this worker is ready (``ready/<id>``: it has started and imported its framework), wait for
a generation that lists this worker (a new worker of a running job is listed only once it is
ready, so that the job trains on while it starts; until then the generations it sees are not
its own), take its rank and size from the list, and connect that
generation's World over the launcher's store (``World.connect`` with a store scoped to
``<job>.e<g>``). When the connection fails (another worker died meanwhile), the World's abort
record tells the launcher, which forms the next generation; ``join`` then tries that one.

``reset`` re-forms the world of a running process: it closes the current job (``job.close``:
its connections, shared-memory segments, heartbeat and progress thread), joins the next
generation, and installs the new World with a new engine as the process's job
(``job.install``). The process, its model and its Python state stay; only rank, size and
connections change. ``hvd.elastic.run`` calls it after a lost peer or a HostsUpdatedInterrupt.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import time

from .. import job
from ..cluster.rendezvous import Store
from ..errors import GradsyncError, GradsyncTimeoutError, PeerLostError
from .membership import Control, ExcludedError, generation_job

__all__ = ["join", "reset", "is_elastic", "generation", "newer_generation"]

log = logging.getLogger("gradsync")

_LAUNCHER_MARGIN = 10.0
_control: Control | None = None
_generation = -1
_listed = False  # whether a generation has listed this worker: after that, unlisted = excluded
_env = None
_config = None


def is_elastic() -> bool:
    """Whether this process is a worker of an elastic job that has joined a generation."""
    return _control is not None


def generation() -> int:
    """The generation this worker's World belongs to (-1 outside elastic jobs)."""
    return _generation


def newer_generation() -> bool:
    """Whether the launcher has formed a generation newer than this worker's (new hosts, or a
    lost worker that this one has not run into yet)."""
    return _control is not None and _control.generation() > _generation


def join(config, env, after: int = -1):
    """Connects this worker to the newest generation after ``after`` that lists it.

    Args:
        config: the settings (``elastic_timeout`` bounds the whole wait).
        env: this process's LaunchEnv; ``env.elastic_id`` names it in the generations.
        after: the generation this worker leaves (-1 at start).

    Returns:
        The connected World (its ``rank``/``size`` are the generation's).

    Raises:
        ElasticJobFailed: the launcher gave up, this worker is no longer listed
            (``ExcludedError``, with the launcher's reason), or no
            generation could be joined within ``config.elastic_timeout``.
    """
    global _control, _generation, _env, _config, _listed
    if _control is None:
        base = Store(env.store_addr, env.store_port, env.store_is_server, env.job_id,
                     config.connect_timeout, env.size).base
        _control = Control(base, env.job_id, config.connect_timeout)
        # Everything slow about starting (the interpreter, torch's import, the script's set-up)
        # is behind us: the launcher may now list this worker, and the job pays only for the
        # connection, not for this process's start.
        newest = _control.generation()
        if newest >= 0 and env.elastic_id not in [m["id"] for m in _control.members(newest)]:
            _prepare()  # a new worker of a running job, which trains on meanwhile
        _control.announce_ready(env.elastic_id)
    _env, _config = env, config
    from ..connect.world import World

    # The launcher ends the job elastic_timeout after it lacks workers and then writes its
    # reason; waiting a little longer lets the workers report that reason rather than their own.
    deadline = time.monotonic() + config.elastic_timeout + _LAUNCHER_MARGIN
    while True:
        gen = _control.wait_newer(after, deadline, env.elastic_id)
        ids = [m["id"] for m in _control.members(gen)]
        if env.elastic_id not in ids and not _listed:
            after = gen  # a new worker: the generation that lists it comes once it is ready
            continue
        if env.elastic_id not in ids:
            reason = _control.exclusion(env.elastic_id) or \
                f"worker {env.elastic_id} is not in generation {gen} of the elastic job"
            raise ExcludedError(f"{reason}; the job went on without it (generation {gen}'s "
                                f"workers: {', '.join(ids)})")
        genv = dataclasses.replace(
            env, rank=ids.index(env.elastic_id), size=len(ids), local_rank=None,
            local_size=None, cross_rank=None, cross_size=None,
            job_id=generation_job(env.job_id, gen))
        _listed = True
        # New workers may wait here for old ones to reach their next commit().
        wait = max(1.0, min(config.elastic_timeout, deadline - time.monotonic()))
        store = _GenerationStore.over(_control.base, genv.job_id, wait)
        try:
            world = World.connect(config.replace(connect_timeout=wait), genv, store)
        except GradsyncError as exc:
            log.warning("worker %s: generation %d failed to form (%s); waiting for the next",
                        env.elastic_id, gen, exc)
            after = gen
            continue
        _generation = world.generation = gen
        _export_horovod_identity(world)
        log.info("worker %s is rank %d of %d in generation %d", env.elastic_id, world.rank,
                 world.size, gen)
        if world.rank == 0 and after >= 0:  # a survivor: what changed, once per generation
            before = [m["id"] for m in _control.members(after)]
            log.info("generation %d after %d: joined %s; left %s", gen, after,
                     ", ".join(i for i in ids if i not in before) or "none",
                     ", ".join(i for i in before if i not in ids) or "none")
        return world


def _prepare() -> None:
    """Does, before a new worker says it is ready, the slow first-time work that a training
    script does after ``init()``, when the survivors of a running job would wait for it: the
    first optimizer a torch process builds imports ``torch._dynamo`` (1.0 s measured here,
    ``torch.optim.SGD`` in a fresh process). Only where the script imported torch."""
    if "torch" in sys.modules:
        importlib.import_module("torch._dynamo")


def _export_horovod_identity(world) -> None:
    """Keeps horovodrun's identity variables true after a re-formation, as Horovod's own
    elastic reset does: a script that reads ``HOROVOD_RANK`` reads this generation's rank.
    Only where the launcher set them (``gradsync run`` does), so no variable is invented."""
    if "HOROVOD_RANK" not in os.environ:
        return
    os.environ.update({
        "HOROVOD_RANK": str(world.rank), "HOROVOD_SIZE": str(world.size),
        "HOROVOD_LOCAL_RANK": str(world.local_rank), "HOROVOD_LOCAL_SIZE": str(world.local_size),
        "HOROVOD_CROSS_RANK": str(world.cross_rank), "HOROVOD_CROSS_SIZE": str(world.cross_size)})


class _GenerationStore(Store):
    """A generation's store whose waits give up when the generation is abandoned.

    ``World.connect`` waits for every member's address; a member that died before posting it
    would hold the others for the whole connect timeout. Here each wait looks at the
    generation's abort record (where the launcher posts the loss when it forms the next
    generation) every ``_POLL`` seconds.
    """

    _POLL = 0.01
    _generation: Store
    """The generation's own view, whose abort record abandons this store's waits: itself, or
    for a sub-world's store (``child``: the process sets' worlds that ``reform`` connects right
    after the generation's), the generation's view over the sub-world's own connection."""

    @classmethod
    def over(cls, base, job: str, timeout: float) -> "_GenerationStore":
        self = super().over(base, job, timeout)
        assert isinstance(self, _GenerationStore)
        self._generation = self
        return self

    def child(self, base, job: str, timeout: float) -> Store:
        child = _GenerationStore.over(base, job, timeout)
        child._generation = Store.over(base, self._generation.job, timeout)
        return child

    def get(self, key: str, timeout: float | None = None) -> bytes:
        end = time.monotonic() + (timeout or self.timeout)
        while not self.check(key):
            record = self._generation.read_abort()
            if record is not None:
                raise PeerLostError(f"generation {self._job} was abandoned while forming: "
                                    f"{record['message']}", peer=record.get("peer"))
            if time.monotonic() > end:
                raise GradsyncTimeoutError(f"waiting for '{key}' of {self._job} in the store")
            time.sleep(self._POLL)
        return super().get(key, timeout)


def reset() -> None:
    """Leaves the current World and joins the next generation, in place (see the module
    docstring). Every operation still queued on the old World fails or is dropped."""
    if _control is None:
        raise RuntimeError("reset() outside an elastic job: start the job with gradsync run "
                           "--min-np/--max-np (or --host-discovery-script)")
    job.close()
    job.install(join(_config, _env, after=_generation))
