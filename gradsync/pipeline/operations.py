"""Each collective as one synchronous function over a World: describe it, pick the algorithm,
run it. The engine calls these (inline or on its progress thread); the public API in
``api.py`` only validates arguments and wraps tensors.

Every operation starts with ``comm.begin(description)``; the description names everything
that must agree between ranks (operation, name, dtype, shape, reduce op, root, algorithm), so
ranks that issued different collectives fail at their first frame with a report that shows
what each rank issued.

A small allreduce on one host can also be *prepared* (``prepare_allreduce``): Gloo's "set up
once, run many". Everything ``allreduce`` works out before its data moves depends only on the
call's arguments and the job, never on the data: the plan, the description and its signature,
the host segment's compiled one-step road and its kernel code, the divisor of an Average. A
``Prepared`` holds that outcome for one distinct call, and its ``run`` does only what must
happen every time: ``begin`` with the same description and signature as ``allreduce``, then
the compiled call (the same protocol and issued words as ``allreduce``'s ``shm`` road, so a
rank that runs the prepared operation and a rank that runs ``allreduce`` meet in one
collective). The engine runs it like any operation (``Engine.run``: in issue order, inline
when idle, with the failure check and the flight recorder), so a repeated small call skips
the planner, the description and the segment's own checks, and nothing else. It takes
float32/float64/int32/int64 data of 1 byte to the segment's one-step size, no pre/postscale
and ``op`` Sum, Average, Min, Max or Product, when the compiled road is built
(``GRADSYNC_SHM_FAST=0`` turns it off) and the plan is ``shm``; every other call is None there
and takes ``allreduce``.

An unnamed call is prepared too. ``api`` names it ``allreduce.noname.<n>`` (one count per
process, drawn once per call), and the name is part of the description, so of the signature
the other ranks compare. Its ``Prepared`` holds the description cut around the name
(``prefix``, ``suffix``): per call, the caller joins the drawn name in and signs the result
(one hash of a short string), so either way the ranks issue the same words.
"""

from __future__ import annotations

import pickle
import time
import zlib
from functools import partial
from typing import Callable

import numpy as np

from ..collectives import adasum
from ..collectives import alltoall as _alltoall
from ..collectives import doubling, halving_doubling, hierarchical, ring, tree
from ..collectives.ops import BFLOAT16, ReduceOp, finisher, make_reducer, reducer, scale
from ..transport import frame

# Distinct collectives whose description is remembered (unnamed calls each have their own).
_DESCRIPTIONS_KEPT = 4096

__all__ = ["allreduce", "allreduce_signed", "Prepared", "prepare_allreduce", "prepare_into",
           "PREPARED_KEPT", "allgather",
           "broadcast", "reducescatter", "alltoall", "barrier", "broadcast_object",
           "allgather_object"]

_CUT = "\0"  # stands for an unnamed call's name while its description is made; never in one


def _run_allreduce(world, flat: np.ndarray, dtype, op: ReduceOp, algorithm: str,
                   finish=None, divisor: int = 0, trunc: bool = False,
                   postscale: float = 1.0) -> bool:
    """Runs the allreduce; True when ``finish`` was applied to the result (shm only).

    ``finish`` divides by ``divisor`` (when nonzero, rounding as ``trunc`` says), then
    multiplies by ``postscale``; the shared-memory group's compiled road does the division
    itself, so it gets the op whenever there is no postscale.
    """
    fold = reducer(op, dtype)
    cfg = world.config
    if algorithm == "shm":
        world.host_allreduce(flat, fold, finish, op if postscale == 1.0 else None,
                             divisor, trunc)
        return finish is not None
    elif algorithm == "ring":
        ring.allreduce(world.comm, flat, fold, cfg.chunk_bytes)
    elif algorithm == "topo_ring":
        ring.allreduce(world.comm.view(world.ring_order), flat, fold, cfg.chunk_bytes)
    elif algorithm == "hierarchical":
        hierarchical.allreduce(world.comm, flat, fold, world.ring_order, world.levels,
                               cfg.chunk_bytes, cfg.small_bytes)
    elif algorithm == "doubling":
        doubling.allreduce(world.comm, flat, fold)
    else:
        halving_doubling.allreduce(world.comm, flat, fold)
    return False


