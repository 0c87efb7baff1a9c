"""``ProcessGroupGradsync``: a ``torch.distributed.ProcessGroup`` over a gradsync World.

torch calls the backend's creator once per process group (the default group and every
``new_group``), with the group's store (already prefixed by torch for this group), this rank's
index in the group and the group's size. Each group becomes a gradsync World of its own over
that store: its own connections (shared memory inside a host, TCP between hosts), sequence
numbers and abort record, so two groups never interleave frames and one group's failure does
not poison another. Every collective maps onto one of gradsync's operations
(``gradsync/pipeline/operations.py``) and runs on the group's progress lane; sends and receives run
on a lane per peer and direction, over a two-rank World of their own (``p2p.py``), so they never
wait behind collectives or block them.

Calls from torch arrive here in two ways with the same signatures: from Python
(``dist.all_reduce`` calls ``group.allreduce``, found on this class) and from C++ (DDP's
reducer, functional collectives), through the virtual methods of torch's ``PyProcessGroup``
trampoline. Arguments are checked on the caller's thread (a bad argument raises there,
``ValueError``); everything that can go wrong between ranks fails the Work.
"""

from __future__ import annotations

import atexit
import itertools
import secrets
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist

from ... import job as _job
from ...pipeline import operations as ops
from ...config import load_config
from ...errors import GradsyncError
from ...flight_recorder import recorder
from ...liveness.pace import meter
from ...cluster.launch_env import LaunchEnv, host_name
from ...cluster.rendezvous import Store
from .backward import backward
from .errors import BackendError, to_backend_error
from .p2p import PointToPoint, clone_store
from .sharing import Sharing
from .tensors import as_bytes, contiguous, fold, reduction_of, typed
from .work import Lane, Work, close_lanes

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["ProcessGroupGradsync", "create", "SHUTDOWN_GRACE_S", "ABORT_GRACE_S"]

# The flight recorder's name of an operation where it is not the lane's (torch's recorder
# knows these collectives by their older names).
_RECORDED_AS = {"all_reduce_coalesced": "allreduce_coalesced",
                "all_gather_coalesced": "all_gather_into_tensor_coalesced",
                "all_gather_into_tensor": "_all_gather_base",
                "reduce_scatter_tensor": "_reduce_scatter_base"}

_instances: dict[str, itertools.count] = {}
_instances_lock = threading.Lock()


