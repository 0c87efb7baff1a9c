"""The flight recorder: every rank's last operations, kept in memory, dumped in torch's format.

When a job fails or stalls, the first questions are which collective each rank was in, which
one it finished last, and whether the ranks even issued the same ones. The recorder answers
them after the fact: each process keeps a *ring* of its last ``flight_recorder`` (2,000)
operations, from every front door (the NumPy API's engine, its small-call fast case included, the Horovod
API's negotiation, the torch backend's lanes), and writes it out on a failure, on SIGUSR1 or
on request (``dump``), in the format of torch's Flight Recorder, so that torch's own analyzer
reads a gradsync job's dumps::

    python -m torch.distributed.flight_recorder.fr_trace <dump directory>

Vocabulary. A *record* is one operation on one rank: its front door (``numpy``,
``horovod``, ``torch``), its name (the tensor's, for the NumPy and Horovod APIs), its
collective (torch's words: ``all_reduce``, ``all_gather``...), sizes and dtype, its sequence
number, its *track*, its times and its *state*: ``scheduled`` (issued), ``started`` (running),
``completed`` or ``failed``. A *track* is what torch calls a process group: one front door on
one World (the NumPy API on the job's World, the Horovod API on a process set, one torch
group), with the global ranks it spans and its own sequence numbers, which every rank of it
gives its operations in the same order (issue order for the NumPy API and torch, agreed
order for the Horovod API). So the analyzer lines the ranks' records up by track and number
and finds the first collective where they differ or where a rank is missing.

Cost. Recording is on every operation's path, so it is a few writes to memory this process
owns and nothing else. The ring is a list of ``Record`` objects (slots only) made once, when
the ring is sized; an operation takes the next one in turn and overwrites its fields, so no
object is made per operation (a record still in flight when its turn comes again, which
only an operation older than the whole ring can be, stays with its holder and a new object
takes its place in the ring). Its number comes from a counter (``itertools.count``: atomic
under the GIL, so threads need no lock); each change of state is a clock read and two
attribute writes (the monotonic clock, whose reads the engine's pace accounting shares; a
dump writes the wall clock's times, as torch's recorder does), and completing one also
counts it in the pace meter's steps (``pace.py``) in place, without a call. Nothing is
formatted, copied or locked until a reader asks: a dump builds torch's dicts from the ring
then, and the pace publisher, once a second, picks out the records completed since its last
look (``completed_after``: one pass over the ring, no sort, no copy of the others) and copies
the newest one.
A record holds shapes and dtypes, never a tensor, so the ring keeps no memory of the job's
alive. With a ring of 0 (``flight_recorder=0``) each operation gets an object of its own,
kept by its holder alone (the Horovod API's stall report reads when it was issued).

A dump is a snapshot: the ring is read without a lock while other threads may record, so it
can miss an operation that began during the dump. Each record it holds is whole: a reader
copies a record's fields in one call of C code (``operator.attrgetter``), which no thread
can interrupt, and leaves out a record whose number is -1 (``issue`` sets the number to -1
before it overwrites the fields and to the new number last), so a copy is never half of two
operations.

Torch's format has no ``failed`` state: a failed operation is written as ``started`` (it
began and never completed, which is what torch would show), and gradsync's own keys beside
torch's (``gradsync_state``, ``gradsync_error``, ``gradsync_door``, ``gradsync_name``) keep
the rest. The analyzer accepts only the communication libraries it knows in an operation's
``profiling_name``; gradsync writes ``gloo:<collective>`` (a CPU library with the same
collectives), so ``fr_trace`` matches the records as gloo's.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import pickle
import re
import signal
import tempfile
import threading
import time
import weakref
from typing import Any

from .liveness.pace import meter

__all__ = ["dump", "entries", "Recorder", "Record", "Track", "recorder", "FILE_PREFIX",
           "FORMAT_VERSION", "SCHEDULED", "STARTED", "COMPLETED", "FAILED"]

log = logging.getLogger("gradsync")

SCHEDULED, STARTED, COMPLETED, FAILED = "scheduled", "started", "completed", "failed"

FILE_PREFIX = "gradsync_trace_rank_"
"""A dump's file name is this prefix and the rank's global rank, as torch names its own."""

FORMAT_VERSION = "2.10"
"""The version of torch's Flight Recorder format the dumps follow (torch 2.13 writes 2.10)."""

DEFAULT_ENTRIES = 2000

# A record's fields, in the order readers copy them (``_whole``).
_FIELDS = ("record_id", "track", "kind", "name", "shape", "dtype", "out_shape", "seq", "peer",
           "created_ns", "started_ns", "ended_ns", "state", "error")
