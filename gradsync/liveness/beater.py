"""Beats that need no GIL: a native thread that beats for the heartbeat links and data servers.

A process proves that it runs by beating every heartbeat interval: a ``BEAT`` byte on each
heartbeat link (``heartbeat.py``), a count in each worker's slot table for a data server
(``data/server.py``). A Python thread that beats must hold the GIL for each beat, so any C
call that keeps the GIL longer than the timeout silences a live process: an ``import torch``
(the dynamic loading of its libraries holds the GIL for 0.4 s on an idle machine, over a
second on a loaded one, and torch's modules are often imported lazily, in the middle of a job),
unpickling a large object, ``sum(range(10**9))``. Its watchers then report it as stopped.

``Beater`` is a thread of the compiled module (``collectives/_shmfast.c``, "The beater") that
never takes the GIL: every interval it writes the byte on each socket registered with
``add_socket`` and counts up each word registered with ``add_word``; it is named
``gs-beater`` (``top -H``, ``py-spy``, ``/proc/PID/task/TID/comm``). A stopped process stops
it with every other thread, so a stop is still found within the bound; a process that dies
takes it along. Python keeps everything else: the reading, the judging, the goodbye.

The one rule of its use: ``remove`` a socket before its ``BYE`` goes and before it closes.
Once ``remove`` returns the thread never writes it again (it writes a duplicate descriptor of
its own, so even a close that came first cannot put a beat into another socket that reuses the
number).

``start`` returns None where the module is not there (no compiler: ``_native.py``); callers
then beat from a Python thread as before, with the GIL's limit.
"""

from __future__ import annotations

from .. import _native

__all__ = ["Beater", "start"]


class Beater:
    """A native beating thread, every ``interval`` seconds (module docstring)."""

    def __init__(self, module, interval: float):
        self._module = module
        self._capsule = module.beater_open(interval)

    def add_socket(self, fd: int, byte: bytes) -> int:
        """Beats ``byte`` on socket ``fd`` every interval, once at once; returns the id that
        ``remove`` takes."""
        return self._module.beater_add_socket(self._capsule, fd, byte[0])

    def add_word(self, array, index: int) -> int:
        """Counts up int64 word ``index`` of ``array`` (writable, contiguous) every interval,
        once at once; the array's memory is held until ``remove``. Returns the id."""
        return self._module.beater_add_word(self._capsule, array, index)

    def remove(self, ident: int) -> None:
        """Stops beating target ``ident``: once this returns, it is never written again.
        Removing an id twice is harmless."""
        self._module.beater_remove(self._capsule, ident)

    def close(self) -> None:
        """Stops the thread and releases every target (also done when garbage collected)."""
        self._module.beater_close(self._capsule)

    @property
    def rounds(self) -> int:
        """The rounds of beats made so far."""
        return self._module.beater_rounds(self._capsule)


def start(interval: float) -> "Beater | None":
    """A running Beater, or None where the compiled module is not available (then the caller
    beats from Python). A first use on this machine compiles the module (``_native.load``);
    ``World.connect`` has loaded it before its connect deadline, so a heartbeat never waits
    for a compiler."""
    module = _native.load("_shmfast")
    return None if module is None else Beater(module, interval)
