"""Binding each local rank to cores of its own (``gradsync run --bind-to core``), as mpirun does.

Why. Two ranks of one host that meet in a small allreduce both have to be on a core at the
same moment. Unbound, the scheduler moves them between cores, and a rank that waits may find
its peer queued behind another process on the core it just left; bound, each rank keeps its
core's caches and its place. Open MPI binds each rank to a core by default for the same
reason (``mpirun --bind-to core`` for up to 2 ranks).

Vocabulary. The *usable CPUs* are the launcher's affinity (``os.sched_getaffinity``); a *core*
is the set of usable CPUs that share one physical core (hardware threads, from sysfs
``topology/core_id`` and ``physical_package_id``; every CPU its own core where sysfs says
nothing). The cores, in the order of their lowest CPU, are cut into equal *shares* of
``cores // local ranks`` whole cores; local rank i gets share i, with all of its usable
hardware threads. When the ranks fill the host a share is one core (mpirun's ``--bind-to
core``); with fewer ranks each keeps several, so a rank's own threads (torch's intra-op
pool under ``OMP_NUM_THREADS``) are never squeezed onto one core (mpirun's ``--map-by
slot:PE=n``). Leftover cores stay unbound to anyone.

When. ``--bind-to core`` (or ``GRADSYNC_BIND=core``) binds, and refuses more local ranks
than cores. ``none`` never binds. The default, ``auto``, binds only when both hold: the
local ranks are no more than the cores, and the user did not restrict the launcher's affinity
already (usable CPUs fewer than the machine's online CPUs: ``taskset``, a cpuset, a batch
system's binding), so a choice someone made is never overridden. Only ranks started on this
host by ``gradsync run`` are bound (``ranks.Starter.start``, after the child exists and
before it has started any thread); ranks on other hosts, and ranks started by torchrun, srun
or mpirun (adopted through ``launch_env``) keep what their launcher gave them: mpirun and srun
bind themselves, and fighting a launcher's placement helps nobody.

Worked example: 2 cores with 2 hardware threads each, CPUs 0,2 on core 0 and 1,3 on core 1,
3 local ranks: ``auto`` does not bind (3 ranks > 2 cores); 2 local ranks: rank 0 gets {0, 2},
rank 1 gets {1, 3}. 8 cores of one thread, 3 ranks: shares of 2 cores, {0, 1}, {2, 3},
{4, 5}; cores 6 and 7 are left to the rest of the machine.
"""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["MODES", "bind", "cores", "online_cpus", "plan"]

MODES = ("auto", "core", "none")
_SYS = "/sys/devices/system/cpu"


def online_cpus() -> int:
    """The number of online CPUs of the machine (not of this process's affinity)."""
    try:
        with open(f"{_SYS}/online", encoding="ascii") as f:
            return len(_cpu_list(f.read()))
    except (OSError, ValueError):
        return os.cpu_count() or 1


def cores(usable: "set[int] | frozenset[int]") -> list[list[int]]:
    """The usable CPUs grouped by physical core, cores ordered by their lowest CPU."""
    by_core: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(usable):
        try:
            with open(f"{_SYS}/cpu{cpu}/topology/core_id", encoding="ascii") as f:
                core = int(f.read())
            with open(f"{_SYS}/cpu{cpu}/topology/physical_package_id", encoding="ascii") as f:
                package = int(f.read())
        except (OSError, ValueError):
            core, package = cpu, -1  # unknown: its own core
        by_core.setdefault((package, core), []).append(cpu)
    return sorted(by_core.values())


def plan(mode: str, local_size: int, usable: "set[int] | None" = None,
         online: "int | None" = None) -> "list[list[int]] | None":
    """The CPUs of each local rank 0..local_size-1 (its share of the cores), or None when the
    ranks are not bound.

    Args:
        mode: ``auto``, ``core`` or ``none`` (see the module's docstring).
        local_size: the ranks this launcher starts on this host.
        usable: the launcher's usable CPUs (default: its affinity).
        online: the machine's online CPUs (default: ``online_cpus()``).

    Raises:
        ValueError: an unknown mode, or ``core`` with more local ranks than usable cores.
    """
    if mode not in MODES:
        raise ValueError(f"--bind-to (GRADSYNC_BIND) must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    if mode == "none" or local_size < 1:
        return None
    usable = set(os.sched_getaffinity(0) if usable is None else usable)
    groups = cores(usable)
    if local_size > len(groups):
        if mode == "core":
            raise ValueError(f"--bind-to core: {local_size} ranks on this host but only "
                             f"{len(groups)} usable cores (CPUs {sorted(usable)}); use "
                             f"--bind-to none")
        return None
    if mode == "auto" and len(usable) < (online_cpus() if online is None else online):
        return None  # the user (or a batch system) chose an affinity: keep it
    share = len(groups) // local_size
    return [[cpu for core in groups[i * share:(i + 1) * share] for cpu in core]
            for i in range(local_size)]


def _cpu_list(text: str) -> list[int]:
    """Parses a kernel CPU list such as ``0-3,8,10-11``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind(pid: int, cpus: Sequence[int]) -> None:
    """Binds process ``pid`` (its main thread, and every thread it starts later) to ``cpus``."""
    os.sched_setaffinity(pid, set(cpus))