# Readers take a record's fields in one call of C code, which no other thread can interrupt
# (it runs no Python code, so never lets the GIL go): a consistent view, as of one instant.
_fields_of = operator.attrgetter(*_FIELDS)
_completion_of = operator.attrgetter("record_id", "state", "shape", "dtype", "ended_ns")
_record_id = operator.attrgetter("record_id")
_blank = object.__new__
_time_ns = time.monotonic_ns  # the records' clock; a dump writes the wall clock's (``entries``)

# Torch's names of the element types (what its recorder writes in input_dtypes).
_TORCH_DTYPES = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
    "int8": "Char", "uint8": "Byte", "int16": "Short", "int32": "Int", "int64": "Long",
    "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
}


class Record:
    """One operation on this rank (the module docstring says what each field holds)."""

    __slots__ = _FIELDS
    record_id: int
    track: Any  # the operation's Track; None only in an empty slot, which nothing reads
    kind: str | None
    name: str | None
    shape: tuple | None
    dtype: object
    out_shape: tuple | None
    seq: int | None
    peer: int | None
    created_ns: int
    started_ns: int
    ended_ns: int
    state: str | None
    error: str | None

    def __init__(self):
        # An empty slot of the ring: number -1 (no operation), in no state.
        self.record_id, self.track, self.state = -1, None, None
        self.kind = self.name = self.shape = self.dtype = self.out_shape = None
        self.seq = self.peer = self.error = None
        self.created_ns = self.started_ns = self.ended_ns = 0

    def start(self) -> None:
        """The operation begins to run."""
        self.started_ns = _time_ns()
        self.state = STARTED

    def done(self) -> None:
        """The operation completed, and counts in the pace meter's steps (``pace.py``): the
        meter's ``op_done`` in place, a call saved on every operation. (``_shmfast.c``'s
        Inline takes these steps too.)"""
        self.ended_ns = _time_ns()
        self.state = COMPLETED
        if meter.on:
            meter.ops = ops = meter.ops + 1
            if ops == meter.next_mark:
                meter.step_by_ops()

    def fail(self, error: BaseException) -> None:
        """The operation failed with ``error``, kept in words: the exception itself would
        keep its traceback's frames, and the tensors they hold, alive in the ring."""
        self.ended_ns = _time_ns()
        self.error = str(error)
        self.state = FAILED

    def words(self) -> str:
        """The record in one line, for logs and stall reports."""
        what = f"{self.kind} '{self.name}'" if self.name else self.kind
        shape = "" if self.shape is None else f" {list(self.shape)} {_dtype_name(self.dtype)}"
        peer = "" if self.peer is None else f" peer {self.peer}"
        when = self.ended_ns or self.started_ns or self.created_ns
        age = (_time_ns() - when) / 1e9
        number = "not numbered yet:" if self.seq is None else f"#{self.seq}"
        return (f"{number} {what}{shape}{peer} ({self.track.desc}), {self.state} "
                f"{age:.1f}s ago")


