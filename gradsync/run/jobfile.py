"""Where a running job's store is, so that ``gradsync top`` finds it by the launcher's job id.

``gradsync run`` hosts the job's store on a port the kernel picks. While the job runs, the
launcher writes one small file, ``<tmp>/gradsync-jobs-<uid>/<job id>.json`` (the directory
readable by this user alone), with the store's address and port, its own pid and the job's
size, and removes it when the job ends. ``gradsync top`` on the same machine then needs no
address: ``gradsync top`` alone takes the newest job whose launcher is alive, ``gradsync top
JOB`` the one whose id starts with JOB. From another machine, ``gradsync top --store
HOST:PORT`` reaches the store itself. The file holds no secret: the store carries none of
the connections' (``rendezvous.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

__all__ = ["directory", "publish", "withdraw", "find"]


def directory() -> str:
    """The directory of this user's job files."""
    return os.path.join(tempfile.gettempdir(), f"gradsync-jobs-{os.getuid()}")


def publish(job_id: str, store_addr: str, store_port: int, size: int) -> "str | None":
    """Writes the job's file; returns its path (None when it cannot be written: a job runs
    the same without it, only ``gradsync top`` must then be given ``--store``)."""
    where = directory()
    path = os.path.join(where, f"{job_id}.json")
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        aside = f"{path}.{os.getpid()}.partial"
        with open(aside, "w") as out:
            json.dump({"job": job_id, "store_addr": store_addr, "store_port": store_port,
                       "pid": os.getpid(), "size": size, "started": time.time()}, out)
        os.replace(aside, path)  # a reader never sees half a file
        return path
    except OSError:
        return None


def withdraw(path: "str | None") -> None:
    """Removes the job's file (its job has ended)."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def find(job: "str | None" = None) -> "dict | None":
    """The newest running job's file whose id starts with ``job`` (any, for None), as a dict;
    a file whose launcher has died is skipped (and removed)."""
    where = directory()
    try:
        names = [n for n in os.listdir(where) if n.endswith(".json")]
    except OSError:
        return None
    found = []
    for name in names:
        if job is not None and not name.startswith(job):
            continue
        path = os.path.join(where, name)
        try:
            with open(path) as source:
                entry = json.load(source)
        except (OSError, ValueError):
            continue
        if not _alive(int(entry.get("pid", 0))):
            withdraw(path)
            continue
        found.append(entry)
    return max(found, key=lambda e: e.get("started", 0), default=None)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that pid: alive, not ours to signal
    return True
