"""The public API: process identity and collectives on NumPy arrays and torch CPU tensors.

Naming follows Horovod: ``allreduce`` returns a new tensor, ``allreduce_`` works in place,
``allreduce_async`` / ``allreduce_async_`` return a Handle that ``synchronize`` finishes and
``poll`` checks. Each public function validates its arguments (``arguments.py``, shared with
the Horovod API), wraps the tensor, and hands one closure to the job's engine (``job.py``,
which owns the World and engine between ``init`` and ``shutdown``); the work is in
``operations.py``. A synchronous small allreduce on one host hands the engine a prepared
operation instead (``_quick``, ``operations.Prepared``), worked out on its first call.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import sys

import numpy as np

from . import _native, job
from .collectives.ops import Average, ReduceOp
from .collectives.planner import ALGORITHMS as _ALGORITHMS
from .config import load_config
from .liveness.pace import meter, metered, waiting_for_data  # noqa: F401  (the API's, below)
from .pipeline import arguments
from .pipeline import operations as ops
from .pipeline.arguments import adasum_dtype  # noqa: F401  (importable from here, as it was)
from .pipeline.engine import Handle
from .pipeline.tensors import is_torch, kernel_view, wrap
from .transport.frame import signature_of

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
    "barrier", "broadcast_object", "allgather_object", "synchronize", "poll",
    "mark_step", "stragglers", "waiting_for_data", "metered",
]

log = logging.getLogger("gradsync")

_unnamed = itertools.count()


def init(**settings) -> None:
    """Joins the job: finds the other ranks and connects to them. Idempotent.

    Args:
        **settings: any ``gradsync.Config`` field; overrides ``GRADSYNC_*`` variables.
    """
    if job.start(lambda: _connect(settings)):
        atexit.register(shutdown)


def _connect(settings: dict):
    """Connects this process to its job (``job.start`` calls it once); returns the World."""
    from .cluster.launch_env import detect
    from .connect.world import World

    config = load_config(settings)  # also sets up logging (logs.configure)
    env = detect()
    if env.is_server:
        # A parameter-server rank that runs the user's script: the foreign-launcher case
        # (torchrun, srun, mpirun start every rank from one command, GRADSYNC_SERVERS
        # exported). gradsync run starts its servers as ``python -m gradsync.ps`` instead
        # (ps/__main__.py), so they never get here. Serve until the workers are done, then
        # end the process, as MXNet's servers do: the script goes no further.
        from .ps.server import serve_rank
        raise SystemExit(serve_rank(config, env))
    if env.servers:
        env = dataclasses.replace(env, size=env.workers, servers=0)  # workers-only collectives
    if env.elastic_id is not None:  # gradsync run --min-np/--max-np: join a generation
        from .elastic.worker import join
        return join(config, env)
    return World.connect(config, env)


def shutdown() -> None:
    """Finishes queued operations and closes every connection. ``init()`` may follow."""
    job.close()
    forget = getattr(_front, "forget", None)  # the compiled front's memo holds the World
    if forget is not None:
        forget()


def is_initialized() -> bool:
    return job.current() is not None


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return job.world().rank


def size() -> int:
    """The number of ranks in the job."""
    return job.world().size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return job.world().local_rank


def local_size() -> int:
    """The number of ranks on this process's host."""
    return job.world().local_size


def cross_rank() -> int:
    """The index of this host among the hosts that have a rank with this local rank."""
    return job.world().cross_rank


def cross_size() -> int:
    """The number of hosts that have a rank with this local rank."""
    return job.world().cross_size


def _name(name: str | None, kind: str) -> str:
    return name if name is not None else f"{kind}.noname.{next(_unnamed)}"


def _submit(fn, name: str, asynchronous: bool, kind: str, buf=None, out_shape=None):
    """Runs ``fn`` on the engine, recorded in the flight recorder as ``kind`` (torch's name of
    the collective) of ``buf``'s shape and dtype (none for a barrier or an object)."""
    engine = job.engine()
    shape, dtype = (None, None) if buf is None else (buf.shape, buf.dtype)
    return (engine.submit(fn, name, kind, shape, dtype, out_shape) if asynchronous else
            engine.run(fn, name, kind, shape, dtype, out_shape))


