"""The express lane: a small synchronous allreduce from ``api`` straight to the compiled call.

The full road of ``gradsync.allreduce_`` is api (validate, ``wrap``) → engine (``run``, inline
when idle) → operations (plan, describe, begin, choose the finish) → ``ShmGroup.allreduce``
(check again, pick the road) → ``_shmfast.call``. For a small allreduce on one host the
Python around the compiled call takes several times as long as the call itself
(docs/benchmarks-history.md, "The express lane and core binding"), and both ranks pay it, so
it is most of the time a rank waits for its peer.

Every step of that road depends only on the call's arguments and on the job, never on the
data, so its outcome can be worked out once per distinct call and remembered: the *entry* of
``(name, dtype, shape, op, algorithm)`` holds the description and signature that
``operations`` would begin with, the kernel code and the divisor of an Average, or None when
that call cannot take the lane. A later identical call then does only what must happen every
time, in the same order as the full road:

    1. claim the engine (``Engine.claim_inline``): only when nothing is queued or running,
       so the lane never overtakes an earlier operation, exactly as the inline engine path;
    2. raise the job's failure if there is one (what ``Engine._execute`` does first);
    3. ``comm.begin_signed``: the same sequence number and signature as the full road, so the
       mismatch check and the stall and failure reports see the same collective;
    4. ``ShmGroup.allreduce_express``, which ``World.small_road`` handed the entry bound to
       the host's segment: the compiled one-step allreduce (same protocol, same issued words,
       so a rank on the lane and a rank on the full road meet in one collective); a
       GradsyncError goes through ``World.fail`` as in the engine;
    5. record it in the flight recorder, on the engine's track, with the full road's name
       (one record, started at once, and its end: a few writes to memory);
    6. release the engine.

What the lane skips is what it checked once: the plan (``world.plans`` decides per size once
anyway), the description, the op and dtype's kernel code, the size against the one-step road.
What it may not skip is per call: the engine's order, the failure check, ``begin`` and the
group's own failure state. The lane takes NumPy arrays and torch CPU tensors that are
C-contiguous, writable, of float32/float64/int32/int64, 1 byte to the group's one-step size,
with no pre/postscale and ``op`` Sum, Average, Min, Max or Product; everything else, and every
call when the compiled road is off (``GRADSYNC_SHM_FAST=0``) or the plan is not ``shm``,
returns None here untouched and takes the full road.

An unnamed call is as welcome as a named one. The full road names it ``allreduce.noname.<n>``
(``api._name``: one count per process, drawn once per call) and that name is part of the
description, so of the signature the other ranks compare. Its entry is therefore remembered
under the name None and holds the description cut around the name (``prefix``, ``suffix``);
per call, once the engine is claimed, the lane draws the next name from the same count as the
full road (the ``unnamed`` it is given), and joins and signs that description: the same
words, on every rank and either road, as the full road would have issued. That costs one
hash of a short string per call, under a microsecond.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np

from ..collectives.ops import ReduceOp
from ..errors import GradsyncError
from ..liveness.pace import meter
from ..transport.frame import signature_of
from . import operations as ops

__all__ = ["allreduce", "Entry"]

_KEPT = 4096  # distinct calls remembered per world (as operations' descriptions)
_CUT = "\0"  # stands for an unnamed call's name while its description is made; never in one


class Entry:
    """What a distinct allreduce call needs on the lane, worked out once.

    For a named call, ``description`` and ``signature`` are what ``comm.begin_signed`` takes.
    For an unnamed one (``prefix`` not None) the description is ``prefix + name + suffix``
    with a name drawn per call, and ``signature`` only says whether to sign it (nonzero when
    the world checks collectives). ``run`` and ``code``: the compiled call, bound to the
    host's segment, and its kernel code (``World.small_road``).
    """

    __slots__ = ("description", "signature", "run", "code", "divisor", "prefix", "suffix")

    def __init__(self, description: str, signature: int, run: Callable[..., None], code: int,
                 divisor: int, prefix: "str | None" = None, suffix: str = ""):
        self.description, self.signature, self.run, self.code, self.divisor = (
            description, signature, run, code, divisor)
        self.prefix, self.suffix = prefix, suffix


def allreduce(world, engine, tensor, op, name: "str | None", algorithm: str, inplace: bool,
              unnamed: Callable[[], str]):
    """Runs an allreduce of ``tensor`` on the lane and returns the result (``tensor`` itself
    when ``inplace``, else a new array or tensor); None when it cannot, and then nothing
    happened and the caller takes the full road.

    Args:
        world: the World (``world.size`` > 1).
        engine: its Engine.
        tensor: the caller's NumPy array or torch tensor.
        op, name, algorithm: as given to ``gradsync.allreduce_`` (name None for an unnamed
            call).
        inplace: reduce ``tensor`` itself (``allreduce_``) or a copy (``allreduce``).
        unnamed: returns the next name of an unnamed allreduce, from the count the full road
            draws from; called once, only when the call goes ahead on the lane.
    """
    flat: "np.ndarray | None"  # None: a tensor the lane cannot take
    if type(tensor) is np.ndarray:
        flags = tensor.flags
        if not flags.c_contiguous or (inplace and not flags.writeable):
            return None
        flat, shape = tensor, tensor.shape
    else:
        flat = _torch_flat(tensor)
        if flat is None:
            return None
        shape = tuple(tensor.shape)
    if type(op) is not ReduceOp:
        return None
    # op._value_, not op: an Enum's hash is a Python-level call, on every lookup.
    key = (name, flat.dtype, shape, op._value_, algorithm)
    cache = world.express
    entry = cache.get(key, False)
    if entry is False:
        entry = _entry(world, flat, op, name, shape, algorithm)
        if len(cache) >= _KEPT:
            cache.clear()
        cache[key] = entry
    if entry is None:
        return None
    if inplace:
        result = tensor
    else:
        result = flat = flat.copy()
        if type(tensor) is not np.ndarray:
            result = sys.modules["torch"].from_numpy(flat)
    if not engine.claim_inline():
        return None
    began = time.monotonic_ns()
    try:
        if entry.prefix is None:
            description, signature = entry.description, entry.signature
        else:
            # Drawn here, once the call is sure to go ahead: the full road draws when the
            # call is made, and a refused claim leaves the name to it (api._allreduce).
            name = unnamed()
            description = entry.prefix + name + entry.suffix
            signature = signature_of(description) if entry.signature else 0
        record = engine.track.issue("all_reduce", name, shape, flat.dtype, started=True)
        if world.failure is not None:
            record.fail(world.failure)
            raise world.failure
        world.comm.begin_signed(description, signature)
        try:
            entry.run(flat if flat.ndim == 1 else flat.reshape(-1), entry.code, entry.divisor,
                      time.monotonic() + world.config.timeout, world.on_group_idle, signature)
        except GradsyncError as exc:
            record.fail(exc)
            error = world.fail(exc)
            if error is exc:
                raise
            raise error from exc
        record.done()
    finally:
        engine.end_inline()
        meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)
    return result


def _entry(world, flat: np.ndarray, op: ReduceOp, name: "str | None", shape: tuple,
           algorithm: str) -> "Entry | None":
    """The lane's entry for a call, or None when the call must take the full road."""
    road = world.small_road(op, flat.dtype, flat.nbytes) if world.size > 1 else None
    if road is None:
        return None
    run, code = road
    try:
        alg = world.plans.allreduce(flat.nbytes, algorithm)
    except (ValueError, TypeError):
        return None  # the full road raises it, with its message
    if alg != "shm":
        return None
    divisor = world.size if op is ReduceOp.AVERAGE else 0
    description, signature = ops.allreduce_signed(
        world, _CUT if name is None else name, flat.dtype, shape, op, 1.0, 1.0, alg)
    if name is not None:
        return Entry(description, signature, run, code, divisor)
    # operations words the description; cut it where the name goes, to join per call.
    prefix, cut, suffix = description.partition(_CUT)
    if not cut:
        return None  # a description without the name: the lane could not word it alike
    return Entry("", signature, run, code, divisor, prefix, suffix)


def _torch_flat(x) -> "np.ndarray | None":
    """The NumPy view of a torch CPU tensor the lane can take, or None."""
    global _torch_dtypes
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if _torch_dtypes is None:
        _torch_dtypes = frozenset((torch.float32, torch.float64, torch.int32, torch.int64))
    # is_cpu, not device.type: the device object costs ~0.4 µs to make, on every call.
    if (x.dtype not in _torch_dtypes or not x.is_cpu or x.layout is not torch.strided
            or not x.is_contiguous()):
        return None
    return (x.detach() if x.requires_grad else x).numpy()


_torch_dtypes: "frozenset | None" = None  # the dtypes of _shmfast.c, as torch names them
