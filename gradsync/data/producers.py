"""A data server's producers: who prepares its batches, and on how many cores.

A data server (``server.py``) prepares each item of each worker's stream: it looks every
sample of the batch up in its cache, decodes the ones it misses, applies the transform and
packs the batch into the stream's slot. A *producer* does that for one item at a time. With
``K`` producers (``gradsync run --data-workers K``, the ``data_workers`` setting; a
``DataLoader``'s ``num_workers``) a server prepares up to ``K`` items at once, of one stream
or of several: item ``seq`` of a stream may be prepared while item ``seq - 1`` still is, as
long as the stream has credit for both (``server.py``: its slots are distinct). Exactly once
does not change: the server hands each item to exactly one producer, and each item's slot,
header and sequence number are as with one producer; the bytes are the same too, because a
sample's transform is seeded by (seed, epoch, sample id), never by who runs it.

Two kinds (``data_producer``):

- ``"process"`` (the default when ``K > 1``): ``K`` helper processes forked when the server
  starts, each driven by a producer *thread* of the server. A batch is a message to the
  process (the epoch, the sample ids and the samples the server's cache holds), the process
  decodes what was missing, transforms and packs the batch into its own *staging* buffer of
  one slot's size (shared memory mapped before the fork), and answers with the bytes written
  and the samples it decoded; the thread copies staging into the stream's slot (one memcpy,
  small beside a transform worth a process) and puts the decoded samples into the cache. So
  the cache stays one, in the server's process, shared by every producer: each sample is
  decoded once per job whichever process prepares it, and counted as a hit or a miss there.
  A transform bound by Python code runs on ``K`` cores, as in a ``DataLoader``.
- ``"thread"``: ``K`` threads in the server's process, which prepare straight into the slots.
  Worth it when the dataset and transform release the GIL (NumPy, torch and PIL kernels, file
  reads); a transform in pure Python still runs on one core.

A helper process ends when its server does: it reads its requests from a pipe, and the
pipe's end (the server exited or was killed) ends it; on Linux it also asks the kernel for a
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so that a stopped one is not left
behind either.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import multiprocessing
import os
import signal
import sys

import numpy as np

__all__ = ["KINDS", "Batcher", "Helper", "start_helpers"]

KINDS = ("process", "thread")

log = logging.getLogger("gradsync.data")


class Batcher:
    """Prepares one batch into a slot: the samples from the source (cache, dataset,
    transform), then their stack (``layout``) or the collate's batch.

    Args:
        source: a ``server.Source``.
        layout: the stack's ``layout.Layout`` (None with a collate).
        spec: the collate's spec (with a collate).
    """

    def __init__(self, source, layout, spec):
        self.source, self.layout, self.spec = source, layout, spec
        self.collate = source.collate

    def prepare(self, ids: list[int], epoch: int, slot: np.ndarray, source=None) -> int:
        """Prepares the samples ``ids`` of ``epoch`` into ``slot``; returns the bytes written.
        ``source``: the samples' source, if not this Batcher's own (a helper process's)."""
        source = source or self.source
        if self.collate is not None:
            samples = [source.served(source.decoded(i), i, epoch) for i in ids]
            nbytes = int(self.collate.pack(self.spec, samples, ids, slot))
            if not 0 <= nbytes <= len(slot):
                raise ValueError(f"the collate wrote {nbytes} bytes into a slot of "
                                 f"{len(slot)} (its slot_bytes)")
            return nbytes
        samples = []
        for sample_id in ids:
            leaves = source.prepared(source.decoded(sample_id), sample_id, epoch)
            self.layout.check(leaves, sample_id)
            samples.append(leaves)
        return self.layout.pack(samples, slot)


class _Given:
    """A helper process's cache for one batch: the samples the server's cache gave, and the
    ones decoded here (handed back for the server's cache)."""

    def __init__(self, hits: dict, keep: bool):
        self.hits, self.keep = hits, keep
        self.decoded: dict[int, object] = {}

    def get(self, sample_id: int):
        return self.hits.get(sample_id)

    def put(self, sample_id: int, sample, nbytes: int) -> bool:
        if self.keep:
            self.decoded[sample_id] = sample
        return self.keep


class Helper:
    """(The server's side.) One helper process and the pipe and staging buffer it uses.

    Args:
        process: the forked ``multiprocessing`` process.
        conn: the server's end of the pipe.
        staging: this helper's staging buffer (uint8, one slot's size), shared with it.
    """

    def __init__(self, process, conn, staging: np.ndarray):
        self.process, self.conn, self.staging = process, conn, staging

    def prepare(self, cache, ids: list[int], epoch: int, slot: np.ndarray) -> int:
        """Has the helper prepare the batch; copies it into ``slot``; returns its bytes. The
        samples ``cache`` holds travel with the request; the ones the helper decoded go into
        ``cache`` (while its budget lasts). Raises what the dataset or transform raised."""
        hits = {}
        for i in ids:
            sample = cache.get(i)
            if sample is not None:
                hits[i] = sample
        keep = len(hits) < len(ids) and cache.used < cache.budget
        try:
            self.conn.send((epoch, ids, hits, keep))
            answer = self.conn.recv()  # blocks in the kernel, without the GIL
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the data server's producer process {self.process.pid} "
                               f"ended: {exc}") from None
        if answer[0] == "error":
            raise answer[1]
        _, nbytes, decoded = answer
        for i, sample in decoded.items():
            cache.put(i, sample, _nbytes(sample))
        np.copyto(slot[:nbytes], self.staging[:nbytes])
        return nbytes

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