def _agree(world, seconds: np.ndarray) -> None:
    """The least over the ranks of each of the planner's trial ``seconds`` (float64), in
    place, inside the allreduce that ended the trials: a ring allreduce, the same bits on
    every rank."""
    ring.allreduce(world.comm, seconds, reducer(ReduceOp.MIN, np.float64),
                   world.config.chunk_bytes)


def allreduce(world, flat: np.ndarray, dtype, op: ReduceOp, *, name: str, shape: tuple,
              prescale: float = 1.0, postscale: float = 1.0, algorithm: str = "auto",
              counts: list[int] | None = None, trunc: bool = False) -> None:
    """Reduces ``flat`` in place across all ranks.

    The algorithm comes from ``world.plans`` (decided once per size) and the collective's
    description and signature from ``world.descriptions`` (computed once per distinct call),
    so a repeated small allreduce pays for neither. ``counts`` (Adasum only) cuts ``flat``
    into the tensors fused in it: each gets its own dot products, as if reduced alone. Adasum
    ignores ``algorithm``. ``trunc``: an integer Average rounds toward zero (the Horovod API)
    instead of down (see ``scale``).
    """
    if op is ReduceOp.ADASUM:
        alg = f"adasum tensors={len(counts) if counts else 1} crc={_crc(counts)}"
    else:
        alg = world.plans.allreduce(flat.nbytes, algorithm)
    world.comm.begin_signed(*allreduce_signed(world, name, dtype, shape, op, prescale,
                                              postscale, alg))
    if prescale != 1.0:
        scale(flat, dtype, prescale)
    average = op is ReduceOp.AVERAGE and world.size > 1
    finished = False
    if world.size > 1 and flat.size:
        if op is ReduceOp.ADASUM:
            adasum.allreduce(world.comm, flat, dtype, counts)
        else:
            # The division of an Average and the postscale are folded into the reduction
            # where the algorithm allows (shm: each element scaled once, while in cache).
            divisor = world.size if average else 0
            trying = world.plans.trying
            if trying:
                start = time.perf_counter()
            finished = _run_allreduce(world, flat, dtype, op, alg,
                                      finisher(dtype, divisor, trunc, postscale), divisor,
                                      trunc, postscale)
            if trying:  # a close call of the planner's, measured (``planner.Plans``)
                world.plans.ran(flat.nbytes, algorithm, alg, time.perf_counter() - start,
                                partial(_agree, world))
    if finished:
        return
    if average:
        scale(flat, dtype, world.size, divide=True, trunc=trunc)
    if postscale != 1.0:
        scale(flat, dtype, postscale)


def allreduce_signed(world, name: str, dtype, shape: tuple, op: ReduceOp, prescale: float,
                     postscale: float, alg: str) -> tuple[str, int]:
    """The description of an allreduce and its signature (what ``comm.begin_signed`` takes),
    remembered per distinct call; a ``Prepared`` allreduce begins with the same."""
    return _signed(world, ("allreduce", name, dtype, tuple(shape), op, prescale, postscale, alg),
                   lambda: f"allreduce '{name}' {_dt(dtype)}{list(shape)} op={op.name} "
                           f"prescale={prescale} postscale={postscale} algorithm={alg}")


class Prepared:
    """A small allreduce prepared once per distinct call (the module docstring).

    For a named call ``run(flat)`` begins the collective with the prepared ``description``
    and ``signature``, bound in, then reduces ``flat`` (the call's NumPy data, C-contiguous and
    writable, of the prepared dtype and shape) in place over the host's segment, on the
    deadline the begin sets; ``run_as`` is None. For an unnamed one ``run`` is None and
    ``run_as((flat, description, signature))`` does the same with the description
    ``prefix + name + suffix``, a name drawn per call; ``signature`` then only says whether to
    sign it (nonzero when the world checks collectives). Either takes one argument, what the
    engine hands an operation (``Engine.run``'s ``call``).

    Both are functions made once, here, over what they call (the World's ``begin_signed`` and
    ``on_group_idle`` bound once): per call they read no attribute chain and make no bound
    method.
    """

    __slots__ = ("description", "signature", "prefix", "suffix", "run", "run_as")

    def __init__(self, description: str, signature: int,
                 run: "Callable[[np.ndarray], None] | None",
                 run_as: "Callable[[tuple[np.ndarray, str, int]], None] | None",
                 prefix: "str | None" = None, suffix: str = ""):
        self.description, self.signature = description, signature
        self.run, self.run_as = run, run_as
        self.prefix, self.suffix = prefix, suffix