def _tcp_address(store) -> tuple[str, int]:
    """The host and port of the TCPStore under torch's PrefixStores ('' and 0 if none)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return "", 0


def create(options, backend_options=None) -> "ProcessGroupGradsync":
    """The creator registered with ``Backend.register_backend`` (extended API)."""
    return ProcessGroupGradsync(options.store, options.group_rank, options.group_size,
                                options.timeout, str(options.group_id),
                                list(options.global_ranks_in_group or []))


# torch's stubs describe ProcessGroup as its users call it: each collective with the overloads
# of its Python front (a tensor and a ReduceOp, or a list and options), _get_backend returning a
# Backend, and only the constructor that takes a store. A backend written in Python, as this
# one, is called by c10d with (tensors, opts) and is its own backend, and torch's bindings
# accept (rank, size): the `# type: ignore[...]` below mark those places, one code each.
class ProcessGroupGradsync(dist.ProcessGroup):
    """A process group whose collectives run on gradsync's transports and algorithms.

    Args:
        store: the group's store (any ``torch.distributed.Store``) for the rendezvous.
        rank, size: this rank's index in the group and the group's size.
        timeout: how long a collective may wait on live peers (``init_process_group``'s).
        group_id: torch's name of the group; with a per-process count it names the World.
        global_ranks: the group's ranks in the default group (``options.global_ranks_in_group``).
    """

    _closed: bool  # another group's __init__ reads it (_owners)

    def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30),
                 group_id: str = "0", global_ranks: "list[int] | None" = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # see above the class
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._group_name, self._group_desc = str(group_id), ""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        config = load_config()
        if seconds > 0:
            config = config.replace(timeout=seconds)
        with _instances_lock:
            # Ranks create their groups in the same order, so the count agrees between them;
            # it keeps a group re-created under the same name (destroy, then init again over
            # the same store) from meeting the keys of its previous incarnation.
            incarnation = next(_instances.setdefault(group_id, itertools.count()))
        key = f"gradsync/nonce/{group_id}/{incarnation}"
        if rank == 0:
            store.set(key, secrets.token_hex(6))
        # The nonce keeps two jobs on one host apart in /dev/shm even if their stores look alike.
        job = f"pg{group_id}.{incarnation}.{store.get(key).decode()}"
        addr, port = _tcp_address(store)
        env = LaunchEnv(rank=rank, size=size, local_rank=None, local_size=None,
                        cross_rank=None, cross_size=None, hostname=host_name(),
                        store_addr=addr or "127.0.0.1", store_port=port, store_is_server=False,
                        secret=None, job_id=job, source="torch.distributed")
        from ...connect.world import World

        try:
            # A connection of its own to the store: torch's main thread may block on the
            # given one (a store-based barrier) while this group's lane polls the abort record.
            self.world = World.connect(config, env, Store.over(clone_store(store), job,
                                                               config.connect_timeout))
        except GradsyncError as exc:
            raise to_backend_error(exc, f"rank {rank} joining the gradsync process group") \
                from exc
        self._lane = Lane(f"gradsync-pg{group_id}", self._failed)
        self._prepared: dict = {}
        """The small allreduces of this group prepared once per distinct call (``_small``)."""
        self._sharing = Sharing(self.world, config.torch_share_buckets)
        self._pace = None
        # The first group of a torch job (its default group) owns the flight recorder's
        # settings and the pace meter, as a gradsync job does (``job.Job``): steps,
        # stragglers, ``gradsync top``; unless a job of the NumPy or Horovod API runs, or
        # a live group owns them already. (A torch job after a gradsync job that has shut
        # down, in one process, owns them anew.)
        self._owns = _job.current() is None and not any(not g._closed for g in _owners)
        if self._owns:
            _owners.add(self)
            recorder.configure(config, self._global_ranks[rank], job)
            meter.reset(config.straggler_ops, on=config.straggler_interval > 0)
            if config.straggler_interval > 0 and size > 1:
                from ...liveness.straggler_watch import Publisher
                self._pace = Publisher(self.world)
        self._track = recorder.track(f"torch:{job}", f"torch group {group_id}",
                                     self._global_ranks, "torch", config.timeout, self.world)
        self._scratch = torch.empty(0, dtype=torch.uint8)  # see _work
        self._p2p = PointToPoint(self.world)
        self._closed = False
        _live.add(self)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "gradsync"

    def __repr__(self) -> str:
        return f"ProcessGroupGradsync(rank={self.rank()}, size={self.size()})"

    # torch's ProcessGroup keeps the name and description in its backends, and a Python
    # group has none: without these, ``group.group_name`` (DeviceMesh, functional
    # collectives) raises "ProcessGroup name not set".
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # ------------------------------------------------------------------ device and backend
    # torch asks a group which devices it serves and for the backend of each
    # (``_get_pg_default_device``, the state-dict helpers' broadcast from rank 0, DCP's
    # ``async_save``, the object collectives' device choice). torch keeps those answers in the
    # C++ ProcessGroup's table of backends, which only a C++ ``c10d::Backend`` can enter:
    # torch 2.13 binds that class without a constructor for Python subclasses ("No
    # constructor defined!") and without the trampoline that would route its virtual
    # methods to Python, so a Python backend cannot be registered there. This group is its
    # own backend for the one device it serves, and answers those questions itself, as a
    # gloo group does: ``_device_types`` is [cpu], ``_get_backend(cpu)`` is the backend
    # (this object), any other device raises as torch does.
    @property
    def _device_types(self) -> list:
        return [_CPU]

    def _get_backend(self, device) -> "ProcessGroupGradsync":  # type: ignore[override]
        device = torch.device(device)
        if device.type != "cpu":
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return self

    @property
    def options(self):
        """The backend's options, as a c10d backend has them (name and timeout)."""
        options = _BackendOptions("gradsync", timedelta(seconds=self.world.config.timeout))
        options.group_name = cast("GroupName", self._group_name)  # a NewType of str
        options.global_ranks_in_group = list(self._global_ranks)
        return options

    # Capabilities torch reads off a backend (FSDP's allocator, coalescing managers,
    # ``split_group``, the time estimator): none of these c10d extras. gloo answers the same
    # but for splitting (it can split a group's communicator; each gradsync group is a World
    # made anew, so ``split_group`` is refused and ``new_group`` is the way).
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def name(self) -> str:
        return "gradsync"

    # ------------------------------------------------------------------ plumbing
    def _failed(self, exc: BaseException, what: str) -> BackendError:
        if isinstance(exc, GradsyncError):
            exc = self.world.fail(exc)  # posts the abort record: the other ranks raise too
        return to_backend_error(exc, f"rank {self.world.rank}: {what}")

    def _run(self, what: str, result, fn, opts=None) -> Work:
        """Runs ``fn`` on the lane; inline when torch says the caller waits (``asyncOp``
        False: ``dist.all_reduce(t)`` without ``async_op``) and the lane is idle."""
        world = self.world

        def guarded():
            if world.failure is not None:
                raise world.failure
            # A record posted while this rank was between collectives (a peer's abort): the
            # collective must not begin, even where the peers' parts let it finish. At most
            # one look per abort_poll_interval, and no store request: the heartbeat's abort
            # watch holds the record (without heartbeats the waits poll the store anyway).
            if world.heartbeat is not None:
                world.on_idle(0.0)
            fn()

        work = Work(what, result)
        first = _first_tensor(result)
        kind = what.split(" ", 1)[0]
        work.record = self._track.issue(
            _RECORDED_AS.get(kind, kind), None, None if first is None else tuple(first.shape),
            None if first is None else first.dtype)
        backward.issued()  # inside a backward pass (DDP's buckets): watch its end's wait
        if opts is not None and not getattr(opts, "asyncOp", True):
            return self._lane.run_now(work, guarded)
        return self._lane.submit(work, guarded)

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"{what}: root {root} is outside the group's ranks 0..{self.size() - 1}")
        return root

    # ------------------------------------------------------------------ reductions
    def _allreduce_one(self, t: torch.Tensor, opts_op, what: str, in_place: bool = True,
                       share: bool = False):
        """The closure that allreduces ``t`` (in place, or into a scratch copy for ``reduce``);
        ``share``: ``t`` may move into shared memory (``sharing.py``)."""
        red = reduction_of(opts_op, t.dtype)
        world = self.world

        def run():
            work = contiguous(t) if in_place else t.detach().clone()
            if share and work is t and red.op is not None:
                self._sharing.offer(t)  # before its bytes are viewed: it may move
            if red.op is None:
                gathered, _ = ops.allgather(world, as_bytes(work), np.uint8, name=what,
                                            shape=(work.nbytes,))
                work.copy_(fold(red, gathered, work, world.size))
            else:
                flat, dtype = red.flat(work)
                shape = tuple(work.shape)
                if not self._small(flat, dtype, red, what, shape):
                    ops.allreduce(world, flat, dtype, red.op, name=what, shape=shape,
                                  prescale=red.prescale)
            if in_place and work is not t:
                t.copy_(work)
        return run

    def _small(self, flat: np.ndarray, dtype, red, what: str, shape: tuple) -> bool:
        """Reduces ``flat`` through the pipeline's small-call fast case, as the NumPy API's
        small synchronous allreduces do (``operations.prepare_allreduce``: the description,
        signature and road worked out once per distinct call, then one begin and one call of
        the host segment); False (nothing done) where that does not apply: a scaled
        reduction (``PREMUL_SUM``), bfloat16 (reduced as its own type, not as its int16
        view), or a call that cannot be prepared (not small, not on one host). It is the
        same collective as ``operations.allreduce`` with these arguments (the same
        description, signature and protocol), so ranks on either road meet."""
        if red.prescale != 1.0 or dtype is not flat.dtype:
            return False
        # ``flat.size`` too: a complex tensor is reduced as twice as many reals, so a shape
        # and a dtype alone do not say how many bytes it is (nor which road it takes).
        key = (what, dtype, shape, flat.size, red.op._value_)
        kept = self._prepared
        prepared = kept.get(key, False)
        if prepared is False:
            prepared = ops.prepare_into(kept, key, self.world, flat, red.op, what, shape, "auto")
        if prepared is None:
            return False
        prepared.run(flat)  # named (``what``): its description is prepared
        return True

    def _sparse_allreduce_one(self, t: torch.Tensor, opts_op):
        """The closure that sums a sparse COO tensor ``t`` in place, as gloo does: every
        rank's coalesced indices and values are gathered (ranks hold different numbers of
        entries), and each rank adds them up into one coalesced tensor."""
        kind = opts_op if isinstance(opts_op, dist.ReduceOp.RedOpType) else opts_op.op
        if kind != dist.ReduceOp.SUM:
            raise ValueError("all_reduce of a sparse tensor supports ReduceOp.SUM only")
        if t.device.type != "cpu":
            raise ValueError(f"the gradsync backend takes CPU tensors; got one on {t.device}")
        world, sparse_dims = self.world, t.sparse_dim()
        index_bytes = sparse_dims * 8  # int64 per sparse dimension, per entry
        value_shape = tuple(t.shape[sparse_dims:])
        value_bytes = int(np.prod(value_shape, dtype=np.int64)) * t.element_size()
        entry = index_bytes + value_bytes

        def run():
            mine = t.coalesce()
            # One row per entry: its indices, then its values, so one allgather carries both.
            # ``view(uint8)`` needs unit strides in the last dimension, which ``contiguous()``
            # does not promise where a dimension has size 1: fresh copies (``_packed``).
            rows = torch.empty((mine._nnz(), entry), dtype=torch.uint8)
            rows[:, :index_bytes] = _packed(mine._indices().t()).view(torch.uint8) \
                .reshape(-1, index_bytes)
            rows[:, index_bytes:] = _packed(mine._values()).view(torch.uint8) \
                .reshape(-1, value_bytes)
            out, _ = ops.allgather(world, as_bytes(rows), np.uint8, name="all_reduce sparse",
                                   shape=(rows.numel() // entry if entry else 0, entry))
            every = torch.from_numpy(out).reshape(-1, entry)
            # Fresh copies of the two columns, so that their bytes can be reinterpreted
            # (``view(dtype)`` needs aligned rows; a one-row slice keeps the rows' stride).
            indices = _packed(every[:, :index_bytes]).view(torch.int64).t()
            values = _packed(every[:, index_bytes:]).view(t.dtype).reshape(-1, *value_shape)
            t.copy_(torch.sparse_coo_tensor(indices, values, t.shape).coalesce())
        return run

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # Issued inside a backward pass: DDP's buckets (or a comm hook's tensors), which may
        # move into shared memory (``sharing.py`` says why only these).
        share = self._sharing.on and torch._C._current_graph_task_id() != -1
        steps = [self._sparse_allreduce_one(t, op) if t.is_sparse else
                 self._allreduce_one(t, op, "all_reduce", share=share) for t in tensors]
        return self._run("all_reduce", tensors, lambda: [s() for s in steps], opts)

    def allreduce_coalesced(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        steps = []
        for dtype, members in groups.items():
            # One allreduce per dtype over the members packed end to end.
            packed = torch.empty(sum(t.numel() for t in members), dtype=dtype)
            step = self._allreduce_one(packed, op, "all_reduce_coalesced")

            def run(members=members, packed=packed, step=step):
                torch.cat([t.detach().reshape(-1) for t in members], out=packed)
                step()
                offset = 0
                for t in members:
                    t.copy_(packed[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            steps.append(run)
        return self._run("all_reduce_coalesced", tensors, lambda: [s() for s in steps], opts)

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        root = self._root(opts.rootRank, "reduce")
        mine = self.rank() == root
        steps = [self._allreduce_one(t, opts.reduceOp, f"reduce root={root}", in_place=mine)
                 for t in tensors]
        return self._run("reduce", tensors, lambda: [s() for s in steps], opts)

    def _reduce_scatter_one(self, output: torch.Tensor, chunks: list, op, what: str,
                            whole: "torch.Tensor | None" = None):
        """The closure that reduce-scatters ``chunks`` (one per rank) into ``output``;
        ``whole``: the chunks end to end in one contiguous tensor, when the caller has it."""
        n = self.size()
        if len(chunks) != n:
            raise ValueError(f"{what}: {len(chunks)} inputs for a group of {n} ranks")
        for c in chunks:
            if c.shape != output.shape or c.dtype != output.dtype:
                raise ValueError(f"{what}: an input is {c.dtype}{list(c.shape)}, the output "
                                 f"{output.dtype}{list(output.shape)}; they must match")
        red = reduction_of(op, output.dtype)
        world = self.world

        def run():
            # The ring reduces into the group's work buffer, which spares the page faults of a
            # fresh one per call (they cost more than the transfer: docs/benchmarks-history.md,
            # "The backend's reduce-scatter and allgather"). It reads a contiguous ``whole``
            # where it lies; separate chunks are copied into the buffer first.
            stacked = self._work(output.nbytes * n, output.dtype, (n, *output.shape))
            source = None
            if whole is None or red.op is None or red.prescale != 1.0:
                torch.stack([c.detach() for c in chunks], out=stacked)
            else:
                source = red.flat(whole.detach().reshape(stacked.shape))[0]
            if red.op is None:
                gathered, _ = ops.allgather(world, as_bytes(stacked), np.uint8, name=what,
                                            shape=(stacked.nbytes,))
                everything = typed(gathered, output.dtype).reshape(n, n, *output.shape)
                output.copy_(red.fold_fn(everything[:, world.rank]))
                return
            flat, dtype = red.flat(stacked)
            contribution, work = (flat, None) if source is None else (source, flat)
            into = red.flat(output)[0] if output.is_contiguous() else None  # the block's place
            mine = ops.reducescatter(world, contribution, dtype, red.op, name=what,
                                     shape=(n, flat.size // n if n else 0),
                                     prescale=red.prescale, out=into, work=work)
            if into is not None:
                return
            result = torch.from_numpy(mine)
            if output.is_complex():
                result = torch.view_as_complex(result.reshape(-1, 2))
            else:
                result = result.view(output.dtype) if result.dtype != output.dtype else result
            output.copy_(result.reshape(output.shape))
        return run

    def _work(self, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The group's work buffer, as a ``dtype`` tensor of ``shape`` (``nbytes`` bytes).

        It grows to the largest request and is kept: collectives run one at a time on the
        lane, so one buffer serves them all."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(0, dtype=torch.uint8)  # the old one goes first
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype).view(shape)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        steps = [self._reduce_scatter_one(o, list(i), op, "reduce_scatter")
                 for o, i in zip(output_tensors, input_tensors)]
        return self._run("reduce_scatter", output_tensors, lambda: [s() for s in steps], opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        n = self.size()
        if input.numel() != output.numel() * n:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"need {n} x output's {output.numel()}")
        chunks = list(input.reshape(n, *output.shape).unbind(0)) if n > 1 else \
            [input.reshape(output.shape)]
        step = self._reduce_scatter_one(output, chunks, op, "reduce_scatter_tensor",
                                        input if input.is_contiguous() else None)
        return self._run("reduce_scatter_tensor", [output], step, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work.completed("reduce_scatter_tensor_coalesced", [])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        root = self._root(opts.rootRank if opts is not None else 0, "broadcast")
        world = self.world

        def run():
            for t in tensors:
                work = contiguous(t)
                ops.broadcast(world, as_bytes(work), np.uint8, root,
                              name=f"broadcast {t.dtype}{list(t.shape)}", shape=(work.nbytes,))
                if work is not t:
                    t.copy_(work)
        return self._run("broadcast", tensors, run, opts)

    def _gather_bytes(self, t: torch.Tensor, what: str, into: "np.ndarray | None" = None):
        """All ranks' bytes of ``t`` and the byte count of each (on the lane); in ``into``
        when it has the gathered size (``ops.allgather``)."""
        work = contiguous(t)
        out, counts = ops.allgather(self.world, as_bytes(work), np.uint8, name=what,
                                    shape=(work.nbytes,), into=into)
        return out, counts

    def _scatter_into(self, out: np.ndarray, counts: list, targets: list, what: str) -> None:
        """Copies rank r's bytes (of ``out``) into ``targets[r]``; sizes must agree."""
        offset = 0
        for r, (count, target) in enumerate(zip(counts, targets)):
            if count != target.nbytes:
                raise BackendError(f"{what}: rank {r} sent {count} bytes but this rank "
                                   f"{self.world.rank} expects {target.nbytes} "
                                   f"({target.dtype}{list(target.shape)}) from it")
            if target.is_contiguous():
                as_bytes(target)[:] = out[offset:offset + count]
            else:
                target.copy_(typed(out[offset:offset + count].copy(), target.dtype)
                             .reshape(target.shape))
            offset += count

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs in output_tensors:
            if len(outs) != self.size():
                raise ValueError(f"all_gather: {len(outs)} outputs for a group of "
                                 f"{self.size()} ranks")

        def run():
            for outs, t in zip(output_tensors, input_tensors):
                out, counts = self._gather_bytes(t, f"all_gather {t.dtype}")
                self._scatter_into(out, counts, list(outs), "all_gather")
        return self._run("all_gather", output_tensors, run, opts)

    def all_gather_single(self, output, input, opts=None):
        n = self.size()
        if output.numel() != input.numel() * n or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: output is {output.dtype} with "
                             f"{output.numel()} elements, need {input.dtype} with {n} x "
                             f"{input.numel()}")

        def run():
            # Straight into the output when it is contiguous and of the gathered size.
            into = as_bytes(output) if output.is_contiguous() else None
            out, counts = self._gather_bytes(input, f"all_gather_into_tensor {input.dtype}",
                                             into)
            if out is not into:
                self._scatter_into(out, [sum(counts)], [output], "all_gather_into_tensor")
        return self._run("all_gather_into_tensor", [output], run, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work.completed("all_gather_into_tensor_coalesced", [])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's
        ``input_list[i]`` (one list per *rank*, where ``allgather`` has one per input). The
        inputs travel end to end in one allgather; each rank's block is cut by the sizes of
        its outputs, which must match what it sent."""
        n = self.size()
        if len(output_lists) != n or any(len(outs) != len(input_list) for outs in output_lists):
            raise ValueError(f"all_gather_coalesced: needs {n} output lists (one per rank) of "
                             f"{len(input_list)} tensors each (one per input)")

        def run():
            pieces = [contiguous(t) for t in input_list]
            send = np.concatenate([as_bytes(p) for p in pieces]) if pieces else \
                np.empty(0, np.uint8)
            out, counts = ops.allgather(self.world, send, np.uint8, name="all_gather_coalesced",
                                        shape=(send.size,))
            offset = 0
            for r, (count, outs) in enumerate(zip(counts, output_lists)):
                want = sum(t.nbytes for t in outs)
                if count != want:
                    raise BackendError(f"all_gather_coalesced: rank {r} sent {count} bytes but "
                                       f"rank {self.world.rank} expects {want} from it "
                                       f"({[list(t.shape) for t in outs]})")
                self._scatter_into(out[offset:offset + count],
                                   [t.nbytes for t in outs], list(outs),
                                   f"all_gather_coalesced from rank {r}")
                offset += count
        return self._run("all_gather_coalesced", output_lists, run, opts)

    def _all_to_all(self, send: np.ndarray, send_counts: list, what: str):
        """Sends ``send_counts[j]`` bytes of ``send`` to rank j; returns bytes and counts in."""
        return ops.alltoall(self.world, send, np.uint8, send_counts, name=what,
                            shape=(send.size,))

    def gather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        root = self._root(opts.rootRank, "gather")
        n, mine = self.size(), self.rank() == root
        if mine and (len(output_tensors) != 1 or len(output_tensors[0]) != n):
            raise ValueError(f"gather: the root needs one list of {n} output tensors")

        def run():
            t = contiguous(input_tensors[0])
            counts = [t.nbytes if r == root else 0 for r in range(n)]
            out, got = self._all_to_all(as_bytes(t), counts, f"gather root={root}")
            if mine:
                self._scatter_into(out, got, list(output_tensors[0]), "gather")
        return self._run("gather", output_tensors, run, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        root = self._root(opts.rootRank, "scatter")
        n, mine = self.size(), self.rank() == root
        if mine and (len(input_tensors) != 1 or len(input_tensors[0]) != n):
            raise ValueError(f"scatter: the root needs one list of {n} input tensors")

        def run():
            if mine:
                pieces = [contiguous(t) for t in input_tensors[0]]
                send = np.concatenate([as_bytes(p) for p in pieces]) if pieces else \
                    np.empty(0, np.uint8)
                counts = [p.nbytes for p in pieces]
            else:
                send, counts = np.empty(0, np.uint8), [0] * n
            out, got = self._all_to_all(send, counts, f"scatter root={root}")
            self._scatter_into(out, [sum(got)], [output_tensors[0]], "scatter")  # only root sent
        return self._run("scatter", output_tensors, run, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"all_to_all: needs {n} inputs and {n} outputs, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")

        def run():
            pieces = [contiguous(t) for t in input_tensors]
            send = np.concatenate([as_bytes(p) for p in pieces])
            out, got = self._all_to_all(send, [p.nbytes for p in pieces], "all_to_all")
            self._scatter_into(out, got, list(output_tensors), "all_to_all")
        return self._run("all_to_all", output_tensors, run, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        in_rows = _splits(input, input_split_sizes, n, "input")
        out_rows = _splits(output, output_split_sizes, n, "output")
        in_row_bytes = input[0].nbytes if input.dim() and input.shape[0] else 0
        out_row_bytes = output[0].nbytes if output.dim() and output.shape[0] else 0

        def run():
            src = contiguous(input)
            out, got = self._all_to_all(as_bytes(src), [r * in_row_bytes for r in in_rows],
                                        "all_to_all_single")
            want = [r * out_row_bytes for r in out_rows]
            if got != want:
                raise BackendError(f"all_to_all_single: rank {self.world.rank} expected "
                                   f"{want} bytes from the ranks, got {got}")
            self._scatter_into(out, [sum(got)], [output], "all_to_all_single")
        return self._run("all_to_all_single", [output], run, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        world = self.world
        return self._run("barrier", [], lambda: ops.barrier(world), opts)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dst: int, tag: int = 0):
        self._root(dst, "send")
        return self._p2p.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        self._root(src, "recv")
        return self._p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return self._p2p.recv_anysource(tensors, tag)

    # ------------------------------------------------------------------ life cycle
    def shutdown(self) -> None:
        """Finishes what is queued, then closes the group's connections.

        What has not finished within ``SHUTDOWN_GRACE_S`` ends as by ``abort``, on every
        rank: a collective still in flight here cannot finish on the peers either (each
        needs this rank's part), and without the abort record they would wait for the
        group's timeout."""
        if self._closed:
            return  # aborted (or shut down) already
        if not self._lane.drain(SHUTDOWN_GRACE_S):
            self._end(f"rank {self.world.rank} shut the process group down with "
                      f"{self._lane.in_flight()} in flight", post=True)
            return
        self._closed = True
        self._lane.close(BackendError("the process group has been shut down"))
        # Sends and receives still waiting for a partner are not waited for: an unmatched
        # irecv would otherwise hold shutdown until the group's timeout.
        self._p2p.close(wait=False)
        if self._pace is not None:
            self._pace.stop()
        self.world.close()

    def abort(self) -> None:
        """Ends the group's collectives at once, on every rank, and closes the connections.

        What is queued or in flight here fails; the abort record ("the process group was
        aborted by rank r") ends the peers' collectives of this group too, within their
        next look at it (``abort_poll_interval``), as a lost peer's record does."""
        if not self._closed:
            self._end(f"the process group was aborted by rank {self.world.rank}", post=True)

    def _end(self, message: str, post: bool) -> None:
        """Fails what is queued or in flight with ``message`` and closes the connections;
        ``post``: also posts the abort record, which ends the peers' collectives."""
        self._closed = True
        world = self.world
        if world.failure is None:  # else a failure is posted already: the peers know
            if post:
                try:
                    world.store.post_abort({"kind": "GradsyncError", "rank": world.rank,
                                            "message": message, "peer": None})
                except (GradsyncError, RuntimeError, OSError):
                    pass  # the store is gone: the peers lose this rank's links instead
            # A wait never raises a record that its own rank posted: tell this rank's.
            if world.heartbeat is not None:
                world.heartbeat.end_waits(GradsyncError(message))
        reason = BackendError(message)
        self._lane.close(reason, wait=False)
        # The collective in flight raises at its wait's next look (abort_poll_interval);
        # the connections close only after it has, so it never reads a closed segment.
        if not self._lane.drain(ABORT_GRACE_S):
            self._lane.fail_current(reason)  # a wait that does not look: its caller goes on
        self._p2p.close(wait=False)
        if self._pace is not None:
            self._pace.stop()
        world.close()

_CPU = torch.device("cpu")
_BackendOptions = torch._C._distributed_c10d.Backend.Options
_live: "weakref.WeakSet[ProcessGroupGradsync]" = weakref.WeakSet()
_owners: "weakref.WeakSet[ProcessGroupGradsync]" = weakref.WeakSet()  # see __init__
_EXIT_GRACE_S = 2.0
SHUTDOWN_GRACE_S = 2.0
"""Seconds ``shutdown`` lets queued collectives finish before it aborts them."""
ABORT_GRACE_S = 2.0
"""Seconds ``abort`` waits for the collective in flight to end before closing under it."""


@atexit.register
def _release_at_exit() -> None:
    """Lets go of the backend while the interpreter still runs.

    A script that ends without ``destroy_process_group()`` (most do, and every one that ends on
    an exception) leaves its groups registered in torch's C++ (the group registry of the
    functional collectives is a static map). Those are destroyed after the interpreter is gone,
    and releasing a Python backend then needs a GIL that no longer exists: the process aborts
    ("terminate called without an active exception", status -6) instead of exiting with the
    script's status (pytorch/pytorch#190489). So at exit, after the user's own exit handlers:
    close the lanes, abort this backend's groups (what is still queued fails; nothing waits),
    then destroy the process groups."""
    close_lanes(_EXIT_GRACE_S)
    groups = list(_live)
    if not groups:
        return
    try:
        for group in groups:  # at once: a lane stuck in a collective must not hold the exit
            # The record only for a collective still in flight here: a process that exits
            # after its last collective must not fail a peer still finishing the same one.
            if not group._closed:
                group._end("the process is exiting", post=group._lane.in_flight() != "nothing")
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting; nothing left to report to
        pass


def _first_tensor(result) -> "torch.Tensor | None":
    """The first tensor of an operation's tensors (a list, or a list of lists), whose shape and
    dtype its flight recorder's record takes."""
    while isinstance(result, (list, tuple)) and result:
        result = result[0]
    return result if isinstance(result, torch.Tensor) else None


def _packed(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with row-major strides in every dimension, size-1 ones included."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


def _splits(t: torch.Tensor, sizes, n: int, which: str) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % n:
            raise ValueError(f"all_to_all_single: the {which}'s {rows} rows do not divide "
                             f"among {n} ranks; pass split sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or min(sizes) < 0 or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {which} split sizes {sizes} must have {n} "
                         f"non-negative entries summing to its {rows} rows")
    return sizes