def _nbytes(sample) -> int:
    from .layout import leaves_of

    return sum(leaf.nbytes for leaf in leaves_of(sample))


def start_helpers(batcher: Batcher, count: int, slot_bytes: int) -> list[Helper]:
    """Forks ``count`` helper processes for ``batcher`` (the server's dataset, transform,
    layout or collate, as the fork copies them), each with a staging buffer of
    ``slot_bytes``."""
    context = multiprocessing.get_context("fork")
    # MAP_SHARED and anonymous: the forked processes write the very pages the server reads.
    memory = mmap.mmap(-1, max(1, count * slot_bytes))
    whole = np.frombuffer(memory, dtype=np.uint8)
    helpers: list[Helper] = []
    for c in range(count):
        staging = whole[c * slot_bytes:(c + 1) * slot_bytes]
        mine, theirs = context.Pipe()
        # The server's ends of every pipe so far go to the new helper with the fork: it
        # closes them, so that each pipe's server end lives in the server alone and a
        # helper sees its pipe end when the server does.
        ends = [h.conn for h in helpers] + [mine]
        process = context.Process(target=_serve, args=(theirs, ends, batcher, staging),
                                  daemon=True, name=f"gradsync-data-producer{c}")
        process.start()
        theirs.close()  # the helper's end: only the helper holds it, so its exit is our EOF
        helpers.append(Helper(process, mine, staging))
    return helpers


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn, ends: list, batcher: Batcher, staging: np.ndarray) -> None:
    """(A helper process.) Prepares batches into ``staging`` until the pipe ends."""
    _die_with_parent()
    for end in ends:  # the server's ends, copied by the fork: else no read here sees EOF
        end.close()
    parent = os.getppid()
    source = _HelperSource(batcher.source)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None or os.getppid() != parent:
            return
        epoch, ids, hits, keep = request
        source.cache = _Given(hits, keep)
        answer: tuple  # ("ok", nbytes, decoded) or ("error", exception)
        try:
            nbytes = batcher.prepare(ids, epoch, staging, source)
            answer = ("ok", nbytes, source.cache.decoded)
        except Exception as exc:  # the user's dataset or transform: the server reports it
            answer = ("error", exc)
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return
        except Exception as exc:  # an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}"
                                              f" ({exc})")))


class _HelperSource:
    """The server's ``Source`` in a helper process, with the batch's cache."""

    def __init__(self, source):
        self.dataset, self.transform, self.seed = source.dataset, source.transform, source.seed
        self.collate = source.collate
        self.cache: _Given | None = None  # each batch's, set before the batch is prepared
        self._source = source

    def decoded(self, sample_id: int):
        cache = self.cache
        assert cache is not None  # _serve gives each batch its cache before preparing it
        sample = cache.get(sample_id)
        if sample is None:
            sample = self.dataset[sample_id]
            cache.put(sample_id, sample, 0)
        return sample

    def served(self, sample, sample_id: int, epoch: int):
        return self._source.served(sample, sample_id, epoch)

    def prepared(self, sample, sample_id: int, epoch: int):
        return self._source.prepared(sample, sample_id, epoch)