PREPARED_KEPT = 4096  # distinct calls a front door's memory of prepared allreduces keeps


def prepare_into(kept: dict, key: tuple, world, flat: np.ndarray, op: ReduceOp,
                 name: "str | None", shape: tuple, algorithm: str) -> "Prepared | None":
    """``prepare_allreduce``'s answer for a call that ``kept``, a front door's memory of its
    prepared calls (the NumPy API's ``Engine.prepared``, a torch group's), does not hold yet
    under ``key``, remembered there; the memory starts again empty once it holds
    ``PREPARED_KEPT`` calls. The miss path only: a front door looks ``key`` up itself."""
    if len(kept) >= PREPARED_KEPT:
        kept.clear()
    prepared = kept[key] = prepare_allreduce(world, flat, op, name, shape, algorithm)
    return prepared


def prepare_allreduce(world, flat: np.ndarray, op: ReduceOp, name: "str | None", shape: tuple,
                      algorithm: str) -> "Prepared | None":
    """The call's ``Prepared`` allreduce (``name`` None for an unnamed call), or None when it
    cannot be prepared (the module docstring) and must take ``allreduce``."""
    road = world.small_road(op, flat.dtype, flat.nbytes) if world.size > 1 else None
    if road is None:
        return None
    kernel, code = road
    try:
        alg = world.plans.allreduce(flat.nbytes, algorithm)
    except (ValueError, TypeError):
        return None  # ``allreduce`` raises it, with its message
    if alg != "shm":
        return None
    divisor = world.size if op is ReduceOp.AVERAGE else 0
    begin, on_idle = world.comm.begin_signed, world.on_group_idle
    flatten = flat.ndim != 1

    description, signature = allreduce_signed(world, _CUT if name is None else name,
                                              flat.dtype, shape, op, 1.0, 1.0, alg)
    if name is not None:
        compiled = world.small_run(description, signature, code, divisor)
        if compiled is not None:  # the same two steps in one C call
            return Prepared(description, signature, compiled, None)
        # (A real segment with a kernel code always has the compiled run: the closure below is
        # the Python it stands for, reached where a World's segment has none, a stand-in.)

        def run(data: np.ndarray) -> None:
            deadline = begin(description, signature)  # the World's timeout from now
            kernel(data.reshape(-1) if flatten else data, code, divisor, deadline, on_idle,
                   signature)

        return Prepared(description, signature, run, None)

    def run_as(call: "tuple[np.ndarray, str, int]") -> None:  # ``run``, named per call
        data, named, signed = call
        deadline = begin(named, signed)
        kernel(data.reshape(-1) if flatten else data, code, divisor, deadline, on_idle, signed)

    # The description is worded above; cut it where the name goes, to join per call.
    prefix, cut, suffix = description.partition(_CUT)
    if not cut:
        return None  # a description without the name: it could not be worded alike
    return Prepared("", signature, None, run_as, prefix, suffix)


def _signed(world, key: tuple, describe) -> tuple[str, int]:
    """What ``comm.begin_signed`` takes, through the world's memory of descriptions."""
    known = world.descriptions.get(key)
    if known is None:
        description = describe()
        check = world.config.check_collectives
        known = (description, frame.signature_of(description) if check else 0)
        if len(world.descriptions) >= _DESCRIPTIONS_KEPT:
            world.descriptions.clear()
        world.descriptions[key] = known
    return known


def _crc(counts: list[int] | None) -> int:
    """A digest of an Adasum fusion layout, so that ranks fusing differently fail to match."""
    return 0 if not counts else zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes())


def _dt(dtype) -> str:
    return BFLOAT16 if dtype == BFLOAT16 else np.dtype(dtype).name