# ----------------------------------------------------------------------------- allreduce
def _alone(current, tensor, op, algorithm, inplace):
    """The result of an unscaled synchronous allreduce at ``size() == 1``, or None to take the
    full path.

    With one rank there is nothing to exchange: every reduction of one value is that value.
    When the engine is idle and the tensor is a plain array the full path would accept, the
    answer is the tensor itself (in place) or a copy of it; anything else (errors included)
    goes the full way, so both paths raise and return alike.
    """
    if (current.world.failure is not None
            or type(op) is not ReduceOp or op is ReduceOp.ADASUM
            or not (algorithm == "auto" or algorithm in _ALGORITHMS)
            or current.engine.busy()):
        return None
    if type(tensor) is np.ndarray:
        if tensor.dtype.kind not in "biuf" or (inplace and not tensor.flags.writeable):
            return None
        return tensor if inplace else tensor.copy()
    if is_torch(tensor):
        import torch

        if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
                or tensor.is_complex()):
            return None
        return tensor if inplace else tensor.detach().clone(
            memory_format=torch.contiguous_format)
    return None


def _quick(tensor, op, name, algorithm, inplace):
    """The result of a synchronous, unscaled allreduce by a quick road, or None (nothing
    done, no name drawn) for a call that takes the full path (``_full``): one rank
    (``_alone``), or the engine's fast case on one host, below.

    The fast case is a small allreduce on one host, prepared once per distinct call (name,
    dtype, shape, op, algorithm) by ``operations.prepare_allreduce`` and kept by the engine
    (``Engine.prepared``, None for a call that cannot be prepared); ``Engine.run`` runs it
    like any operation. Per call this checks only what the key does not say: the tensor is a
    C-contiguous NumPy array (writable, in place) or a torch CPU tensor ``kernel_view`` takes.
    An unnamed call draws its name here, as the full path does, and joins it into the
    prepared description (``Prepared.prefix``, run by ``Prepared.run_as``), signed when the
    world checks collectives. (One function, not one per road: on a call of a few
    microseconds each Python call taken shows.) ``_front``, compiled, takes these steps for a
    named call on a NumPy array: a change here is one there.
    """
    current = job.current()  # one read: a World and the engine of that same World
    if current is None:
        return None
    world = current.world
    if not world.shares_host:
        return _alone(current, tensor, op, algorithm, inplace) if world.size == 1 else None
    flat: "np.ndarray | None"
    if type(tensor) is np.ndarray:
        flags = tensor.flags
        if not flags.c_contiguous or (inplace and not flags.writeable):
            return None
        flat, shape = tensor, tensor.shape
    else:
        flat = kernel_view(tensor)
        if flat is None:
            return None
        shape = tuple(tensor.shape)
    if type(op) is not ReduceOp:
        return None
    engine, dtype = current.engine, flat.dtype
    # op._value_, not op: an Enum's hash is a Python-level call, on every lookup.
    key = (name, dtype, shape, op._value_, algorithm)
    kept = engine.prepared
    prepared = kept.get(key, False)
    if prepared is False:
        prepared = ops.prepare_into(kept, key, world, flat, op, name, shape, algorithm)
        if _front is _quick and prepared is not None:
            _compile_front()
    if prepared is None:
        return None
    if inplace:
        result = tensor
    else:
        result = flat = flat.copy()
        if type(tensor) is not np.ndarray:
            result = sys.modules["torch"].from_numpy(flat)
    if prepared.run is not None:
        run, call = prepared.run, flat
    else:
        run, name = prepared.run_as, _name(None, "allreduce")
        description = prepared.prefix + name + prepared.suffix
        call = (flat, description, signature_of(description) if prepared.signature else 0)
    inline = engine.inline  # Engine.run's inline path, compiled (or None)
    if inline is not None:
        inline(run, name, shape, dtype, call)
    else:
        engine.run(run, name, "all_reduce", shape, dtype, None, call)
    return result


_front = _quick
"""What ``allreduce`` and ``allreduce_`` try first: ``_quick``, or once the compiled module
is loaded (at the first call prepared) its ``Quick``, the same steps in one C call for a
named call on a NumPy array (anything else it hands to ``_quick``)."""


def _compile_front() -> None:
    """Makes ``_front`` the compiled ``Quick`` where the module is loaded (never built here:
    the World that prepared the call loaded it)."""
    global _front
    module = _native.load("_shmfast", build=False)
    if module is not None:
        _front = module.Quick(job, np.ndarray, ReduceOp, _quick)


def _full(tensor, op, name, prescale_factor, postscale_factor, algorithm, inplace,
          asynchronous):
    """The full path of an allreduce: validated, wrapped and run as a closure on the engine.

    A function of its own, apart from ``_quick``: the closure's variables are cells, which a
    function makes on every call before its first line, and the calls that ``_quick`` takes
    would pay for them (about a dozen objects).
    """
    world = job.world()
    buf = wrap(tensor, writable=inplace)
    op = arguments.reduce_op(op, buf.dtype)
    name = _name(name, "allreduce")
    target = arguments.target(buf, inplace)

    def run():
        ops.allreduce(world, target, buf.dtype, op, name=name, shape=buf.shape,
                      prescale=prescale_factor, postscale=postscale_factor, algorithm=algorithm)
        return arguments.result(buf, target, tensor, inplace)

    return _submit(run, name, asynchronous, "all_reduce", buf)