class Track:
    """One front door on one World: a process group, as torch's recorder names it.

    Args:
        recorder: the process's Recorder.
        uid: the same on every rank of the track, unique in the job (the analyzer's
            ``pg_name``).
        desc: in words (``numpy API``, ``Horovod API (process set 1)``).
        ranks: the global rank of each of its ranks.
        door: the front door (``numpy``, ``horovod``, ``torch``).
        timeout: the World's collective timeout, in seconds (written as ``timeout_ms``).
        world: the World it runs on (held weakly: a failure of that World fails the
            track's operations in flight).
    """

    def __init__(self, recorder: "Recorder", uid: str, desc: str, ranks, door: str,
                 timeout: float, world=None):
        self.recorder, self.uid, self.desc, self.door = recorder, uid, desc, door
        self.world = weakref.ref(world) if world is not None else _nothing
        self.ranks = list(ranks)
        self.timeout_ms = int(timeout * 1000)
        self.index = next(recorder._tracks_made)
        self._seqs = itertools.count(1)
        self._p2p = itertools.count(1)

    def issue(self, kind: str, name: "str | None" = None, shape=None, dtype=None,
              out_shape=None, peer: "int | None" = None, numbered: bool = True,
              started: bool = False) -> Record:
        """Records an operation issued on this track (state ``scheduled``) and returns it.

        Args:
            kind: torch's name of the collective (``all_reduce``, ``send``).
            name: the operation's own name, if any.
            shape, dtype: of its input (None for a barrier); ``out_shape``: of its output,
                when it differs from the input's.
            peer: for a send or receive, the other end's rank in the track.
            numbered: False when the track numbers it later (``number``): the Horovod API
                runs operations in agreed order, not in issue order.
            started: it begins to run now (state ``started``, with the same clock read), as
                an operation run at once on the caller's thread does: ``start`` saved.

        (The engine's compiled inline run, ``_shmfast.c``'s Inline, issues its records
        ``started`` with these steps, on ``Record``'s slots: a change here is one there.)
        """
        recorder = self.recorder
        record_id = next(recorder._ids)
        ring, size = recorder._slots  # one read: a resize swaps both at once
        if size:
            rec = ring[record_id % size]
            state = rec.state
            if state is SCHEDULED or state is STARTED:  # in flight a whole ring later: its
                rec = ring[record_id % size] = _blank(Record)  # holder keeps it, a new one here
        else:
            rec = _blank(Record)  # (every field is set below: no __init__ to run)
        rec.record_id = -1  # readers leave it alone until it is whole again (module docstring)
        rec.track, rec.kind, rec.name = self, kind, name
        rec.shape, rec.dtype = shape, dtype  # (pairs: a group of four would build a tuple)
        rec.out_shape, rec.peer = out_shape, peer
        if not numbered:
            rec.seq = None
        elif peer is None:
            rec.seq = next(self._seqs)
        else:
            rec.seq = next(self._p2p)
        rec.created_ns = now = _time_ns()
        rec.ended_ns, rec.error = 0, None
        if started:
            rec.started_ns, rec.state = now, STARTED
        else:
            rec.started_ns, rec.state = 0, SCHEDULED
        rec.record_id = record_id
        return rec

    def number(self, rec: Record) -> None:
        """Gives ``rec`` the track's next sequence number (see ``issue``'s ``numbered``)."""
        rec.seq = next(self._seqs)