def _allgather_counts(world, count: int, what: str) -> list[int]:
    comm = world.comm
    comm.begin(f"allgather sizes of {what}", world.config.check_collectives)
    counts = np.zeros(world.size, dtype=np.int64)
    counts[world.rank] = count
    ring.allgather(comm, counts, [1] * world.size, world.config.chunk_bytes)
    return counts.tolist()


def allgather(world, flat: np.ndarray, dtype, *, name: str, shape: tuple,
              into: "np.ndarray | None" = None) -> tuple[np.ndarray, list[int]]:
    """Concatenates every rank's ``flat`` along the first dimension.

    Args:
        into: where to gather, when it has exactly the gathered size and ``flat``'s dtype (a
            fresh array otherwise, so that the collective completes on every rank and the
            caller can report the mismatch). Gathering into the caller's memory spares a copy
            and the page faults of a fresh array, which cost more than the transfer.

    Returns:
        The gathered flat array (``into`` when it was used) and the number of rows each rank
        contributed.
    """
    shape = tuple(shape) or (1,)
    row = int(np.prod(shape[1:], dtype=np.int64))
    what = f"'{name}' {_dt(dtype)}[*, {', '.join(map(str, shape[1:]))}]"
    rows = _allgather_counts(world, shape[0], what)
    total = sum(rows) * row
    if into is not None and into.size == total and into.dtype == flat.dtype:
        out = into
    else:
        out = np.empty(total, dtype=flat.dtype)
    offset = sum(rows[:world.rank]) * row
    out[offset:offset + flat.size] = flat
    world.comm.begin(f"allgather {what} rows={rows}", world.config.check_collectives)
    if world.size > 1 and out.size:
        counts = [r * row * flat.itemsize for r in rows]
        if world.hierarchical:
            hierarchical.allgather(world.comm, out.view(np.uint8), counts, world.ring_order,
                                   world.levels, world.config.chunk_bytes)
        else:
            ring.allgather(world.comm, out.view(np.uint8), counts, world.config.chunk_bytes)
    return out, rows


def broadcast(world, flat: np.ndarray, dtype, root: int, *, name: str, shape: tuple) -> None:
    """Copies root's ``flat`` into every rank's ``flat``, in place."""
    world.comm.begin(f"broadcast '{name}' {_dt(dtype)}{list(shape)} root={root}",
                     world.config.check_collectives)
    if world.size > 1 and flat.size:
        if world.shares_host:
            world.host_broadcast(flat.view(np.uint8), root)
        elif world.hierarchical:
            hierarchical.broadcast(world.comm, flat.view(np.uint8), root, world.ring_order,
                                   world.levels, world.config.chunk_bytes)
        else:
            tree.broadcast(world.comm, flat.view(np.uint8), root, world.config.chunk_bytes)


def split_rows(rows: int, size: int) -> list[int]:
    """Rows per rank when ``rows`` are split as evenly as possible (first ranks get more)."""
    base, extra = divmod(rows, size)
    return [base + (r < extra) for r in range(size)]


