"""DistributedOptimizer: Horovod's gradient-averaging optimizer wrapper, on fixed buckets.

The returned object *is* an instance of the wrapped optimizer's class. DistributedOptimizer
builds (``wrapping.rebase``, shared with the Adasum optimizer), once per optimizer class, a
subclass whose methods come first from the ``_DistributedOptimizer`` mixin below, and gives
the new object the wrapped optimizer's attributes (the very same ``param_groups``, ``state``
and ``defaults``). So ``isinstance(opt, torch.optim.SGD)``,
``state_dict``/``load_state_dict``, LR schedulers and ``torch.amp.GradScaler`` work as on the
original. The class has to be made at run time because the wrapped class is only known then
(Horovod does the same); all the behaviour is in the mixin, which is ordinary code.

One round (one optimizer step), on each rank:

0. ``zero_grad()``. Each bucket is zeroed in place and every gradient it reduces becomes its
   view of the bucket (``buckets.py``), so that backward accumulates into the fusion buffers
   directly, as DDP's ``gradient_as_bucket_view``: no copy, no allocation. ``p.grad`` is then
   a zero tensor rather than None; ``zero_grad(set_to_none=True)`` gives torch's None (and a
   copy into the bucket at the next backward). In a one-rank job (no buckets) it is torch's.
1. backward. ``Tensor.register_post_accumulate_grad_hook`` reports each parameter whose
   gradient has been accumulated. After ``backward_passes_per_step`` reports, a gradient that
   is not already its view is copied into its view of its bucket (``buckets.py``). When a
   bucket is complete and every earlier bucket has been launched, its allreduce goes to the
   process set's controller (``allreduce_async_``; ``gradsync/pipeline/negotiation.py``), which runs
   it (fused with other ready buckets) while backward computes the next gradients.
2. ``step()`` or ``synchronize()``. Buckets not launched yet, because a member got no gradient
   (a parameter unused this step, a branch this rank did not take) or fewer passes than
   expected, are completed with what is there (zeros for a missing gradient, as Horovod does)
   and launched, in order. Then each bucket is waited for: only allreduces still in flight
   cost time. Every ``param.grad`` becomes its view of the reduced bucket.
3. the wrapped optimizer's own ``step``.

A round is reduced once: ``synchronize()`` again before the next backward, or ``step()`` after
it, does nothing more. Between backward and ``synchronize()`` the allreduces may be running, so
a gradient changed in place then (clipping too early) would be lost or race with them: the
version counters of the gradients and buckets, recorded when they were staged and launched,
turn that into an error.

Averaging: with ``op=Average`` the collective divides the sum by the number of ranks (on
one host, inside the shared-memory reduction: each element is divided once, by the rank that
summed it, while it is in cache; ``transport/host_segment.py``). With a
``gradient_predivide_factor`` f, each rank's gradients are multiplied by 1/f before the sum
and the result by f after the division (1/size overall; the split keeps half-precision sums
in range). Compression casts each bucket to the wire dtype before its allreduce and back
after it; a compressor that owns its reduction (``Compression.int8``, ``.fp8``,
``.powersgd``, ``.randomk``; ``gradsync/compress/``) replaces the bucket's allreduce with its
own, on the bucket as a whole (PowerSGD sees each member's shape), keyed by the bucket's name
for its error feedback (``requests.compressed_allreduce``).

Gradient lag (``gradient_lag=1``, ``lag.py``): each bucket's allreduce runs on a copy of the
bucket and is waited for at the *next* round's ``step()``, which applies it; the first
``step()`` applies nothing.

Local SGD chosen by auto (``compression="auto", local_sgd=H``): the optimizer attaches its
parameters to the ``Auto`` (``gradsync/compress/auto_local.py``) and calls its
``after_step()`` after each wrapped step; where auto chose H > 1, the buckets give back each
rank's own gradients and the parameters are averaged at each window's end.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from ..collectives.ops import Average, ReduceOp, Sum
from ..compress.auto import Auto
from ..compress.auto_model import periods_upto
from ..liveness.pace import meter
from . import adasum_optimizer
from . import buckets as _buckets
from .buckets import Bucket, assign_buckets, check_layout, choose_shared
from .compression import Compression, Compressor, reducing
from .grouped import sparse_allreduce_async
from .lag import BucketLag
from . import process_sets as _psets
from . import requests as _requests
from .mpi_ops import Adasum, ProcessSet, global_process_set
from .wrapping import grad_hook, rebase, remove_hooks

__all__ = ["DistributedOptimizer"]

_LIVE: "weakref.WeakSet[_DistributedOptimizer]" = weakref.WeakSet()
"""DistributedOptimizers with hooks registered (``join()`` checks that none is mid-round)."""

_OWNER = "_gradsync_optimizer"
"""Attribute of a managed parameter: a weak reference to the optimizer whose hook it carries."""

_MODIFIED = (
    "{what} was modified between backward() and synchronize() (by GradScaler.unscale_, "
    "clip_grad_norm_, ...), after its allreduce had started: the change would be lost or race "
    "with the allreduce. Call optimizer.synchronize() first, then modify the gradients, then "
    "call optimizer.step() inside optimizer.skip_synchronize() (docs/torch.md)")


if TYPE_CHECKING:
    # The type checker sees the mixin as what rebase makes of it, a subclass of the wrapped
    # optimizer's class: param_groups, super().step() and the rest are torch's.
    _Optimizer = torch.optim.Optimizer
else:
    _Optimizer = object


class _DistributedOptimizer(_Optimizer):
    """Reduces gradients across ranks before the wrapped optimizer's step (module docstring)."""

    backward_passes_per_step: int
    op: ReduceOp
    gradient_predivide_factor: float
    sparse_as_dense: bool

    # ------------------------------------------------------------------ set-up
    def _gs_setup(self, named_parameters, compression: type[Compressor],
                  backward_passes_per_step: int, op: ReduceOp,
                  gradient_predivide_factor: float, groups, sparse_as_dense: bool,
                  process_set: ProcessSet = global_process_set, gradient_lag: int = 0) -> None:
        # Buckets go through the set's controller like any Horovod-API allreduce: a rank
        # that has joined then contributes zeros to them (join.py).
        self._gs_process_set = process_set
        self._gs_names = _parameter_names(self.param_groups, named_parameters)
        # Horovod's attribute (parameter -> name), which scripts and Horovod's tests read.
        self._parameter_names = {p: self._gs_names[id(p)] for g in self.param_groups
                                 for p in g["params"]}
        self._gs_groups = _check_groups(groups, self.param_groups)
        self._gs_compression = compression
        # A compressor that replaces the allreduce (an instance: its state lives there).
        self._gs_reducer = reducing(compression)
        self.backward_passes_per_step = backward_passes_per_step
        self.op, self.sparse_as_dense = op, sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.gradient_lag = gradient_lag
        # compression="auto" allowed to choose local SGD (an Auto with local_sgd=H).
        # (That Auto itself, or None: attached here, told of each step's end in step().)
        reducer = self._gs_reducer
        self._gs_local = reducer if isinstance(reducer, Auto) and reducer.periods else None
        factor = gradient_predivide_factor
        self._gs_scale = (1.0 / factor, factor) if op is Average else (1.0, 1.0)
        self._gs_should_synchronize = True
        self._gs_synchronized = False
        self._gs_superseded = False
        self._gs_hooks: list[torch.utils.hooks.RemovableHandle] = []
        weakref.finalize(self, remove_hooks, self._gs_hooks)
        self._gs_build()

    def _gs_build(self) -> None:
        """Plans the buckets and hooks every trainable parameter (a collective: the layout
        check). Runs at construction and after ``add_param_group``."""
        remove_hooks(self._gs_hooks)
        _LIVE.discard(self)
        for lag in (getattr(self, "_gs_lag", None) or {}).values():
            lag.drop()  # the buckets change: rounds in flight cannot be applied to them
        params, names = [], []
        self._gs_frozen: list[tuple[str, torch.Tensor]] = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                name = self._gs_names.get(id(p), f"allreduce.noname.{gi}.{pi}")
                if p.requires_grad:
                    params.append(p)
                    names.append(name)
                else:
                    self._gs_frozen.append((name, p))
        self._gs_buckets: list[Bucket] = []
        self._gs_slot_param: list[torch.Tensor] = []
        self._gs_slot_view: list[torch.Tensor] = []
        self._gs_slot_bucket: list[Bucket] = []
        self._gs_slot_name: list[str] = []
        # Horovod reduces nothing in a one-rank job; neither do we (step is the plain step).
        if self._gs_size() > 1 and params:
            # Reduced as they are (no compression cast), buckets live in buffers that the
            # host's other ranks map: their allreduce skips the staging copies
            # (transport/segment_shared.py).
            host = None
            # (Not with a lag: its allreduces work on copies, lag.py.)
            if (self._gs_compression is Compression.none and self._gs_reducer is None
                    and self.op is not Adasum and not self.gradient_lag):
                host = _psets.controller(self._gs_process_set).world
            plan = assign_buckets(params, self._gs_groups)
            shared: set[int] = set()
            above = host.shared_above() if host is not None else None  # None: no segment
            if above is not None:
                shared = choose_shared(
                    [sum(params[i].numel() * params[i].element_size() for i in members)
                     for members in plan],
                    above if _buckets.SHARED_ABOVE is None else _buckets.SHARED_ABOVE)
            for k, members in enumerate(plan):
                first = len(self._gs_slot_param)
                bucket = Bucket(k, list(range(first, first + len(members))),
                                [params[i] for i in members], [names[i] for i in members],
                                host if k in shared else None)
                self._gs_buckets.append(bucket)
                for param, view in bucket.pairs:
                    self._gs_slot_param.append(param)
                    self._gs_slot_view.append(view)
                    self._gs_slot_bucket.append(bucket)
                self._gs_slot_name.extend(bucket.names)
            check_layout(self._gs_buckets, self._gs_allgather_object)
            if self._gs_local is not None:  # the same parameters, in the same order, on every rank
                self._gs_local.attach(params, comm="horovod", process_set=self._gs_process_set,
                                        name=f"auto.local_sgd.{names[0]}", optimizer=self)
            ref = weakref.ref(self)
            for slot, param in enumerate(self._gs_slot_param):
                self._gs_hooks.append(param.register_post_accumulate_grad_hook(
                    grad_hook(self, slot)))
                _take_ownership(param, ref)
            _LIVE.add(self)
        self._gs_lag = ({b.index: BucketLag(b.buffer) for b in self._gs_buckets}
                        if self.gradient_lag and self._gs_buckets else None)
        self._gs_nothing_to_apply = False  # a lagged first round: step() skips the update
        self._gs_dense: set[int] = set()  # slots whose gradient backward made dense
        self._gs_sparse_ever: set[int] = set()  # slots that had a sparse gradient
        self._gs_rebind()
        self._gs_reset_round()

    def _gs_rebind(self) -> None:
        """Which gradients ``zero_grad()`` makes views of their buckets (``_gs_bound``) and
        which it sets to None (``_gs_unbound``). A slot is bound once backward has given it a
        dense gradient (``_gs_dense``), and never after a sparse one: bound to a dense view, a
        sparse gradient would be accumulated into it and lose its layout."""
        dense = self._gs_dense
        bound = [(self._gs_slot_param[slot], self._gs_slot_view[slot]) for slot in sorted(dense)]
        ids = {id(p) for p, _ in bound}
        self._gs_bound = bound
        self._gs_unbound = [p for g in self.param_groups for p in g["params"]
                            if id(p) not in ids]
        self._gs_bind_stale = False

    def _gs_supersede(self) -> None:
        """Called when a newer DistributedOptimizer hooks one of our parameters."""
        remove_hooks(self._gs_hooks)
        _LIVE.discard(self)
        self._gs_buckets = []
        self._gs_round_open = False
        self._gs_superseded = True

    # ------------------------------------------------------------------ one round
    def _gs_reset_round(self) -> None:
        self._gs_passes_left = [self.backward_passes_per_step] * len(self._gs_slot_param)
        self._gs_sparse: dict[int, int] = {}  # slot -> sparse_dim of its sparse gradient
        # slot -> the sparse allreduce of its gradient (without sparse_as_dense)
        self._gs_sparse_reduce: dict[int, Callable[[], torch.Tensor]] = {}
        # The gradient each slot was copied from, and its version then: a later in-place change
        # would never reach the bucket, so _gs_finish refuses it.
        self._gs_staged: list[torch.Tensor | None] = [None] * len(self._gs_slot_param)
        self._gs_staged_version = [0] * len(self._gs_slot_param)
        for bucket in self._gs_buckets:
            bucket.pending = len(bucket.slots)
        self._gs_next = 0  # the next bucket to launch
        self._gs_round_open = False  # a hook fired since the last synchronize

    def _gs_grad_ready(self, slot: int, param: torch.Tensor) -> None:
        """The hook: ``param``'s gradient has been accumulated (once more) this round."""
        left = self._gs_passes_left[slot]
        if left == 0:
            raise RuntimeError(
                f"the gradient of '{self._gs_slot_name[slot]}' was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "step() or synchronize(); raise backward_passes_per_step to accumulate more "
                "backward passes locally")
        if not self._gs_round_open:
            # A new round: gradients synchronized before it (and never stepped with, as when
            # GradScaler skips a step) are superseded by this backward's.
            self._gs_round_open, self._gs_synchronized = True, False
        self._gs_passes_left[slot] = left - 1
        if left > 1:
            return
        self._gs_stage(slot, param.grad)
        bucket = self._gs_slot_bucket[slot]
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._gs_next:
            self._gs_launch_ready()

    def _gs_stage(self, slot: int, grad: torch.Tensor | None) -> None:
        """Puts a gradient into its view of its bucket (zeros for a missing one)."""
        view = self._gs_slot_view[slot]
        if grad is view:  # backward accumulated straight into the bucket
            if slot not in self._gs_dense and slot not in self._gs_sparse_ever:
                self._gs_dense.add(slot)
                self._gs_bind_stale = True
            return
        if grad is None:
            view.zero_()
            return
        self._gs_staged[slot], self._gs_staged_version[slot] = grad, grad._version
        if grad.layout != torch.strided:
            if grad.layout != torch.sparse_coo:
                raise NotImplementedError(
                    f"'{self._gs_slot_name[slot]}' has a {grad.layout} gradient; "
                    "DistributedOptimizer reduces dense and sparse COO gradients")
            self._gs_sparse_ever.add(slot)
            if slot in self._gs_dense:
                self._gs_dense.discard(slot)
                self._gs_bind_stale = True
            if not self.sparse_as_dense and self._gs_lag is not None:
                raise NotImplementedError(
                    f"'{self._gs_slot_name[slot]}' has a sparse gradient: with gradient_lag, "
                    "pass sparse_as_dense=True")
            if not self.sparse_as_dense:
                # As Horovod: indices and values are allgathered (grouped.py), beside the
                # bucket, whose view of this parameter reduces zeros.
                self._gs_sparse_reduce[slot] = sparse_allreduce_async(
                    grad, self._gs_slot_name[slot], self.op, self._gs_process_set)
                view.zero_()
                return
            self._gs_sparse[slot] = grad.sparse_dim()
            grad = grad.to_dense()
        elif slot not in self._gs_dense and slot not in self._gs_sparse_ever:
            self._gs_dense.add(slot)  # from the next zero_grad() on, backward writes the view
            self._gs_bind_stale = True
        view.copy_(grad)

    def _gs_launch_ready(self) -> None:
        buckets = self._gs_buckets
        while self._gs_next < len(buckets) and buckets[self._gs_next].pending == 0:
            self._gs_launch(buckets[self._gs_next])

    def _gs_launch(self, bucket: Bucket) -> None:
        bucket.pending = 0
        prescale, postscale = self._gs_scale
        source, name = bucket.buffer, bucket.name
        lag = self._gs_lag[bucket.index] if self._gs_lag is not None else None
        if lag is not None:  # a copy, so that the next backward can fill the bucket
            source, which = lag.source(bucket.buffer)
            name = f"{bucket.name} lag{which}"
        if self._gs_reducer is not None:
            wire, ctx = source, None
            handle = _requests.compressed_allreduce(
                source, [tuple(p.shape) for p, _ in bucket.pairs], name, self.op, prescale,
                postscale, self._gs_process_set, self._gs_reducer, bucket.name, inplace=True,
                asynchronous=True)
        else:
            wire, ctx = self._gs_compression.compress(source)
            handle = _requests.allreduce(wire, name, self.op, prescale, postscale,
                                         self._gs_process_set, inplace=True, asynchronous=True)
        # The name is free once the allreduce is done, as in Horovod: a round abandoned (a
        # backward never stepped, then another optimizer over a model with the same parameter
        # names) must not hold it until this optimizer synchronizes, which it may never do.
        handle.release()
        if lag is None:
            bucket.handle, bucket.wire, bucket.ctx = handle, wire, ctx
        elif self._gs_reducer is not None:  # reduced in place, in this round's copy
            lag.started(handle, lambda: source)
        else:
            decompress = self._gs_compression.decompress
            lag.started(handle, lambda: decompress(wire, ctx))
        # Views share their base's version counter, and the allreduce writes through NumPy
        # without bumping it: any change seen in _gs_finish came from an in-place op on a grad.
        bucket.version = bucket.buffer._version
        self._gs_next = bucket.index + 1

    def _waited(self, wait):
        """``wait()``, its time told to a compressor that weighs it (``compression="auto"``:
        what the exchange costs the step is what the training thread waits, the rest ran
        behind backward)."""
        tell = getattr(self._gs_reducer, "blocked", None)
        if tell is None:
            return wait()
        begin = time.perf_counter()
        try:
            return wait()
        finally:
            tell(time.perf_counter() - begin)

    def _gs_finish(self, bucket: Bucket) -> None:
        if self._gs_lag is not None:
            # This round's allreduce works on a copy; the previous round's lands here.
            if bucket.buffer._version != bucket.version:
                raise RuntimeError(_MODIFIED.format(what=f"a gradient in {bucket.name}"))
            result = self._waited(self._gs_lag[bucket.index].land)
            if result is None:  # the first round: nothing to apply yet (lag.py)
                self._gs_nothing_to_apply = True
                bucket.buffer.zero_()
            else:
                bucket.buffer.copy_(result)
        else:
            handle, wire = bucket.handle, bucket.wire
            assert handle is not None and wire is not None  # launched this round (_gs_launch)
            self._waited(handle.wait)
            if bucket.buffer._version != bucket.version:
                raise RuntimeError(_MODIFIED.format(what=f"a gradient in {bucket.name}"))
            result = (bucket.buffer if self._gs_reducer is not None else
                      self._gs_compression.decompress(wire, bucket.ctx))
            if result is not bucket.buffer:
                bucket.buffer.copy_(result)
            bucket.handle = bucket.wire = bucket.ctx = None
        staged, versions, sparse = self._gs_staged, self._gs_staged_version, self._gs_sparse
        for slot, (param, view) in zip(bucket.slots, bucket.pairs):
            grad = param.grad
            if grad is view:
                continue
            source = staged[slot]
            if source is not None and (grad is not source or grad._version != versions[slot]):
                raise RuntimeError(_MODIFIED.format(
                    what=f"the gradient of '{self._gs_slot_name[slot]}'"))
            reduce = self._gs_sparse_reduce.get(slot)
            if reduce is not None:
                param.grad = reduce()
                continue
            # Sparse gradients are handed back in the layout backward produced.
            param.grad = view.to_sparse(sparse[slot]) if slot in sparse else view

    def _gs_size(self) -> int:
        """Ranks that reduce together; 1 on a rank outside the process set, which, as in
        Horovod, steps on its own gradients."""
        if not _psets.is_member(self._gs_process_set):
            return 1
        return len(_psets.controller(self._gs_process_set).ranks)

    def _gs_allgather_object(self, obj, name: str) -> list:
        return _requests.allgather_object(obj, name, self._gs_process_set)

    def _gs_check_usable(self) -> None:
        if self._gs_superseded:
            raise RuntimeError("this DistributedOptimizer no longer reduces gradients: a newer "
                               "DistributedOptimizer was created over its parameters; use that "
                               "one")

    # ------------------------------------------------------------------ public
    def synchronize(self) -> None:
        """Finishes this round's gradient allreduce; each ``param.grad`` then holds the result.

        Launches, in order, the buckets that backward did not complete (a missing gradient
        counts as zeros), then waits for every bucket still in flight. Once a round is
        synchronized, calling it again before the next backward (or ``step()`` after it) does
        not reduce the gradients a second time.
        """
        self._gs_check_usable()
        if self._gs_synchronized and not self._gs_round_open:
            return
        self._gs_nothing_to_apply = False
        if self._gs_buckets:
            for name, param in self._gs_frozen:
                if param.requires_grad:
                    raise RuntimeError(
                        f"parameter '{name}' became trainable after DistributedOptimizer was "
                        "created, so no rank reduces its gradient; create the "
                        "DistributedOptimizer after unfreezing (or add it with "
                        "add_param_group)")
            passes_left = self._gs_passes_left
            for bucket in self._gs_buckets[self._gs_next:]:
                for slot in bucket.slots:
                    if passes_left[slot]:
                        self._gs_stage(slot, self._gs_slot_param[slot].grad)
                self._gs_launch(bucket)
            for bucket in self._gs_buckets:
                self._gs_finish(bucket)
            self._gs_reset_round()
        self._gs_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not synchronize: for use after ``synchronize()``.

        Example (gradient clipping)::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._gs_should_synchronize = False
        try:
            yield
        finally:
            self._gs_should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None):  # torch's types
        """Synchronizes (unless inside ``skip_synchronize``), then the wrapped step.

        With a ``closure``, the gradients it computes are synchronized before the wrapped
        optimizer uses them.
        """
        if self._gs_should_synchronize:
            if self._gs_synchronized and not self._gs_round_open:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(); the gradients are not reduced again, but "
                    "use optimizer.skip_synchronize() around step() to say so (Horovod's "
                    "warning)", stacklevel=2)
            if closure is None:
                self.synchronize()
            else:
                closure = self._gs_synchronizing(closure)
        try:
            if self._gs_lag is not None and closure is not None:
                loss = closure()  # synchronizes: whether there is anything to apply is known
                if not self._gs_nothing_to_apply:
                    super().step()
            elif self._gs_nothing_to_apply:  # gradient_lag's first round (lag.py)
                loss = None
            else:
                loss = super().step() if closure is None else super().step(closure)
        finally:
            self._gs_synchronized = False
            self._gs_nothing_to_apply = False
        if self._gs_local is not None:
            self._gs_local.after_step()  # a local SGD window's end: the parameters averaged
        meter.mark_step()  # a training step ends: stragglers are judged by steps (pace.py)
        return loss

    def _gs_synchronizing(self, closure: Callable[[], float]) -> Callable[[], float]:
        def synchronized_closure() -> float:
            loss = closure()
            self.synchronize()
            return loss

        return synchronized_closure

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears the gradients for the next round.

        Args:
            set_to_none: None (default): every gradient that a bucket reduces becomes its
                view of the bucket, zeroed in place (one ``zero_`` per bucket), so that
                backward accumulates straight into the fusion buffers and nothing is staged
                (DDP's ``gradient_as_bucket_view``); ``p.grad`` is then a zero tensor, not
                None. That holds from the first round in which backward gave the parameter a
                dense gradient on; the others (not yet computed, sparse, frozen, every
                parameter in a one-rank job) are set to None as by ``torch.optim``. True: every
                gradient becomes None (``torch.optim``'s default; backward then allocates new
                gradients and the hooks copy them into the buckets). False: zeroed in place.
        """
        if self._gs_round_open:
            raise RuntimeError(
                "optimizer.zero_grad() was called after backward() but before step() or "
                "synchronize(): this round's gradients are being reduced across ranks. Call "
                "step() (or synchronize()) first")
        if set_to_none is not None or not self._gs_buckets:
            super().zero_grad(True if set_to_none is None else set_to_none)
            return
        if self._gs_bind_stale:
            self._gs_rebind()
        for bucket in self._gs_buckets:
            bucket.buffer.zero_()
        for param, view in self._gs_bound:
            if param.grad is not view:
                param.grad = view
        for param in self._gs_unbound:
            param.grad = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the wrapped optimizer's state; a round in progress is finished and dropped."""
        for bucket in self._gs_buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = bucket.wire = bucket.ctx = None
        for lag in (self._gs_lag or {}).values():
            lag.drop()
        self._gs_reset_round()
        self._gs_synchronized, self._gs_should_synchronize = False, True
        super().load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group, as ``torch.optim.Optimizer`` does, and re-plans the buckets.

        Every rank must add the same group at the same point: re-planning checks the layout
        with a collective.
        """
        self._gs_require_idle("add_param_group")
        super().add_param_group(param_group)
        self._gs_build()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated before the allreduce."""
        _check_passes(passes)
        self._gs_require_idle("set_backward_passes_per_step")
        self.backward_passes_per_step = passes
        self._gs_reset_round()

    def _gs_require_idle(self, what: str) -> None:
        if self._gs_round_open:
            raise RuntimeError(f"{what}() was called between backward() and step(); call "
                               "step() or synchronize() first")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         gradient_lag: int = 0,
                         local_sgd: int | None = None) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Gradient allreduces start during backward, in fixed buckets of at most
    ``fusion_threshold`` bytes (``GRADSYNC_FUSION_THRESHOLD``); ``step()`` waits for those still
    in flight. Use the returned optimizer, not ``optimizer``: they share ``param_groups`` and
    ``state``.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``(name, parameter)`` pairs naming every parameter of
            ``optimizer`` (usually ``model.named_parameters()``); names appear in errors.
        compression: ``Compression.none``, ``.fp16``, ``.bf16`` or a custom compressor; or
            one that replaces each bucket's allreduce, with error feedback:
            ``Compression.int8``, ``.fp8``, ``.powersgd``, ``.randomk`` (the class for its
            defaults, or an instance, e.g. ``Compression.powersgd(rank=4)``, whose
            ``state_dict()`` holds the residuals); or ``"auto"`` (``Compression.auto``):
            per bucket, none, bf16, int8, int4 or PowerSGD chosen from the measured link and
            step (docs/slow-links.md). Not with ``op=Adasum`` or ``join()``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each parameter's local update is
            Adasum-reduced instead of the gradients (``adasum_optimizer.py``).
        gradient_predivide_factor: with ``Average``, scale by 1/f before the sum and by f/size
            after it.
        num_groups: deprecated spelling of an integer ``groups`` (as in Horovod).
        groups: explicit fusion groups instead of the threshold: an int (that many groups of
            consecutive parameters) or a list of lists of parameters (each list one group; any
            parameter not listed is a group of its own).
        sparse_as_dense: reduce sparse gradients as dense tensors (otherwise they raise).
        process_set: the ranks that average their gradients (default: all), registered. On a
            rank outside it the optimizer reduces nothing and steps on the local gradients,
            as in Horovod.
        gradient_lag: 0 (default) or 1: each round's allreduces are waited for and applied
            at the next round's ``step()``, overlapping the next forward and backward
            (Kurth et al., SC18; ``lag.py``). The first ``step()`` applies nothing. Not with
            ``op=Adasum``; sparse gradients need ``sparse_as_dense``.
        local_sgd: with ``compression="auto"``: the largest H for which auto may choose
            local SGD (each rank steps on its own gradients, the parameters are averaged
            every H steps) where the measured link makes the exchange cost the step more
            than a tenth of its compute (docs/slow-links.md); None (default): never.
            ``Compression.auto(local_sgd=H)`` is the same. Only with ``op=Average`` and
            without ``gradient_lag``.

    Raises:
        ValueError: bad ``named_parameters`` (not pairs, duplicate names, an optimizer
            parameter without a name), bad ``groups``, op other than Average/Sum/Adasum, a
            predivide factor with Sum or Adasum.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, (_DistributedOptimizer, adasum_optimizer.AdasumOptimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    compression = _allow_local_sgd(compression, local_sgd)
    if getattr(compression, "periods", ()) and (op is not Average or gradient_lag):
        raise ValueError(f"compression={compression!r} may choose local SGD: only with "
                         f"op=Average and gradient_lag=0 (got op={op!r}, gradient_lag="
                         f"{gradient_lag!r})")
    if isinstance(gradient_lag, bool) or gradient_lag not in (0, 1):
        raise ValueError(f"gradient_lag must be 0 or 1, got {gradient_lag!r}")
    if gradient_lag and op is Adasum:
        raise ValueError("gradient_lag cannot be used with op=Adasum")
    _psets.is_member(process_set)  # registered (a rank outside the set reduces nothing)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer reduces gradients with op=Average, op=Sum or "
                         f"op=Adasum, got {op!r}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got "
                         f"{gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if reducing(compression) is not None:
        if op is Adasum:
            raise ValueError(f"op=Adasum cannot use compression={compression!r}: Adasum "
                             "combines whole vectors, the compressor sums")
    elif not (callable(getattr(compression, "compress", None))
              and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must have compress() and decompress() (or own its "
                        f"reduction, as Compression.int8 does), got {compression!r}")
    _check_passes(backward_passes_per_step)
    if num_groups:
        warnings.warn("num_groups is deprecated (as in Horovod): use groups", DeprecationWarning,
                      stacklevel=2)
        groups = num_groups if groups is None else groups
    if op is Adasum:
        if process_set is not global_process_set:
            raise NotImplementedError("DistributedOptimizer(op=Adasum) runs on the global "
                                      "process set only")
        return adasum_optimizer.wrap(optimizer,
                                     _parameter_names(optimizer.param_groups, named_parameters),
                                     compression, backward_passes_per_step, groups,
                                     sparse_as_dense)
    wrapped = rebase(optimizer, _DistributedOptimizer)
    wrapped._gs_setup(named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set,
                      gradient_lag)
    return wrapped


def live_optimizers() -> list[_DistributedOptimizer]:
    """The DistributedOptimizers of this process that reduce gradients (for ``join``)."""
    return list(_LIVE)


# ----------------------------------------------------------------------------- helpers
def _allow_local_sgd(compression, local_sgd):
    """``compression`` with local SGD allowed up to H = ``local_sgd`` (auto only)."""
    if local_sgd is None:
        return compression
    if isinstance(local_sgd, bool) or not isinstance(local_sgd, int) or local_sgd < 1:
        raise ValueError(f"local_sgd must be None or an int >= 1 (the largest H), got "
                         f"{local_sgd!r}")
    auto = Compression.auto
    if (isinstance(compression, str) and compression == "auto") or compression is auto:
        return auto(local_sgd=local_sgd)
    if isinstance(compression, auto):
        if compression.periods != periods_upto(local_sgd):
            raise ValueError(f"local_sgd={local_sgd} and {compression!r} disagree: give the "
                             "largest H once (Compression.auto(local_sgd=H) or local_sgd=H)")
        return compression
    raise ValueError(f"local_sgd={local_sgd} is a choice for compression='auto', not "
                     f"{compression!r}; for a fixed H use gradsync.compress.DiLoCo")


def _take_ownership(param: torch.Tensor, ref: "weakref.ref[_DistributedOptimizer]") -> None:
    # Two live optimizers hooked on one parameter would both launch allreduces for it, and the
    # older one's never-synchronized rounds would fail the next backward. Re-wrapping a model
    # (a new DistributedOptimizer over the same parameters) is common, so the newest wins.
    previous = getattr(param, _OWNER, None)
    previous = previous() if previous is not None else None
    if previous is not None and previous is not ref():
        previous._gs_supersede()
    setattr(param, _OWNER, ref)


def _check_passes(passes: int) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")


def _parameter_names(param_groups: list[dict], named_parameters) -> dict[int, str]:
    """Validates ``named_parameters`` as Horovod does; returns id(parameter) -> name."""
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{gi}.{pi}"
                for gi, group in enumerate(param_groups) for pi, p in enumerate(group["params"])}
    named = list(named_parameters)
    if not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
               for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    seen: set[str] = set()
    duplicates: set[str] = set()
    for name, _ in named:
        if name in seen:
            duplicates.add(name)
        seen.add(name)
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(sorted(map(str, duplicates)))}")
    names: dict[int, str] = {}
    for name, p in named:
        if id(p) in names:
            raise ValueError(f"parameter '{names[id(p)]}' appears again in named_parameters as "
                             f"'{name}': each parameter needs exactly one name")
        names[id(p)] = name
    unnamed = [f"param_groups[{gi}]['params'][{pi}] of shape {tuple(p.shape)}"
               for gi, group in enumerate(param_groups) for pi, p in enumerate(group["params"])
               if id(p) not in names]
    if unnamed:
        more = f" and {len(unnamed) - 3} more" if len(unnamed) > 3 else ""
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named: {', '.join(unnamed[:3])}{more} (pass the "
                         "named_parameters() of the model that the optimizer trains)")
    return names


def _check_groups(groups, param_groups: list[dict]) -> int | list[list[torch.Tensor]] | None:
    if groups is None:
        return None
    if isinstance(groups, bool) or not isinstance(groups, (int, list)) or (
            isinstance(groups, int) and groups <= 0):
        raise ValueError(f"groups should be a positive integer or a list of lists of "
                         f"torch.Tensor, got {groups!r}")
    if isinstance(groups, int):
        return groups
    in_optimizer = {id(p) for group in param_groups for p in group["params"]}
    seen: set[int] = set()
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups should be a list of lists of torch.Tensor, found {group!r}")
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups must consist of torch.Tensor, found {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups")
            if id(p) not in in_optimizer:
                raise ValueError(f"groups contains a tensor of shape {tuple(p.shape)} that is "
                                 "not a parameter of the optimizer")
            seen.add(id(p))
    return [list(group) for group in groups]