class Recorder:
    """The process's ring of records (one per process: a rank owns its memory)."""

    # Slots: the engine's compiled inline run (``_shmfast.c``'s Inline) reads ``_slots`` at
    # its offset, once per operation (the rest, and a test's stand-ins, go in the dict).
    __slots__ = ("_ids", "_tracks_made", "_slots", "__dict__")

    def __init__(self, entries: int = DEFAULT_ENTRIES):
        self._ids = itertools.count()
        self._tracks_made = itertools.count()
        self._slots: tuple = ([Record() for _ in range(entries)], entries)  # (ring, size)
        self.rank = 0
        """The process's global rank (names its dump file)."""
        self.directory = ""
        """Where failures and SIGUSR1 dump to; "" when they do not."""
        self.tracks: "weakref.WeakSet[Track]" = weakref.WeakSet()
        self._dumped: "weakref.WeakSet" = weakref.WeakSet()  # Worlds whose failure was dumped
        self._signal_installed = False
        self.configured = False
        """True once a job's settings were taken (``configure``)."""

    @property
    def size(self) -> int:
        """Records kept (0: the recorder is off)."""
        return self._slots[1]

    def resize(self, entries: int) -> None:
        """Keeps the newest ``entries`` records from now on (0: records nothing)."""
        ring, size = self._slots
        if entries == size:
            return
        fresh = [Record() for _ in range(entries)]
        # The newest records move over as they are (their holders may still complete them).
        kept = sorted((rec for rec in ring if rec.record_id >= 0), key=_record_id)
        for rec in kept[-entries:] if entries else ():
            fresh[rec.record_id % entries] = rec
        self._slots = (fresh, entries)

    def track(self, uid: str, desc: str, ranks, door: str, timeout: float,
              world=None) -> Track:
        """A new track (one per front door and World; see ``Track``)."""
        track = Track(self, uid, desc, ranks, door, timeout, world)
        self.tracks.add(track)
        return track

    def records(self) -> list[Record]:
        """The records held, oldest first: copies, each whole (a snapshot; see the module
        docstring), which later operations do not change."""
        held = []
        for rec in list(self._slots[0]):
            copy = _whole(rec)
            if copy is not None:
                held.append(copy)
        held.sort(key=_record_id)
        return held

    def newest(self) -> "Record | None":
        """A copy of the newest record held (None: none), without copying the others."""
        ring = self._slots[0]
        for _ in range(3):  # found while a newer operation overwrote it: look again
            copy = _whole(max(ring, key=_record_id)) if ring else None  # max: one pass in C
            if copy is not None:
                return copy
        return None

    def completed_after(self, ns: int) -> list[tuple]:
        """``(shape, dtype, ended_ns)`` of each record held that completed after ``ns``
        (``time.monotonic_ns``, the records' clock): one pass over the ring, no copy of the
        others (the pace publisher's bytes per second, once a second)."""
        found = []
        for rec in [rec for rec in self._slots[0] if rec.ended_ns > ns]:
            record_id, state, shape, dtype, ended_ns = _completion_of(rec)  # read at once
            if state is COMPLETED and ended_ns > ns and record_id >= 0:
                found.append((shape, dtype, ended_ns))
        return found

    # ------------------------------------------------------------------ torch's format
    def entries(self) -> list[dict]:
        """The records as torch's Flight Recorder writes its entries (times on the wall
        clock, as torch's: the records' monotonic times moved by the clocks' difference now,
        so that ranks on different hosts compare)."""
        held = self.records()
        wall = time.time_ns() - _time_ns()
        # The Horovod API numbers an operation when it runs; those still waiting take the
        # numbers after the last one run, in issue order: every rank that issued them in the
        # same order numbers them alike, and a rank that never issued one is then missing
        # from that number (what the analyzer reports as "not all ranks joining").
        after: dict[Track, int] = {}
        for rec in held:
            if rec.seq is not None and rec.peer is None:
                after[rec.track] = max(after.get(rec.track, 0), rec.seq)
        found = []
        for rec in held:
            seq = rec.seq
            if seq is None:
                seq = after[rec.track] = after.get(rec.track, 0) + 1
            found.append(_entry(rec, seq, wall))
        return found

    def pg_config(self) -> dict:
        """Every track's group, as torch writes ``pg_config``: uid -> name, desc, ranks."""
        return {t.uid: {"name": t.uid, "desc": t.desc, "ranks": str(t.ranks)}
                for t in sorted(self.tracks, key=lambda t: t.index)}

    def snapshot(self) -> dict:
        """The whole dump as torch's ``_dump_fr_trace`` returns it (unpickled)."""
        entries = self.entries()
        status = {}
        for track in sorted(self.tracks, key=lambda t: t.index):
            mine = [e for e in entries if e["process_group"][0] == track.uid]
            status[str(track.index)] = {
                "last_enqueued_collective": max((e["collective_seq_id"] for e in mine),
                                                default=-1),
                "last_started_collective": max((e["collective_seq_id"] for e in mine
                                                if e["time_discovered_started_ns"]), default=-1),
                "last_completed_collective": max((e["collective_seq_id"] for e in mine
                                                  if e["gradsync_state"] == COMPLETED),
                                                 default=-1)}
        return {"version": FORMAT_VERSION, "comm_lib_version": "gradsync",
                "pg_config": self.pg_config(), "pg_status": status, "entries": entries}

    def dump(self, path: "str | os.PathLike | None" = None) -> str:
        """Writes the dump; returns the file's path.

        Args:
            path: the directory (made if missing) that gets ``gradsync_trace_rank_<rank>``:
                what the analyzer reads, one directory with one file per rank; None: the
                configured one (``flight_recorder_dir``).
        """
        directory = os.fspath(path) if path is not None else (
            self.directory or _default_directory(""))
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{FILE_PREFIX}{self.rank}")
        data = pickle.dumps(self.snapshot())
        # Written aside, then renamed: a reader never sees half a file. The aside name holds
        # no rank number at its end, so the analyzer never takes it for a rank's dump.
        aside = os.path.join(directory, f".flight-{os.getpid()}-{threading.get_ident()}.partial")
        with open(aside, "wb") as out:
            out.write(data)
        os.replace(aside, path)
        return path

    # ------------------------------------------------------------------ failures, signals
    def configure(self, config, rank: int, job_id: str) -> None:
        """Takes the settings of a job's World (at its connect) and arms SIGUSR1."""
        self.resize(config.flight_recorder)
        self.rank = rank
        where = config.flight_recorder_dir
        self.directory = "" if where == "off" else (where or _default_directory(job_id))
        self.configured = True
        self._arm_signal()

    def on_failure(self, world, error: BaseException) -> None:
        """A World failed: marks its operations in flight failed and dumps, once per World."""
        if world in self._dumped:
            return
        self._dumped.add(world)
        for rec in list(self._slots[0]):  # the ring's own records, not copies
            if rec.state is STARTED and rec.track.world() is world:
                rec.fail(error)
        if not self.directory or not self.size:
            return
        try:
            path = self.dump(self.directory)
        except OSError as exc:
            log.warning("rank %d: the flight recorder could not dump to %s: %s", self.rank,
                        self.directory, exc)
            return
        log.warning("rank %d: flight recorder dumped to %s (read every rank's with: python -m "
                    "torch.distributed.flight_recorder.fr_trace %s)", self.rank, path,
                    os.path.dirname(path))

    def _arm_signal(self) -> None:
        """SIGUSR1 dumps. gradsync uses no other handler of it; one installed before (Lightning
        installs one on SLURM, for requeueing) is called after the dump, and a signal that
        was ignored stays ignored. Only the main thread can install a handler."""
        if self._signal_installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGUSR1)
        if previous is signal.SIG_IGN:
            return

        def on_signal(signum, frame):
            try:
                path = self.dump(self.directory or None)
                log.warning("rank %d: flight recorder dumped to %s (SIGUSR1)", self.rank, path)
            except OSError as exc:
                log.warning("rank %d: the flight recorder could not dump: %s", self.rank, exc)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR1, on_signal)
        self._signal_installed = True