def reducescatter(world, flat: np.ndarray, dtype, op: ReduceOp, *, name: str, shape: tuple,
                  prescale: float = 1.0, postscale: float = 1.0,
                  trunc: bool = False, out: "np.ndarray | None" = None,
                  work: "np.ndarray | None" = None) -> np.ndarray:
    """Reduces ``flat`` (a scratch copy, overwritten; only read when ``work`` is given) and
    returns this rank's block.

    ``trunc``: an integer Average rounds toward zero, as in ``allreduce``.
    ``out``: the block goes there (and is returned) instead of into a fresh array; it must
    have the block's size and ``flat``'s dtype.
    ``work``: when given (``flat``'s size and dtype), ``flat`` is only read and the ring
    reduces into ``work`` instead (``ring.reduce_scatter``'s ``source``), which spares
    copying all of ``flat`` first."""
    shape = tuple(shape) or (1,)
    row = int(np.prod(shape[1:], dtype=np.int64))
    counts = [r * row for r in split_rows(shape[0], world.size)]
    world.comm.begin(f"reducescatter '{name}' {_dt(dtype)}{list(shape)} op={op.name} "
                     f"prescale={prescale} postscale={postscale}", world.config.check_collectives)
    source = None
    if work is not None:
        if work.size != flat.size or work.dtype != flat.dtype:
            raise ValueError(f"reducescatter '{name}': work is {work.dtype}[{work.size}], "
                             f"flat {flat.dtype}[{flat.size}]")
        if prescale != 1.0:  # scaled: a copy first
            np.copyto(work, flat)
        else:
            source = flat
        flat = work
    if prescale != 1.0:
        scale(flat, dtype, prescale)
    start = sum(counts[:world.rank])
    block = flat[start:start + counts[world.rank]]
    if out is not None and (out.size != block.size or out.dtype != block.dtype):
        raise ValueError(f"reducescatter '{name}': out is {out.dtype}[{out.size}], this "
                         f"rank's block {block.dtype}[{block.size}]")
    if world.size > 1 and flat.size:
        # With ``out``, the ring folds this rank's block straight into it.
        ring.reduce_scatter(world.comm, flat, counts, make_reducer(op, dtype),
                            world.config.chunk_bytes, source,
                            None if out is None else out.reshape(-1))
        mine = block.copy() if out is None else out
    elif out is None:
        mine = (block if source is None else source[start:start + block.size]).copy()
    else:
        mine = out
        np.copyto(mine, block if source is None else source[start:start + block.size])
    if op is ReduceOp.AVERAGE and world.size > 1:
        scale(mine, dtype, world.size, divide=True, trunc=trunc)
    if postscale != 1.0:
        scale(mine, dtype, postscale)
    return mine


def alltoall(world, flat: np.ndarray, dtype, splits: list[int], *, name: str,
             shape: tuple) -> tuple[np.ndarray, list[int]]:
    """Sends ``splits[j]`` rows to rank j; returns the received rows and their splits."""
    shape = tuple(shape) or (1,)
    row = int(np.prod(shape[1:], dtype=np.int64))
    comm, check = world.comm, world.config.check_collectives
    what = f"'{name}' {_dt(dtype)}[*, {', '.join(map(str, shape[1:]))}]"
    comm.begin(f"alltoall splits of {what}", check)
    send_splits = np.asarray(splits, dtype=np.int64)
    recv_splits = np.empty(world.size, dtype=np.int64)
    ones = [1] * world.size
    _alltoall.alltoall(comm, send_splits, ones, recv_splits, ones)
    received = recv_splits.tolist()
    out = np.empty(sum(received) * row, dtype=flat.dtype)
    comm.begin(f"alltoall {what}", check)
    item = flat.itemsize
    _alltoall.alltoall(comm, flat.view(np.uint8), [s * row * item for s in splits],
                       out.view(np.uint8), [s * row * item for s in received])
    return out, received


def barrier(world) -> None:
    """Returns once every rank has entered the barrier."""
    world.comm.begin("barrier", world.config.check_collectives)
    if world.shares_host:
        world.host_barrier()
    elif world.size > 1:
        token = np.zeros(1, dtype=np.uint8)
        doubling.allreduce(world.comm, token, make_reducer(ReduceOp.MAX, token.dtype))


def broadcast_object(world, obj, root: int, *, name: str):
    """Pickles ``obj`` on root and returns the unpickled copy on every rank."""
    payload = pickle.dumps(obj) if world.rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    broadcast(world, length, length.dtype, root, name=f"{name}.length", shape=(1,))
    data = np.frombuffer(bytearray(payload) if world.rank == root else
                         bytearray(int(length[0])), dtype=np.uint8)
    broadcast(world, data, data.dtype, root, name=name, shape=(int(length[0]),))
    return obj if world.rank == root else pickle.loads(data.tobytes())


def allgather_object(world, obj, *, name: str) -> list:
    """Returns the list of every rank's ``obj``, in rank order."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    out, rows = allgather(world, data, data.dtype, name=name, shape=data.shape)
    bounds = np.cumsum([0] + rows)
    return [pickle.loads(out[bounds[r]:bounds[r + 1]].tobytes()) for r in range(world.size)]
