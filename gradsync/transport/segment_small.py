"""The host segment's one-step road: a small allreduce in one synchronisation, in Python or C.

The piece road of ``host_segment.py`` synchronises twice per piece (arrive, then reduced), so
that each rank folds only its own sub-slice. For small data that second wait costs more than
the folding it shares out, so small pieces take a shorter road, with one synchronisation
instead of two. When the whole allreduce fits one piece of at most ``small_bytes``, every
rank copies all of its data into its slot, arrives, waits for every arrival, and computes the
whole result itself, folding the slots in local-rank order (rank 0's first): each rank does
the same operations on the same operands in the same order, so all end bitwise identical. The
two-slot argument (``segment_sync.py``) holds unchanged (every read of a slot of piece k
still happens before the reader arrives at k+1). The choice depends on the size only, so
every rank takes the same road (``ShmGroup.allreduce`` makes it).

The one-step road is also compiled (``_shmfast.c``, installed or built by ``_native.py``):
one C call copies in, publishes, waits, checks the issued words, folds and divides an
Average, for sums, products, minima, maxima and averages of float32, float64, int32 and
int64 (the kernel codes, ``host_segment.py``'s ``_FAST_CODES``). It is the same protocol on
the same layout, so a rank on the compiled road and a rank on the Python road meet in the
same collective; its wait spins, yields and sleeps like ``_wait`` for up to ``CHECK_EVERY``
and then hands the wait back to ``_wait``, which owns the deadline, the liveness checks and
``on_idle`` (``_fast_rest``). Other dtypes and ops, a postscale, no C compiler, or
``GRADSYNC_SHM_FAST=0`` (``fast=False``) take the Python road. ``allreduce_express`` is the
pipeline's fast case: the compiled road for a call prepared once, its checks already made.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .segment_layout import _ALLREDUCE, _ARRIVED, _BARRIER, _MASK64
from .segment_sync import Reducer, SegmentRank
from .wait import CHECK_EVERY

__all__ = ["SmallRoad"]

# What a C call (``_shmfast.c``'s ``call`` and ``fold``) returns: done, still waiting past its
# budget (``_fast_rest`` goes on), or a mismatch of the issued words (``_check_issued`` says).
_FAST_DONE, _FAST_WAITING, _FAST_MISMATCH = 0, 1, 2
# A barrier's data on the compiled road: nothing (and any kernel code: nothing is folded).
_NOTHING = np.empty(0, np.float32)


class SmallRoad(SegmentRank):
    """The one-step road of ``ShmGroup`` (a base of it): ``_allreduce_small`` in Python,
    ``_allreduce_fast`` and ``allreduce_express`` in one C call, and the barrier's C call,
    ``_barrier_fast``."""

    # The compiled road's entry points and its group, all None where it is not built
    # (``ShmGroup.__init__`` opens it).
    _fast_call: Callable[..., int] | None
    _fast_fold: Callable[..., int] | None
    _fast_group: object | None
    _fast_prepared: Callable[..., Callable[[np.ndarray], None]] | None

    def compiled_run(self, comm, description: str, signature: int, code: int, divisor: int,
                     on_idle: Callable[[float], None]) -> "Callable[[np.ndarray], None] | None":
        """A named prepared allreduce's run (``pipeline/operations.Prepared.run``) as one C
        call, ``_shmfast.Prepared``: ``comm.begin_signed(description, signature)``, then
        ``allreduce_express(data, code, divisor, deadline, on_idle, signature)``, the same
        steps in C, on the Comm's and this segment's slots (``_shmfast.c``, "The prepared
        run, compiled"). None where the compiled road is not built."""
        make = self._fast_prepared
        if make is None:
            return None
        return make(self, comm, description, signature, code, divisor, on_idle)

    def allreduce_express(self, flat: np.ndarray, code: int, divisor: int, deadline: float,
                          on_idle: Callable[[float], None], signature: int) -> None:
        """``allreduce`` on the compiled road, for a caller that has checked what it checks
        (a prepared allreduce, ``pipeline/operations.Prepared``): ``flat`` a writable
        C-contiguous 1-d array of 1 to ``small_bytes`` bytes, ``code`` from ``fast_code``,
        ``divisor`` as for ``allreduce`` (no ``trunc``). (``compiled_run``'s C takes these
        steps too, on this segment's slots: a change here is one there.)"""
        if self._failed is not None or self._segment is None:
            self._flat(flat, writable=True)  # raises what allreduce raises
        self.moved += 2 * flat.nbytes
        seq = self._seq = self._seq + 1
        try:
            # The common case is this one C call and no other Python frame: every rank
            # arrived within the C wait's budget and issued the same.
            call = self._fast_call
            assert call is not None  # ``code`` came from fast_code: the road is built
            status = call(self._fast_group, flat, seq, signature, code, divisor, False)
            if status != _FAST_DONE:
                self._fast_rest(status, flat, seq, signature & _MASK64, code, divisor, False,
                                deadline, on_idle)
        except BaseException as exc:  # what _guard does
            self._fail(exc)
            raise

    def _allreduce_small(self, flat: np.ndarray, reducer: Reducer, deadline: float,
                         on_idle: Callable[[float], None], signature: int) -> None:
        """The one-step road (see the module's docstring): one piece, one synchronisation."""
        seq = self._seq = self._seq + 1
        n, parity = flat.size, seq & 1
        views = self._views.get(flat.dtype) or self._views_of(flat.dtype)
        views[self.rank][parity][:n] = flat
        self._arrive(seq, _ALLREDUCE, flat.nbytes, signature, deadline, on_idle)
        if n:
            if self.rank:
                flat[...] = views[0][parity][:n]
            for r in range(1, self.size):  # a fixed order: the bits never depend on timing
                reducer(flat, views[r][parity][:n])

    def _allreduce_fast(self, flat: np.ndarray, code: int, divisor: int, trunc: bool,
                        deadline: float, on_idle: Callable[[float], None],
                        signature: int, kind: int = _ALLREDUCE) -> None:
        """The one-step road in one C call (``_shmfast.c``); waits past its budget and
        mismatches come back here to be handled as on the Python road. With ``kind``
        ``_BARRIER`` and no data (``_barrier_fast``) it is the barrier."""
        seq = self._seq = self._seq + 1
        signature &= _MASK64
        call = self._fast_call
        assert call is not None  # there is a ``code`` only where the road is built
        status = call(self._fast_group, flat, seq, signature, code, divisor, trunc, kind)
        if status != _FAST_DONE:
            self._fast_rest(status, flat, seq, signature, code, divisor, trunc, deadline,
                            on_idle, kind)

    def _barrier_fast(self, deadline: float, on_idle: Callable[[float], None],
                      signature: int) -> None:
        """The barrier in one C call: the one-step road's arrival and wait, with no data and
        the barrier's kind in the issued words, as ``_arrive`` publishes them in Python. The
        last rank to arrive leaves at once and the others within a look of the compiled
        wait, where the Python wait's looks take microseconds each. A group that failed
        earlier refuses it at once, as ``allreduce_express`` does."""
        if self._failed is not None:
            self._flat(_NOTHING, writable=True)  # raises what allreduce raises
        with self._guard():
            self._allreduce_fast(_NOTHING, 0, 0, False, deadline, on_idle, signature, _BARRIER)

    def _fast_rest(self, status: int, flat: np.ndarray, seq: int, signature: int, code: int,
                   divisor: int, trunc: bool, deadline: float,
                   on_idle: Callable[[float], None], kind: int = _ALLREDUCE) -> None:
        """What follows a C call that did not finish: the wait, then the fold; or the report."""
        if status == _FAST_WAITING:
            # The C wait spun, yielded and slept for CHECK_EVERY: check now, then go on.
            self._wait(_ARRIVED, seq, deadline, on_idle, "arrive",
                       started=time.perf_counter() - CHECK_EVERY)
            fold = self._fast_fold
            assert fold is not None  # built with ``_fast_call``, which made ``status``
            status = fold(self._fast_group, flat, seq, signature, code, divisor, trunc, kind)
        if status == _FAST_MISMATCH:
            self._check_issued(seq, kind, flat.nbytes, signature)
