"""The timeline: a Chrome-trace JSON file of what happened to each named tensor, and when.

Open it in Perfetto (https://ui.perfetto.dev, "Open trace file") or ``chrome://tracing``
("Load"). The process is the rank (``pid`` = rank, named "rank R"); each tensor name is one row
(a thread of that process, named after the tensor, in order of first appearance). On a row,
``begin(name, phase)`` and ``end(name)`` draw a bar named ``phase``; phases opened inside an
open one nest under it. ``instant(name, what)`` draws a tick on the row, and ``cycle()`` (only
with ``mark_cycles``) a ``CYCLE_START`` line across the rank's rows.

Files. Every rank writes its own: rank 0 writes ``path`` (where Horovod, which writes from rank
0 only, would), rank ``r > 0`` writes ``path.r`` (``rank_path``). Each file holds one rank's
own view, which under name negotiation differs from the others'. Timestamps are wall-clock
microseconds, so ``merge`` can put the ranks of one job into one file, one process per rank.

Cost on the caller's thread: ``begin``/``end``/``instant`` read a clock and append a tuple to a
deque (atomic under the GIL, so any thread may call them, no lock). A writer thread wakes every
``flush_interval`` seconds, formats what has arrived and appends it to the file. After every
write the file is a complete JSON array (the closing ``]`` is overwritten by the next write, as
Horovod's writer does), so the file can be opened while the job runs; ``close`` ends open bars,
writes the rest and fsyncs. A reader that catches the file mid-write (or after a crash) can
``load`` it: the unfinished last line is dropped and the array closed, as viewers do.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from typing import Iterable

__all__ = ["Timeline", "rank_path", "load", "merge"]

log = logging.getLogger("gradsync.timeline")

_now = time.perf_counter_ns

# Record kinds in the queue (first item of each tuple).
_BEGIN, _END, _INSTANT, _CYCLE, _FLUSH = range(5)


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for a timeline at ``path``: ``path`` itself on rank 0,
    ``path.<rank>`` on the others."""
    return path if rank == 0 else f"{path}.{rank}"