def allreduce(tensor, op: ReduceOp = Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              algorithm: str = "auto"):
    """Returns the reduction of ``tensor`` over all ranks; ``tensor`` is untouched.

    Args:
        tensor: NumPy array or torch CPU tensor, the same shape and dtype on every rank.
        op: Sum, Average (default, as in Horovod), Min, Max, Product, or Adasum (floating
            point only; ``collectives/adasum.py``, which ignores ``algorithm``).
        name: identifies the collective in error reports; ranks must agree on it.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after the reduction (and averaging).
        algorithm: ``auto`` or one of ``ring``, ``topo_ring``, ``doubling``,
            ``halving_doubling``, ``hierarchical``, ``shm`` (see ``collectives/planner.py``).
    """
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        result = _front(tensor, op, name, algorithm, False)
        if result is not None:
            return result
    return _full(tensor, op, name, prescale_factor, postscale_factor, algorithm, False, False)


def allreduce_(tensor, op: ReduceOp = Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               algorithm: str = "auto"):
    """In-place ``allreduce``: the result replaces ``tensor``, which is returned."""
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        result = _front(tensor, op, name, algorithm, True)
        if result is not None:
            return result
    return _full(tensor, op, name, prescale_factor, postscale_factor, algorithm, True, False)


def allreduce_async(tensor, op: ReduceOp = Average, name: str | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    algorithm: str = "auto") -> Handle:
    """Starts an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    return _full(tensor, op, name, prescale_factor, postscale_factor, algorithm, False, True)


def allreduce_async_(tensor, op: ReduceOp = Average, name: str | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     algorithm: str = "auto") -> Handle:
    """Starts an in-place ``allreduce``; don't touch ``tensor`` until it is synchronized."""
    return _full(tensor, op, name, prescale_factor, postscale_factor, algorithm, True, True)


# ----------------------------------------------------------------------------- allgather
def _allgather(tensor, name, asynchronous):
    world, buf = job.world(), wrap(tensor)
    name = _name(name, "allgather")
    arguments.rows(buf, "allgather")

    def run():
        out, rows = ops.allgather(world, buf.flat, buf.dtype, name=name, shape=buf.shape)
        return arguments.row_result(buf, out, sum(rows))

    return _submit(run, name, asynchronous, "all_gather", buf)


def allgather(tensor, name: str | None = None):
    """Concatenates every rank's ``tensor`` along dimension 0 (whose size may differ)."""
    return _allgather(tensor, name, False)


def allgather_async(tensor, name: str | None = None) -> Handle:
    """Starts an ``allgather``; ``synchronize(handle)`` returns the gathered tensor."""
    return _allgather(tensor, name, True)


# ----------------------------------------------------------------------------- broadcast
def _broadcast(tensor, root_rank, name, inplace, asynchronous):
    world = job.world()
    root = arguments.root_index(root_rank, range(world.size))
    buf = wrap(tensor, writable=inplace)
    name = _name(name, "broadcast")
    target = arguments.target(buf, inplace)

    def run():
        ops.broadcast(world, target, buf.dtype, root, name=name, shape=buf.shape)
        return arguments.result(buf, target, tensor, inplace)

    return _submit(run, name, asynchronous, "broadcast", buf)


def broadcast(tensor, root_rank: int, name: str | None = None):
    """Returns root_rank's ``tensor`` on every rank; ``tensor`` is untouched."""
    return _broadcast(tensor, root_rank, name, False, False)


def broadcast_(tensor, root_rank: int, name: str | None = None):
    """In-place ``broadcast``: root_rank's values replace ``tensor``, which is returned."""
    return _broadcast(tensor, root_rank, name, True, False)


def broadcast_async(tensor, root_rank: int, name: str | None = None) -> Handle:
    """Starts a ``broadcast``; ``synchronize(handle)`` returns the new tensor."""
    return _broadcast(tensor, root_rank, name, False, True)


def broadcast_async_(tensor, root_rank: int, name: str | None = None) -> Handle:
    """Starts an in-place ``broadcast``."""
    return _broadcast(tensor, root_rank, name, True, True)