def _nothing():
    return None


def _whole(rec: Record) -> "Record | None":
    """A copy of ``rec`` if it holds an operation (None while ``issue`` overwrites it)."""
    fields = _fields_of(rec)
    if fields[0] < 0:
        return None
    copy = _blank(Record)
    (copy.record_id, copy.track, copy.kind, copy.name, copy.shape, copy.dtype, copy.out_shape,
     copy.seq, copy.peer, copy.created_ns, copy.started_ns, copy.ended_ns, copy.state,
     copy.error) = fields
    return copy


def _entry(rec: Record, seq: int, wall: int) -> dict:
    """One record as an entry of torch's Flight Recorder; ``wall``: the wall clock's time
    less the records' (``time.time_ns() - time.monotonic_ns()``)."""
    track = rec.track
    p2p = rec.peer is not None
    kind = rec.kind
    if p2p:
        me = track.ranks.index(track.recorder.rank) if track.recorder.rank in track.ranks else 0
        kind = (f"{kind} {me}->{rec.peer}" if rec.kind == "send" else f"{kind} {me}<-{rec.peer}")
    if rec.shape is None:
        sizes, dtypes, out_sizes = [], [], []
    else:
        sizes, dtypes = [list(rec.shape)], [_dtype_name(rec.dtype)]
        out_sizes = [list(rec.out_shape if rec.out_shape is not None
                          else _output_shape(rec.kind, rec.shape, len(track.ranks)))]
    state = STARTED if rec.state == FAILED else rec.state
    return {
        "record_id": rec.record_id, "pg_id": track.index,
        "process_group": (track.uid, track.desc),
        "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
        "op_id": seq, "profiling_name": f"gloo:{kind}", "is_p2p": p2p,
        "time_created_ns": rec.created_ns + wall,
        "time_discovered_started_ns": rec.started_ns + wall if rec.started_ns else None,
        "time_discovered_completed_ns": rec.ended_ns + wall if rec.state == COMPLETED else None,
        "duration_ms": (rec.ended_ns - rec.started_ns) / 1e6
        if rec.state == COMPLETED and rec.started_ns else None,
        "input_sizes": sizes, "input_dtypes": dtypes,
        "output_sizes": out_sizes, "output_dtypes": list(dtypes),
        "state": state, "retired": rec.state in (COMPLETED, FAILED),
        "timeout_ms": track.timeout_ms, "frames": [], "thread_id": "", "thread_name": "",
        "gradsync_door": track.door, "gradsync_name": rec.name, "gradsync_state": rec.state,
        "gradsync_error": rec.error,
    }


def _output_shape(kind: str | None, shape: tuple, ranks: int) -> tuple:
    """The output's shape where only the input's was recorded: an allgather's rows from every
    rank (as many as this rank's: the analyzer checks that product), else the input's."""
    if kind == "all_gather" and shape:
        return (shape[0] * ranks, *shape[1:])
    return tuple(shape)


def _dtype_name(dtype) -> str:
    name = str(dtype).rsplit(".", 1)[-1]  # numpy's 'float32', torch's 'torch.float32'
    return _TORCH_DTYPES.get(name, name)


def _default_directory(job_id: str) -> str:
    safe = re.sub(r"[^\w.-]+", "_", job_id) or str(os.getpid())
    return os.path.join(tempfile.gettempdir(), "gradsync-flight", safe)


recorder = Recorder()
"""The process's recorder."""


def dump(path: "str | os.PathLike | None" = None) -> str:
    """Writes this rank's flight recorder in torch's format; returns the file's path.

    Args:
        path: the directory (made if missing) that gets ``gradsync_trace_rank_<rank>``; give
            every rank the same one and run ``python -m
            torch.distributed.flight_recorder.fr_trace <path>``. None: ``flight_recorder_dir``.
    """
    return recorder.dump(path)


def entries() -> list[dict]:
    """This rank's records, oldest first, as the entries of torch's Flight Recorder."""
    return recorder.entries()