class Timeline:
    """A Chrome-trace timeline of one rank, written by a background thread.

    Args:
        path: the timeline file (rank 0's; other ranks add ``.<rank>``, see ``rank_path``).
        mark_cycles: record ``cycle()`` marks (off: ``cycle()`` does nothing).
        rank: this rank: the trace's process id and the file's suffix.
        flush_interval: seconds between the writer's passes (how stale the file may be).

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, path: str, mark_cycles: bool = False, rank: int = 0, *,
                 flush_interval: float = 0.1):
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be positive, got {flush_interval}")
        self.path = rank_path(os.fspath(path), rank)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._writer = _Writer(self.path, rank, flush_interval)
        self._push = self._writer.queue.append
        self._finalizer = weakref.finalize(self, self._writer.close)

    def begin(self, name: str, phase: str, args: dict | None = None) -> None:
        """Opens a bar ``phase`` on ``name``'s row (nested in any bar still open there).

        ``args`` (JSON-serialisable) is shown when the bar is selected.
        """
        self._push((_BEGIN, name, phase, args, _now()))

    def end(self, name: str, phase: str | None = None) -> None:
        """Closes the innermost open bar on ``name``'s row; with ``phase``, closes bars up to
        and including the innermost one named ``phase`` (any opened inside it end with it)."""
        self._push((_END, name, phase, None, _now()))

    def instant(self, name: str, what: str, args: dict | None = None) -> None:
        """A tick labelled ``what`` on ``name``'s row (e.g. a rank announcing the tensor)."""
        self._push((_INSTANT, name, what, args, _now()))

    def cycle(self) -> None:
        """Marks the start of a cycle of the background loop (only with ``mark_cycles``)."""
        if self.mark_cycles:
            self._push((_CYCLE, None, None, None, _now()))

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything recorded so far is in the file; False if ``timeout`` passed."""
        if self.closed:
            return True
        done = threading.Event()
        self._push((_FLUSH, None, None, done, 0))
        self._writer.wake.set()
        return done.wait(timeout)

    def close(self) -> None:
        """Ends every bar still open, writes the rest, closes and fsyncs the file.

        Records made after (or while) closing are dropped. Idempotent.
        """
        self._push = lambda record: None
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Writer:
    """The file and the thread that fills it. Kept apart from Timeline so that a Timeline
    that is garbage-collected without ``close`` still gets its file finished (weakref.finalize,
    which also runs at interpreter exit)."""

    def __init__(self, path: str, rank: int, interval: float):
        self.queue: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.rank = rank
        self.interval = interval
        self.file = open(path, "wb")
        self.size = 0
        self.failed = False
        self.closing = False
        self.tids: dict[str, int] = {}
        self.open: dict[str, list[str]] = {}
        self.warned: set[str] = set()
        self.quoted: dict[str, str] = {}
        self.cycles = False  # the row of cycle marks is named at the first one
        # Wall-clock origin, so that different ranks' files line up when merged.
        self.epoch_ns = time.time_ns()
        self.origin_ns = _now()
        # The wall-clock start in the process row's arguments, under Horovod's key.
        header = [{"name": "process_name", "ph": "M", "pid": rank,
                   "args": {"name": f"rank {rank}",
                            "start_time_since_epoch_in_micros": self.epoch_ns // 1000}},
                  {"name": "process_sort_index", "ph": "M", "pid": rank,
                   "args": {"sort_index": rank}}]
        self._write_raw(b"[\n" + ",\n".join(map(json.dumps, header)).encode() + b"\n]")
        self.thread = threading.Thread(target=self._run, name=f"gradsync-timeline-{rank}",
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing = True
        self.wake.set()
        self.thread.join()
        lines: list[str] = []
        ts = self._ts(_now())
        for name, stack in self.open.items():
            lines.extend(self._event("E", name, None, ts) for _ in stack)
        self.open.clear()
        self._append(lines)
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as exc:
            self._fail(exc)
        self.file.close()

    def _run(self) -> None:
        while True:
            self.wake.wait(self.interval)
            self.wake.clear()
            closing = self.closing  # read before draining: nothing queued before close is lost
            self._drain()
            if closing:
                return

    def _drain(self) -> None:
        lines: list[str] = []
        flushed = []
        queue = self.queue
        while queue:
            kind, name, what, args, ns = queue.popleft()
            if kind == _FLUSH:
                flushed.append(args)
            elif not self.failed:
                self._format(lines, kind, name, what, args, ns)
        self._append(lines)
        for done in flushed:
            done.set()

    def _format(self, lines: list[str], kind: int, name, what, args, ns: int) -> None:
        ts = self._ts(ns)
        if kind == _CYCLE:
            if not self.cycles:
                self.cycles = True
                lines.append(f'{{"name": "thread_name", "ph": "M", "pid": {self.rank}, "tid": 0, '
                             '"args": {"name": "(cycles)"}}')
            lines.append(f'{{"ph": "i", "name": "CYCLE_START", "pid": {self.rank}, "tid": 0, '
                         f'"ts": {ts}, "s": "p"}}')
            return
        if name not in self.tids:
            tid = self.tids[name] = len(self.tids) + 1
            for meta, value in (("thread_name", {"name": name}),
                                ("thread_sort_index", {"sort_index": tid})):
                lines.append(json.dumps({"name": meta, "ph": "M", "pid": self.rank,
                                         "tid": tid, "args": value}))
        if kind == _BEGIN:
            self.open.setdefault(name, []).append(what)
            lines.append(self._event("B", name, what, ts, args))
        elif kind == _INSTANT:
            lines.append(self._event("i", name, what, ts, args, ', "s": "t"'))
        else:
            stack = self.open.get(name, [])
            if what is None:
                depth = 1 if stack else 0
            else:  # up to the innermost bar named ``what``
                depth = stack[::-1].index(what) + 1 if what in stack else 0
            if not depth:
                self._warn_once(name, f"timeline: end({name!r}, {what!r}) with no such bar open "
                                      f"(open: {stack})")
            for _ in range(depth):
                stack.pop()
                lines.append(self._event("E", name, None, ts))

    def _event(self, ph: str, name: str, what, ts: str, args=None, extra: str = "") -> str:
        text = f'{{"ph": "{ph}", "pid": {self.rank}, "tid": {self.tids[name]}, "ts": {ts}'
        if what is not None:
            text += ', "name": ' + self._quoted(what)
        if args:
            try:
                text += ', "args": ' + json.dumps(args)
            except (TypeError, ValueError):
                text += ', "args": ' + json.dumps({"repr": repr(args)})
        return text + extra + "}"

    def _quoted(self, text: str) -> str:
        quoted = self.quoted.get(text)
        if quoted is None:
            quoted = self.quoted[text] = json.dumps(text)
        return quoted

    def _ts(self, ns: int) -> str:
        """Wall-clock microseconds, written exactly (a float would round them)."""
        micros, nanos = divmod(self.epoch_ns + ns - self.origin_ns, 1000)
        return f"{micros}.{nanos:03d}"

    def _append(self, lines: list[str]) -> None:
        if not lines or self.failed:
            return
        # Overwrite the closing "\n]" so that the file is a complete array after every write.
        self.file.seek(self.size - 2)
        self.size -= 2
        self._write_raw((",\n" + ",\n".join(lines) + "\n]").encode())

    def _write_raw(self, data: bytes) -> None:
        try:
            self.file.write(data)
            self.file.flush()
            self.size += len(data)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if not self.failed:
            self.failed = True
            log.warning("timeline: writing %s failed (%s); no more events will be recorded",
                        self.file.name, exc)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning("%s", message)


def load(path: str) -> list[dict]:
    """The events of a timeline file, even one still being written or cut short by a crash:
    an unfinished last line is dropped and the array closed, as trace viewers do."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    lines = text.splitlines()
    while lines:
        candidate = "\n".join(lines).rstrip().rstrip(",")
        try:
            return json.loads(candidate + "\n]")
        except json.JSONDecodeError:
            lines.pop()
    raise ValueError(f"{path} is not a timeline (no JSON array found)")


def merge(out: str, paths: Iterable[str]) -> int:
    """Writes the events of the timeline files ``paths`` (one per rank) into one file ``out``;
    returns the number of events. Each rank stays its own process in the viewer."""
    events = [event for path in paths for event in load(path)]
    with open(out, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    return len(events)