# ----------------------------------------------------------------------------- reducescatter
def _reducescatter(tensor, op, name, prescale_factor, postscale_factor, asynchronous):
    world, op, buf = job.world(), arguments.reduce_op(op), wrap(tensor)
    name = _name(name, "reducescatter")
    arguments.rows(buf, "reducescatter")
    work = arguments.target(buf, False)

    def run():
        mine = ops.reducescatter(world, work, buf.dtype, op, name=name, shape=buf.shape,
                                 prescale=prescale_factor, postscale=postscale_factor)
        rows = ops.split_rows(buf.shape[0], world.size)[world.rank]
        return arguments.row_result(buf, mine, rows)

    # The analyzer checks an even split (input rows = output rows x ranks): the rows of an
    # uneven one are written as they are, and it then reports them.
    out = (ops.split_rows(buf.shape[0], world.size)[world.rank], *buf.shape[1:])
    return _submit(run, name, asynchronous, "reduce_scatter", buf, out)


def reducescatter(tensor, op: ReduceOp = Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduces ``tensor`` over all ranks and returns this rank's block of rows.

    Rows are split as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    return _reducescatter(tensor, op, name, prescale_factor, postscale_factor, False)


def reducescatter_async(tensor, op: ReduceOp = Average, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a ``reducescatter``; ``synchronize(handle)`` returns this rank's block."""
    return _reducescatter(tensor, op, name, prescale_factor, postscale_factor, True)


# ----------------------------------------------------------------------------- alltoall
def _alltoall(tensor, splits, name, asynchronous):
    world, buf = job.world(), wrap(tensor)
    name = _name(name, "alltoall")
    send = arguments.send_counts(splits, arguments.rows(buf, "alltoall"), world.size)

    def run():
        out, received = ops.alltoall(world, buf.flat, buf.dtype, send, name=name, shape=buf.shape)
        result = arguments.row_result(buf, out, sum(received))
        if splits is None:
            return result
        return result, arguments.received_splits(received, tensor)

    return _submit(run, name, asynchronous, "all_to_all", buf)


def alltoall(tensor, splits=None, name: str | None = None):
    """Sends ``splits[j]`` rows of ``tensor`` to rank j and returns the rows received.

    Without ``splits`` the rows are divided equally and the received tensor is returned;
    with ``splits`` (as in Horovod) a pair ``(received, received_splits)``.
    """
    return _alltoall(tensor, splits, name, False)


def alltoall_async(tensor, splits=None, name: str | None = None) -> Handle:
    """Starts an ``alltoall``; ``synchronize(handle)`` returns what ``alltoall`` would."""
    return _alltoall(tensor, splits, name, True)


# ----------------------------------------------------------------------------- the rest
def barrier() -> None:
    """Returns once every rank has called ``barrier``."""
    world = job.world()
    _submit(lambda: ops.barrier(world), "barrier", False, "barrier")


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None):
    """Returns root_rank's ``obj`` (any picklable object) on every rank."""
    world = job.world()
    root = arguments.root_index(root_rank, range(world.size))
    name = _name(name, "broadcast_object")
    return _submit(lambda: ops.broadcast_object(world, obj, root, name=name), name, False,
                   "broadcast")


def allgather_object(obj, name: str | None = None) -> list:
    """Returns the list of every rank's ``obj`` (any picklable object), in rank order."""
    world = job.world()
    name = _name(name, "allgather_object")
    return _submit(lambda: ops.allgather_object(world, obj, name=name), name, False,
                   "all_gather")


def synchronize(handle: Handle):
    """Waits for an async operation and returns its result (or raises its error)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize takes a Handle from an *_async call, got {handle!r}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the async operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll takes a Handle from an *_async call, got {handle!r}")
    return handle.poll()


# ----------------------------------------------------------------------------- pace
def mark_step() -> None:
    """Ends a training step on this rank: steps are what stragglers are judged by (every rank
    marks the same steps). The Horovod API's ``DistributedOptimizer.step`` marks them itself;
    a job that marks none counts every ``straggler_ops`` operations as a step."""
    meter.mark_step()


def stragglers():
    """The newest straggler report (``gradsync.liveness.straggler_watch.Report``): the ranks named
    now, each with its host and its steps' split into compute, data, waiting and communication (ms);
    rank 0 also has every rank's numbers (``ranks``). Empty before any step was judged,
    in a one-rank job and with ``straggler_interval`` 0."""
    from .liveness.straggler_watch import EMPTY, running

    current = job.current()
    # A job's publisher, else a torch job's (its default group over the backend "gradsync").
    pace = running() if current is None else current.pace
    return EMPTY if pace is None else pace.report
